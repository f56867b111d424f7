"""Legal version 3 traces of hybrid models, built for the tests (not by pdref's own code), and
Hypothesis strategies drawing them: random layer kinds, prompts, prefixes, chunks, modes."""

from __future__ import annotations

from hypothesis import strategies as st

from pdref import events as ev
from pdref.geometry import Geometry
from pdref.kinds import LayerKind

PAGE = 4


def window_lo(window: int, prompt: int, prefix: int, page: int = PAGE) -> int:
    """The first token a sliding layer carries, written out from the contract's sentence."""
    first = max(0, prompt - window + 1)
    return max(prefix, (first // page) * page)


def kv_bytes(geo: Geometry, layers, tokens, prompt: int, prefix: int, clip=True) -> int:
    """A KV span's bytes, layer by layer (the contract's table, not pdref's runs)."""
    total = 0
    for layer in range(*layers):
        kind = geo.kinds[layer]
        a, b = tokens
        if kind.kind == "sliding" and clip:
            a = max(a, window_lo(kind.window, prompt, prefix, geo.page_tokens))
        if kind.kind != "linear":
            total += max(0, b - a)
    return total * geo.bytes_per_token_layer


def linear_runs(geo: Geometry) -> list[tuple[int, int]]:
    """Maximal runs of consecutive linear layers."""
    runs: list[list[int]] = []
    for layer, kind in enumerate(geo.kinds):
        if kind.kind != "linear":
            continue
        if runs and runs[-1][1] == layer:
            runs[-1][1] = layer + 1
        else:
            runs.append([layer, layer + 1])
    return [tuple(r) for r in runs]


def state_issue(t, req, span, geo, layers, prompt):
    size = sum(geo.kinds[la].state_bytes for la in range(*layers))
    return ev.Issue(t, req, span, layers, (prompt, prompt), size, True)


def hybrid_life(geo: Geometry, mode: str, prompt: int, prefix: int, chunk: int, req="a",
                slot=0, first_span=0, t=0.0, pages=None) -> list:
    """One legal life (max_pending 1: every span lands before the next is issued)."""
    n = -(-(prompt - prefix) // PAGE)
    pages = tuple(range(n)) if pages is None else pages
    L = geo.layers
    out = [ev.Reserve(t, req, prompt, prefix, pages, "p0", slot if geo.recurrent else None)]
    span = first_span

    def send(layers, tokens, state=False):
        nonlocal span
        if state:
            out.append(state_issue(t, req, span, geo, layers, prompt))
        else:
            out.append(ev.Issue(t, req, span, layers, tokens,
                                kv_bytes(geo, layers, tokens, prompt, prefix)))
        out.append(ev.Land(t, req, span))
        span += 1

    if mode == "layer":
        for layer in range(L):
            out.append(ev.Computed(t, req, (layer, layer + 1), (prefix, prompt)))
            send((layer, layer + 1), (prefix, prompt), geo.kinds[layer].kind == "linear")
    else:
        step = chunk if mode == "chunk" else max(1, prompt - prefix)
        for a in range(prefix, prompt, step):
            b = min(prompt, a + step)
            out.append(ev.Computed(t, req, (0, L), (a, b)))
            send((0, L), (a, b))
        if prefix == prompt:
            out.append(ev.Computed(t, req, (0, L), (0, prompt)))
        for run in linear_runs(geo):
            send(run, (prompt, prompt), state=True)
    out += [ev.Produced(t, req, 1), ev.Admit(t, req), ev.Release(t, req)]
    return out


KIND = st.one_of(st.just(LayerKind("full")),
                 st.builds(LayerKind, st.just("sliding"), st.integers(1, 24)),
                 st.builds(LayerKind, st.just("linear"), st.none(), st.integers(1, 64)))


@st.composite
def geometries(draw, linear=False, sliding=False):
    """A geometry with random layer kinds; `linear` / `sliding`: at least one of that kind
    (a sliding one with a window shorter than the shortest prompt drawn, so it clips)."""
    kinds = draw(st.lists(KIND, min_size=1, max_size=5))
    if linear:
        kinds.insert(draw(st.integers(0, len(kinds))), LayerKind("linear", None, 16))
    if sliding:
        kinds.insert(draw(st.integers(0, len(kinds))), LayerKind("sliding", 3))
    return Geometry(layers=len(kinds), kv_heads=1, head_dim=2, dtype_bytes=1, page_tokens=PAGE,
                    recurrent=any(k.kind == "linear" for k in kinds), kinds=tuple(kinds))


@st.composite
def hybrid_traces(draw, linear=False, sliding=False, modes=("whole", "chunk", "layer"),
                  min_prompt=1):
    """(header, events) of one legal hybrid life."""
    geo = draw(geometries(linear, sliding))
    mode = draw(st.sampled_from(modes))
    prompt = draw(st.integers(min_prompt, 40))
    prefix = PAGE * draw(st.integers(0, prompt // PAGE))
    if sliding:  # keep the clipping window inside the suffix
        prefix = min(prefix, PAGE * ((prompt - 8) // PAGE))
    chunk = draw(st.integers(1, 16))
    header = ev.Header("test", mode, geo, pool_pages=32, max_pending=1)
    return header, hybrid_life(geo, mode, prompt, prefix, chunk)
