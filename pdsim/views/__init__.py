"""What a run looks like: plots, timeline (Gantt, Perfetto), explain (graph, critical path),
reports and result files."""
