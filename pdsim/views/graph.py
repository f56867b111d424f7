"""The dependency graph of a one-request run, rebuilt from its events, and its critical path.

Nodes are pieces of work with a start and an end: compute steps (producer stream), span
copies (the copy worker: fixed cost, gather, link) and the final admit. Edges:
`stream` (the next piece on the same stream), `data` (a span copies what a step computed),
`slot` (the producer waited for a land to free a pending slot) and `ready` (admit waits for
the last land and for produced). The critical path walks back from admit along the edge that
made each node start when it did.
"""

from __future__ import annotations

import networkx as nx

ADMIT = ("admit", 0)


class _Builder:
    def __init__(self) -> None:
        self.g = nx.DiGraph()
        self.last_compute = None
        self.last_copy = None
        self.last_land = None
        self.issue_t: dict = {}
        self.computes = 0

    def node(self, key, kind, start, end, **attrs) -> None:
        self.g.add_node(key, kind=kind, start=start, end=end, **attrs)

    def edge(self, a, b, kind) -> None:
        if a is not None and a in self.g:
            slack = self.g.nodes[b]["start"] - self.g.nodes[a]["end"]
            self.g.add_edge(a, b, kind=kind, slack=max(slack, 0.0))

    def on_stage(self, e) -> None:
        if e.name != "compute":
            return
        key = ("compute", self.computes)
        self.computes += 1
        self.node(key, "compute", e.t, e.end)
        self.edge(self.last_compute, key, "stream")
        if self.last_compute and e.t > self.g.nodes[self.last_compute]["end"] + 1e-15:
            self.edge(self.last_land, key, "slot")
        self.last_compute = key

    def on_issue(self, e) -> None:
        self.issue_t[e.span] = (e.t, self.last_compute, e.bytes)

    def on_land(self, e) -> None:
        t_issue, source, nbytes = self.issue_t.pop(e.span)
        prev_end = self.g.nodes[self.last_copy]["end"] if self.last_copy else 0.0
        key = ("copy", e.span)
        self.node(key, "copy", max(t_issue, prev_end), e.t, bytes=nbytes, issued=t_issue)
        self.edge(self.last_copy, key, "stream")
        self.edge(source, key, "data")
        if source and t_issue > self.g.nodes[source]["end"] + 1e-15:
            self.edge(self.last_land, key, "slot")
        self.last_copy = self.last_land = key

    def on_admit(self, e) -> None:
        self.node(ADMIT, "admit", e.t, e.t)
        self.edge(self.last_copy, ADMIT, "ready")
        self.edge(self.last_compute, ADMIT, "ready")


def build_graph(events) -> nx.DiGraph:
    """The run's dependency graph (one request; later lives are ignored)."""
    builder = _Builder()
    for e in events:
        handler = getattr(builder, f"on_{e.kind}", None)
        if handler is not None:
            handler(e)
        if e.kind == "admit":
            break
    return builder.g


def critical_path(g: nx.DiGraph) -> list:
    """Nodes from the first to admit, each reached by its binding (least-slack) edge."""
    if ADMIT not in g:
        return []
    path = [ADMIT]
    while True:
        preds = list(g.predecessors(path[-1]))
        if not preds:
            return path[::-1]
        path.append(min(preds, key=lambda p: (g.edges[p, path[-1]]["slack"],
                                              -g.nodes[p]["end"])))
