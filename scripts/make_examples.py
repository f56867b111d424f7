"""Write specs/examples/: legal traces for each mode and version, and illegal traces covering
every violation code and every rule that version 2 (fences) and version 3 (hybrid models)
add or change.

Illegal examples are short, hand-readable traces named `illegal-CODE-what.jsonl`; each breaks
exactly the rule its name gives. Run: python scripts/make_examples.py
"""

from __future__ import annotations

from pathlib import Path

from pdref import events as ev
from pdref.geometry import Geometry
from pdref.synth import SynthConfig, synth_trace
from pdref.trace import dumps

OUT = Path(__file__).resolve().parent.parent / "specs" / "examples"
GEO = {"layers": 2, "kv_heads": 1, "head_dim": 4, "dtype_bytes": 2, "page_tokens": 4,
       "recurrent": False}
HEADER = {"kind": "header", "version": 2, "source": "hand", "mode": "chunk", "geometry": GEO,
          "pool_pages": 8, "max_pending": 2}
HEADER_V1 = {**HEADER, "version": 1}
B = 16  # KV bytes of one token on one layer: 2 * 1 * 4 * 2


def R(t, **kw):  # noqa: N802 - a short builder keeps the examples readable
    return {"t": t, "req": kw.pop("req", "a"), **kw}


def reserve(t, prompt=8, prefix=0, pages=(0, 1), **kw):
    return R(t, kind="reserve", prompt=prompt, prefix=prefix, pages=list(pages), **kw)


def computed(t, layers=(0, 2), tokens=(0, 8), **kw):
    return R(t, kind="computed", layers=list(layers), tokens=list(tokens), **kw)


def issue(t, span, layers=(0, 2), tokens=(0, 8), nbytes=None, **kw):
    size = B * (layers[1] - layers[0]) * (tokens[1] - tokens[0]) if nbytes is None else nbytes
    return R(t, kind="issue", span=span, layers=list(layers), tokens=list(tokens), bytes=size,
             **kw)


def simple(kind, t, **kw):
    return R(t, kind=kind, **kw)


# The legal two-chunk life every illegal example starts from or edits.
LIFE = [
    reserve(0.0),
    computed(0.1, tokens=(0, 4)), issue(0.1, 0, tokens=(0, 4)),
    computed(0.2, tokens=(4, 8)), issue(0.2, 1, tokens=(4, 8)),
    simple("produced", 0.2, token=7),
    simple("land", 0.3, span=0), simple("land", 0.4, span=1),
    simple("admit", 0.4), simple("release", 0.9),
]


def fence(t, span, **kw):
    return R(t, kind="fence", span=span, **kw)


def fail(t, span, **kw):
    return R(t, kind="fail", span=span, error="link down", **kw)


# v2: a life aborted while span 0 is in flight; its pages are quarantined until the fence.
CANCELLED = [reserve(0.0), computed(0.1), issue(0.1, 0),
             simple("abort", 0.2, reason="cancelled by client")]


def edit(index, replacement):
    """LIFE with event `index` replaced by the given events (none: deleted)."""
    return LIFE[:index] + list(replacement) + LIFE[index + 1:]


