"""`pdsim explain`: what bounds a run's completion, in words, from its dependency graph.

It walks the critical path, sums it by kind (compute, copy, waits for a free pending slot),
and measures what would help by re-running the same run with 2x bandwidth and 2x compute.
"""

from __future__ import annotations

import json

import attrs

from pdsim.core.metrics import single_metrics
from pdsim.core.play import simulate
from pdsim.options import UsageError, add_run_options, run_setup
from pdsim.views.graph import build_graph, critical_path
from pdsim.views.report import write_atomic


def add_args(p) -> None:
    add_run_options(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--graphml", default=None, help="write the dependency graph as GraphML")


def summarize(result) -> dict:
    """Critical path totals by kind and what 2x bandwidth / 2x compute would give."""
    g = build_graph(result.events)
    path = critical_path(g)
    by_kind = {"compute": 0.0, "copy": 0.0, "wait": 0.0}
    slots = 0
    for a, b in zip(path, path[1:], strict=False):
        by_kind["wait"] += g.edges[a, b]["slack"]
        slots += g.edges[a, b]["kind"] == "slot"
    for node in path:
        kind = g.nodes[node]["kind"]
        if kind in by_kind:
            by_kind[kind] += g.nodes[node]["end"] - g.nodes[node]["start"]
    handoff = single_metrics(result)["handoff_s"]
    return {
        **dict(result.cfg.labels),  # model, hw, engine, link: what was simulated
        "handoff_s": handoff, "nodes": g.number_of_nodes(), "edges": g.number_of_edges(),
        "path_nodes": len(path), "path_compute_s": by_kind["compute"],
        "path_copy_s": by_kind["copy"], "path_wait_s": by_kind["wait"], "path_slot_edges": slots,
        "handoff_2x_bandwidth_s": _what_if(result, bandwidth=2.0),
        "handoff_2x_compute_s": _what_if(result, compute=2.0),
        "last_compute_on_path": _last_compute(g, path),
        "path_spans": sum(1 for n in path if n[0] == "copy"),
        "span_fixed_s": result.cfg.costs.span_s + result.cfg.costs.link_latency_s,
    }, g


def _what_if(result, bandwidth: float = 1.0, compute: float = 1.0) -> float:
    cfg = attrs.evolve(result.cfg, costs=result.cfg.costs.scaled(bandwidth, compute),
                       stages=False)
    return single_metrics(simulate(cfg, result.requests))["handoff_s"]


def _last_compute(g, path) -> int | None:
    computes = [n[1] for n in path if n[0] == "compute"]
    return computes[-1] if computes else None


def words(s: dict) -> str:
    """The summary as sentences an engineer can act on."""
    ms = 1e3
    total = s["handoff_s"] or 1e-300
    where = (f"{s['model']} on {s['hw']} under the {s['engine']} engine: " if "engine" in s
             else "")
    lines = [f"{where}Handoff completes at {s['handoff_s'] * ms:.3f} ms. Its critical path has "
             f"{s['path_nodes']} of {s['nodes']} work items: compute {s['path_compute_s'] * ms:.3f}"
             f" ms ({100 * s['path_compute_s'] / total:.1f}%), copies {s['path_copy_s'] * ms:.3f}"
             f" ms ({100 * s['path_copy_s'] / total:.1f}%), waiting "
             f"{s['path_wait_s'] * ms:.3f} ms."]
    bound = "compute" if s["path_compute_s"] >= s["path_copy_s"] else "the copy path"
    lines.append(f"Completion is bound by {bound}.")
    fixed = s["path_spans"] * s["span_fixed_s"]
    if s["path_spans"] > 1:
        lines.append(f"{s['path_spans']} span copies on the path pay {fixed * ms:.3f} ms of "
                     "per-span fixed cost: fewer, larger spans would save it.")
    if s["path_slot_edges"]:
        lines.append(f"The producer blocked {s['path_slot_edges']} time(s) on the path waiting "
                     "for a free pending slot: a larger max_pending or more bandwidth removes it.")
    for name, key in (("bandwidth", "handoff_2x_bandwidth_s"), ("compute", "handoff_2x_compute_s")):
        gain = s["handoff_s"] - s[key]
        lines.append(f"2x {name} would give {s[key] * ms:.3f} ms "
                     f"({100 * gain / total:.1f}% faster).")
    return "\n".join(lines)


def command(args) -> int:
    cfg, requests = run_setup(args)
    if len(requests) != 1:
        raise UsageError("--requests: explain takes one request, got " f"{len(requests)}")
    summary, g = summarize(simulate(cfg, requests))
    if args.graphml:
        import io

        import networkx as nx

        buf = io.BytesIO()
        nx.write_graphml(_plain(g), buf)
        write_atomic(args.graphml, buf.getvalue())
    print(json.dumps(summary) if args.json else words(summary))
    return 0


def _plain(g):
    """A copy with string node ids (GraphML needs scalars)."""
    import networkx as nx

    return nx.relabel_nodes(g, {n: f"{n[0]}:{n[1]}" for n in g.nodes})
