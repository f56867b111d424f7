"""An independent reading of the trace contract (specs/contract.md), for traces that pdref did
not make: a few of its rules written again from the text, in plain Python over the JSON
objects, sharing no code with pdref (no Monitor, no apply, no parser). It is deliberately
partial (no coverage or byte arithmetic), so it can only say that a trace breaks one of the
rules it knows; the tests use it beside pdref's checker, so a trace both accept is legal by two
paths, not by one path twice."""

from __future__ import annotations

import json


def first_problem(lines: list[bytes] | list[str]) -> str | None:
    """The first rule of those below that the trace breaks, as a short text; None if none."""
    try:
        return _first_problem([json.loads(line) for line in lines if line.strip()])
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        return f"malformed: {e!r}"


def _first_problem(objs: list) -> str | None:
    header, events = objs[0], objs[1:]
    if header.get("kind") != "header":
        return "line 1: not a header"
    fences = header["version"] >= 2
    pool = header["pool_pages"]
    t = 0.0
    live: dict[str, dict] = {}  # req -> its life: pages, produced, admitted, failed
    held: dict[int, str] = {}  # page -> the req whose live slab holds it
    cached: dict = {}  # (v4) (owner, page) -> the reqs of live lives holding it ("": decoder)
    spans: dict = {}  # span id -> [req, life, state]: pending, landed, ended, fenced
    lives = 0
    for n, e in enumerate(events, 2):
        kind, req = e["kind"], e["req"]
        where = f"line {n} ({kind} {req})"
        if e["t"] < t:
            return f"{where}: t goes back"
        t = e["t"]
        if kind == "stage":
            if e["end"] < e["t"]:
                return f"{where}: a stage ends before it starts"
            continue
        if kind == "evict":  # (v4) its request need not be live
            owner = e.get("producer") or ""
            if any(cached.get((owner, p)) != set() for p in e["pages"]):
                return f"{where}: evicts a page not cached or still held"
            for p in e["pages"]:
                del cached[(owner, p)]
            continue
        life = live.get(req)
        if kind == "reserve":
            if life is not None:
                return f"{where}: reserved while live"
            pages = e["pages"]
            if len(set(pages)) != len(pages) or any(not 0 <= p < pool for p in pages):
                return f"{where}: pages repeated or outside the pool"
            if any(p in held or ("", p) in cached for p in pages):
                return f"{where}: a page another live slab or the cache holds"
            hit = e.get("hit") or []
            if any(("", p) not in cached for p in hit):
                return f"{where}: a hit on a page the cache does not hold"
            for p in hit:
                cached[("", p)].add(req)
            if e["prefix"] % header["geometry"]["page_tokens"] or e["prefix"] > e["prompt"]:
                return f"{where}: prefix not whole pages of the prompt"
            lives += 1
            live[req] = {"id": lives, "pages": pages, "produced": False, "admitted": False,
                         "failed": False, "producer": e.get("producer", "p0")}
            held.update((p, req) for p in pages)
            continue
        if kind == "fence":
            span = spans.get(e["span"])
            if not fences or span is None or span[0] != req or span[2] != "ended":
                return f"{where}: fences no failed or cancelled span"
            span[2] = "fenced"
            continue
        if life is None:
            return f"{where}: the request is not live"
        if kind == "cache" or (kind == "computed" and e.get("hit")):
            owner = e.get("producer") or ("" if kind == "cache" else life["producer"])
            pages = e["pages"] if kind == "cache" else e["hit"]
            if kind == "cache" and not owner and any(p not in life["pages"] for p in pages):
                return f"{where}: caches a page not of its slab"
            if kind == "computed" and any((owner, p) not in cached for p in pages):
                return f"{where}: a hit on a page the cache does not hold"
            for p in pages:
                cached.setdefault((owner, p), set()).add(req)
                if not owner:  # a slab page in the cache: no longer the slab's alone
                    held.pop(p, None)
        elif kind == "issue":
            if e["span"] in spans:
                return f"{where}: span id used before"
            spans[e["span"]] = [req, life["id"], "pending"]
        elif kind in ("land", "fail"):
            span = spans.get(e["span"])
            if span is None or span[:2] != [req, life["id"]] or span[2] != "pending":
                return f"{where}: no such span in flight"
            span[2] = "landed" if kind == "land" else ("ended" if fences else "fenced")
            life["failed"] |= kind == "fail"
        elif kind == "produced":
            life["produced"] = True
        elif kind == "admit":
            pending = [s for s, v in spans.items() if v[:2] == [req, life["id"]]
                       and v[2] == "pending"]
            if not life["produced"] or life["failed"] or life["admitted"] or pending:
                return f"{where}: admitted before its token, after a fail or with spans out"
            life["admitted"] = True
        elif kind in ("release", "abort"):
            if kind == "release" and not life["admitted"]:
                return f"{where}: released before the admit"
            for v in spans.values():
                if v[:2] == [req, life["id"]] and v[2] == "pending":
                    v[2] = "ended" if fences else "fenced"  # cancelled with the life
            for p in life["pages"]:
                held.pop(p, None)
            for holders in cached.values():
                holders.discard(req)
            del live[req]
    if live:
        return f"end: still live: {sorted(live)}"
    if any(v[2] == "ended" for v in spans.values()):
        return "end: a failed or cancelled span never fenced"
    return None