ILLEGAL = {
    "TRACE-1-float-token-count": [reserve(0.0, prompt=8.0)],
    "TRACE-1-missing-header": None,  # written specially below
    "TRACE-2-time-goes-back": [reserve(1.0), computed(0.5)],
    "CFG-1-layer-mode-recurrent": [],
    "SLAB-1-page-held-by-another-slab": [reserve(0.0), reserve(0.1, req="b", pages=(1, 2))],
    "SLAB-1-wrong-page-count": [reserve(0.0, pages=(0, 1, 2))],
    "SLAB-2-prefix-not-page-aligned": [reserve(0.0, prefix=3, pages=(0, 1))],
    "REQ-1-land-twice": edit(7, [simple("land", 0.4, span=1), simple("land", 0.4, span=1)]),
    "REQ-1-span-id-reused": edit(4, [issue(0.2, 0, tokens=(4, 8))]),
    "COV-1-span-outside-suffix": [reserve(0.0, prefix=4, pages=(0,)), computed(0.1),
                                  issue(0.1, 0, tokens=(0, 8))],
    "COV-2-overlapping-spans-in-flight": edit(4, [issue(0.2, 1, tokens=(2, 8))]),
    "COV-3-admit-before-last-layer": [reserve(0.0), computed(0.1), issue(0.1, 0, layers=(0, 1)),
                                      simple("produced", 0.1, token=3), simple("land", 0.2, span=0),
                                      simple("admit", 0.3)],
    "COPY-1-span-from-reused-source": [reserve(0.0), computed(0.1),
                                       simple("reuse", 0.2, tokens=[0, 4]), issue(0.3, 0)],
    "COPY-2-too-many-pending": [reserve(0.0), computed(0.1), issue(0.1, 0, tokens=(0, 2)),
                                issue(0.1, 1, tokens=(2, 4)), issue(0.1, 2, tokens=(4, 8))],
    "COPY-3-reuse-under-copy": [reserve(0.0), computed(0.1), issue(0.1, 0),
                                simple("reuse", 0.2, tokens=[6, 8])],
    "COPY-4-wrong-bytes": [reserve(0.0), computed(0.1), issue(0.1, 0, nbytes=100)],
    "PROD-1-produced-before-computed": [reserve(0.0), computed(0.1, layers=(0, 1)),
                                        simple("produced", 0.2, token=1)],
    "ADM-1-admit-with-failed-span": [reserve(0.0), computed(0.1), issue(0.1, 0),
                                     simple("fail", 0.2, span=0, error="link down"),
                                     simple("produced", 0.2, token=1), simple("admit", 0.3)],
    "ADM-1-admit-before-produced": edit(5, []),
    "LIFE-1-release-before-admit": edit(8, []),
    "LIFE-1-trace-ends-holding-pages": LIFE[:-1],
    # Version 2: fences.
    "TRACE-1-fence-in-version-1": None,  # written specially below (a version 1 header)
    "TRACE-1-fence-without-span": [*CANCELLED, simple("fence", 0.3)],
    "TRACE-1-version-5": [reserve(0.0)],  # header edited below
    "COPY-5-reserve-takes-quarantined-page": [*CANCELLED,
                                              reserve(0.3, req="b", prompt=4, pages=(1,))],
    "COPY-2-unfenced-span-holds-its-slot": [
        reserve(0.0), computed(0.1), issue(0.1, 0, tokens=(0, 2)), fail(0.2, 0),
        issue(0.2, 1, tokens=(2, 4)), issue(0.2, 2, tokens=(4, 8))],
    "COPY-3-reuse-under-unfenced-span": [reserve(0.0), computed(0.1), issue(0.1, 0),
                                         fail(0.2, 0), simple("reuse", 0.3, tokens=[0, 8])],
    "REQ-1-fence-twice": [*CANCELLED, fence(0.3, 0), fence(0.4, 0)],
    "REQ-1-fence-of-a-landed-span": LIFE[:7] + [fence(0.3, 0)],
    "ADM-1-admit-after-fenced-failure": [
        reserve(0.0), computed(0.1), issue(0.1, 0), fail(0.2, 0), fence(0.2, 0), issue(0.3, 1),
        simple("produced", 0.3, token=1), simple("land", 0.4, span=1), simple("admit", 0.4)],
    "LIFE-1-trace-ends-with-unfenced-span": CANCELLED,
}

LEGAL_EXTRA = {
    "legal-hand-chunk": LIFE,
    "legal-hand-empty-suffix": [reserve(0.0, prefix=8, pages=()), computed(0.1),
                                simple("produced", 0.1, token=5), simple("admit", 0.1),
                                simple("release", 0.2)],
    "legal-hand-fail-fence-abort-retry": [
        reserve(0.0), computed(0.1), issue(0.1, 0), fail(0.2, 0), fence(0.2, 0),
        simple("abort", 0.2, reason="span failed"),
        reserve(0.3), computed(0.4), issue(0.4, 1), simple("produced", 0.4, token=2),
        simple("land", 0.5, span=1), simple("admit", 0.5), simple("release", 0.6),
    ],
    # The retry reserves other pages while the cancelled writer may still write pages 0, 1;
    # the late fence names the old life's span and gives those pages back.
    "legal-hand-cancel-retry-then-fence": [
        *CANCELLED, reserve(0.3, pages=(2, 3)), fence(0.35, 0), computed(0.4), issue(0.4, 1),
        simple("produced", 0.4, token=2), simple("land", 0.5, span=1), simple("admit", 0.5),
        reserve(0.5, req="b", prompt=4, pages=(0,)), computed(0.5, req="b", tokens=(0, 4)),
        issue(0.5, 2, req="b", tokens=(0, 4)), simple("produced", 0.5, req="b", token=3),
        simple("land", 0.6, req="b", span=2), simple("admit", 0.6, req="b"),
        simple("release", 0.7), simple("release", 0.7, req="b"),
    ],
}
# Version 1 keeps its meaning: a failed or cancelled span needs no fence.
LEGAL_V1 = {
    "legal-v1-fail-abort-retry": [
        reserve(0.0), computed(0.1), issue(0.1, 0), simple("fail", 0.2, span=0, error="timeout"),
        simple("abort", 0.2, reason="span failed"),
        reserve(0.3, pages=(0, 1)), computed(0.4), issue(0.4, 1), simple("produced", 0.4, token=2),
        simple("land", 0.5, span=1), simple("admit", 0.5), simple("release", 0.6),
    ],
}


# Version 3: a hybrid of three layers (linear with a 100-byte state, sliding with a window of
# 5 tokens, full). For the 8-token prompt the sliding layer carries [4, 8): the first decode
# step (position 8) attends 4..8, and 4 starts a page.
GEO_V3 = {**GEO, "layers": 3, "recurrent": True,
          "kinds": [{"kind": "linear", "state_bytes": 100}, {"kind": "sliding", "window": 5},
                    {"kind": "full"}]}
HEADER_V3 = {**HEADER, "version": 3, "geometry": GEO_V3, "max_pending": 3}
ALL3 = (0, 3)


def state(t, span, layers=(0, 1), at=8, nbytes=100, **kw):
    return R(t, kind="issue", span=span, layers=list(layers), tokens=[at, at], bytes=nbytes,
             state=True, **kw)


def hybrid_life(end=True):
    """A legal chunk-mode life of the v3 hybrid: chunk 0 carries the full layer only (the
    sliding layer's window starts at 4), chunk 1 both, then the linear layer's state."""
    head = [reserve(0.0, state_slot=0),
            computed(0.1, ALL3, (0, 4)), issue(0.1, 0, ALL3, (0, 4), nbytes=B * 4),
            computed(0.2, ALL3, (4, 8)), issue(0.2, 1, ALL3, (4, 8), nbytes=B * 8)]
    tail = [state(0.3, 2), simple("produced", 0.3, token=7), simple("land", 0.4, span=0),
            simple("land", 0.4, span=1), simple("land", 0.5, span=2), simple("admit", 0.5),
            simple("release", 0.9)]
    return head + tail if end else head


ILLEGAL_V3 = {
    "STATE-1-state-issued-mid-prompt": hybrid_life(end=False)[:3] + [state(0.15, 1)],
    "STATE-1-state-at-a-mid-prompt-position": hybrid_life(end=False) + [state(0.3, 2, at=4)],
    "STATE-2-state-landed-twice": hybrid_life()[:-1] + [state(0.6, 3)],
    "STATE-3-admit-without-a-state": [e for e in hybrid_life() if e.get("span") != 2],
    "STATE-4-state-written-under-copy": hybrid_life(end=False) + [
        state(0.3, 2), computed(0.35, (0, 1), (7, 8))],
    "STATE-4-reused-state-buffer": hybrid_life(end=False) + [
        state(0.3, 2), simple("abort", 0.4, reason="cancelled"),
        reserve(0.5, req="b", prompt=4, pages=(2,), state_slot=0)],
    "STATE-4-reserve-without-a-state-slot": [reserve(0.0)],
    "SLIDE-1-sliding-span-outside-the-window": hybrid_life(end=False)[:2] + [
        issue(0.1, 0, ALL3, (0, 4), nbytes=B * 8)],
}
LEGAL_V3 = {
    "legal-hand-v3-hybrid-chunk": (HEADER_V3, hybrid_life()),
    # Layer streaming: the linear layer's state ships once that layer has the whole prompt,
    # while the later layers still compute.
    "legal-hand-v3-hybrid-layer": ({**HEADER_V3, "mode": "layer"}, [
        reserve(0.0, state_slot=0), computed(0.1, (0, 1), (0, 8)), state(0.1, 0),
        computed(0.2, (1, 2), (0, 8)), issue(0.2, 1, (1, 2), (4, 8)),
        simple("land", 0.25, span=0),
        computed(0.3, (2, 3), (0, 8)), issue(0.3, 2, (2, 3), (0, 8)),
        simple("produced", 0.3, token=7), simple("land", 0.35, span=1),
        simple("land", 0.4, span=2), simple("admit", 0.4), simple("release", 0.9)]),
    # Sliding windows without linear layers (Gemma 3's kind): only the window crosses on the
    # sliding layer; no state slot is needed.
    "legal-hand-v3-sliding-window-only": (
        {**HEADER_V3, "geometry": {**GEO, "recurrent": False,
                                   "kinds": [{"kind": "sliding", "window": 5}, {"kind": "full"}]}},
        [reserve(0.0), computed(0.1, tokens=(0, 4)), issue(0.1, 0, tokens=(0, 4), nbytes=B * 4),
         computed(0.2, tokens=(4, 8)), issue(0.2, 1, tokens=(4, 8)),
         simple("produced", 0.2, token=7), simple("land", 0.3, span=0),
         simple("land", 0.4, span=1), simple("admit", 0.4), simple("release", 0.9)]),
    # Prefix reuse: the producer resumes the linear layer from its state snapshot at the
    # prefix (it computes [4, 12) only), and the state that crosses is the whole prompt's.
    "legal-hand-v3-hybrid-prefix": (HEADER_V3, [
        reserve(0.0, prompt=12, prefix=4, pages=(0, 1), state_slot=0),
        computed(0.1, ALL3, (4, 12)), issue(0.1, 0, ALL3, (4, 12), nbytes=B * 12),
        state(0.1, 1, at=12), simple("produced", 0.2, token=7), simple("land", 0.3, span=0),
        simple("land", 0.3, span=1), simple("admit", 0.3), simple("release", 0.9)]),
    # A failed state span is fenced and retried like a KV span; the slot is free again
    # after the fence.
    "legal-hand-v3-state-fail-fence-retry": (HEADER_V3, hybrid_life(end=False) + [
        simple("land", 0.25, span=0), simple("land", 0.25, span=1),
        state(0.3, 2), simple("fail", 0.35, span=2, error="link down"),
        simple("abort", 0.35, reason="span failed"), simple("fence", 0.4, span=2),
        *[{**e, "t": e["t"] + 0.5, **({"span": e["span"] + 10} if "span" in e else {})}
          for e in hybrid_life()]]),
}


# Version 4: the prefix cache. Request a (8 tokens, pages 0 and 1) lands and puts both pages
# into the decoder's cache; b (12 tokens) hits them: its slab holds [8, 12) only, one page.
HEADER_V4 = {**HEADER, "version": 4}


def cache(t, tokens=(0, 8), pages=(0, 1), **kw):
    return R(t, kind="cache", tokens=list(tokens), pages=list(pages), **kw)


def evict(t, pages=(0, 1), **kw):
    return R(t, kind="evict", pages=list(pages), **kw)


PUBLISHED = LIFE[:-1] + [cache(0.5), simple("release", 0.9)]
HIT = [reserve(1.0, req="b", prompt=12, prefix=8, pages=(2,), hit=[0, 1]),
       computed(1.1, tokens=(8, 12), req="b"), issue(1.1, 5, tokens=(8, 12), req="b"),
       simple("produced", 1.1, req="b", token=3), simple("land", 1.2, req="b", span=5),
       simple("admit", 1.2, req="b"), simple("release", 1.5, req="b")]
# The producer's side: a puts its computed [0, 8) into p0's cache as pages s0, s1; c (16
# tokens) hits page 0 on the decoder and both on p0: p0 computes [8, 16) only, and only
# [4, 16), the KV the decoder lacks, crosses (s1's page is a copy source).
SOURCE = [reserve(0.0), computed(0.1), cache(0.1, producer="p0", pages=("s0", "s1")),
          issue(0.1, 0), simple("produced", 0.1, token=7), simple("land", 0.2, span=0),
          simple("admit", 0.2), cache(0.2)]
SOURCE_HIT = [reserve(0.3, req="c", prompt=16, prefix=4, pages=(2, 3, 4), hit=[0]),
              computed(0.3, tokens=(0, 8), req="c", hit=["s0", "s1"]),
              computed(0.4, tokens=(8, 16), req="c"), issue(0.4, 1, tokens=(4, 16), req="c")]
SOURCE_END = [simple("produced", 0.4, req="c", token=2), simple("land", 0.5, req="c", span=1),
              simple("admit", 0.5, req="c"), simple("reuse", 0.5, req="c", tokens=[0, 16]),
              simple("release", 0.9), simple("release", 0.9, req="c"),
              evict(1.0, req="d", pages=("s0", "s1"), producer="p0"), evict(1.0, req="d")]
ILLEGAL_V4 = {
    # A hit is legal only on pages the cache holds now: not evicted, not still being written.
    "CACHE-1-hit-on-an-evicted-page": PUBLISHED + [evict(1.0, req="b")] + HIT[:1],
    "CACHE-1-hit-on-a-page-still-written": LIFE[:5] + [
        reserve(0.3, req="b", prompt=12, prefix=8, pages=(2,), hit=[0, 1])],
    "CACHE-1-hit-at-the-wrong-position": PUBLISHED + [
        reserve(1.0, req="b", prompt=12, prefix=8, pages=(2,), hit=[1, 0])],
    "CACHE-1-producer-hit-on-an-uncached-page": [
        reserve(0.0), computed(0.1, tokens=(0, 4), hit=["s0"])],
    # A page enters the cache complete, and no span writes it once cached.
    "CACHE-2-cache-before-landed": LIFE[:7] + [cache(0.3)],
    "CACHE-2-span-over-a-cached-page": LIFE[:8] + [cache(0.4, tokens=(0, 4), pages=(0,)),
                                                   issue(0.5, 9, tokens=(0, 4))],
    # An eviction takes a page nobody holds: not one a live life counts as covered, not a
    # producer's page an unfenced span still reads.
    "EVICT-1-evict-a-page-a-live-life-holds": PUBLISHED + HIT[:5] + [evict(1.3, req="x")],
    "EVICT-1-evict-a-source-page-a-span-reads": SOURCE + SOURCE_HIT + [
        simple("abort", 0.45, req="c", reason="cancelled"), simple("release", 0.45),
        evict(0.5, req="d", pages=("s1",), producer="p0")],
}
LEGAL_V4 = {
    "legal-hand-v4-prefix-cache": PUBLISHED + HIT + [evict(1.6, req="b")],
    "legal-hand-v4-source-cache": SOURCE + SOURCE_HIT + SOURCE_END,
    # The cancelled span's writer is fenced: then the source page may go.
    "legal-hand-v4-evict-after-fence": SOURCE + SOURCE_HIT + [
        simple("abort", 0.45, req="c", reason="cancelled"), fence(0.5, 1, req="c"),
        simple("release", 0.6), evict(0.7, req="d", pages=("s0", "s1"), producer="p0"),
        evict(0.7, req="d")],
}


def write(name: str, header: dict, lines: list[dict]) -> None:
    text = "".join(dumps(obj) + "\n" for obj in [header, *lines])
    (OUT / f"{name}.jsonl").write_text(text, encoding="utf-8")


def write_synthetic() -> None:
    for mode in ev.Mode:
        geometry = Geometry(layers=4, kv_heads=2, head_dim=8, dtype_bytes=2, page_tokens=16)
        header = ev.Header("pdref.synth", mode, geometry, pool_pages=48, max_pending=2,
                           extra=(("chunk", 32),))
        config = SynthConfig(requests=6, max_live=3, max_prompt=160, chunk=32, producers=2,
                             cancel_rate=0.1)
        events = synth_trace(header, config, seed=7)
        write(f"legal-synth-{mode}", ev.header_to_json(header),
              [ev.event_to_json(e) for e in events])


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.jsonl"):
        old.unlink()
    write_synthetic()
    for name, lines in LEGAL_EXTRA.items():
        write(name, HEADER, lines)
    for name, lines in LEGAL_V1.items():
        write(name, HEADER_V1, lines)
    for code_name, lines in ILLEGAL.items():
        if code_name == "TRACE-1-missing-header":
            (OUT / f"illegal-{code_name}.jsonl").write_text(dumps(reserve(0.0)) + "\n")
            continue
        if code_name == "TRACE-1-fence-in-version-1":
            write(f"illegal-{code_name}", HEADER_V1, [*CANCELLED, fence(0.3, 0)])
            continue
        header = HEADER
        if code_name.startswith("CFG-1"):
            header = {**HEADER, "mode": "layer", "geometry": {**GEO, "recurrent": True}}
        if code_name == "TRACE-1-version-5":
            header = {**HEADER, "version": 5}
        write(f"illegal-{code_name}", header, lines)
    for code_name, lines in ILLEGAL_V3.items():
        write(f"illegal-{code_name}", HEADER_V3, lines)
    for name, (header, lines) in LEGAL_V3.items():
        write(name, header, lines)
    for code_name, lines in ILLEGAL_V4.items():
        write(f"illegal-{code_name}", HEADER_V4, lines)
    for name, lines in LEGAL_V4.items():
        write(name, HEADER_V4, lines)


if __name__ == "__main__":
    main()
