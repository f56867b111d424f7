"""The serve decoder's ledger path alone: N lives of 4 spans each through the Ledger
(reserve, computed, issue, land with digests, produced, reuse, admit, release), no model, no
processes: the live check, the trace and the KV landing's CPU cost per life. One JSON line.

    python bench/ledger_path.py 300
    python bench/tree_ab.py /tmp/old /tmp/new --rounds 10 --keys cpu_per_life_us,per_life_us \\
        -- "$PWD/bench/ledger_path.py" 300  # the same script for both trees
"""

import json
import sys
import time

import torch

from pdgpu.serve.digest import row_digests
from pdgpu.serve.ledger import Ledger
from pdref import events as ev
from pdref.geometry import Geometry

GEO = Geometry(layers=2, kv_heads=2, head_dim=4, dtype_bytes=4, page_tokens=4)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 400
header = ev.Header("bench", "chunk", GEO, 16, 2)
ledger = Ledger(header, "cpu", torch.float32)
kv = torch.randn(2, 2, 4, 2, 4)
dig = row_digests(kv)
start = time.perf_counter()
cpu0 = time.process_time()
for i in range(N):
    req = f"r{i}"
    ledger.reserve(req, 16, 0, "p1")
    for a in range(0, 16, 4):
        tokens = (a, a + 4)
        ledger.computed(req, (0, 2), tokens)
        span = ledger.issue(req, (0, 2), tokens, GEO.region_bytes((0, 2), tokens))
        assert ledger.land(req, span, kv, dig) is None
    ledger.produced(req, 3)
    ledger.reuse(req, (0, 16))
    ledger.admit(req)
    ledger.release(req)
    ledger.write_trace()
wall = time.perf_counter() - start
cpu = time.process_time() - cpu0
ledger.close()
m = ledger.check_metrics(wall)
print(json.dumps({"wall_s": wall, "check_s": m["check_s"], "checks": m["checks"],
                  "per_life_us": 1e6 * wall / N, "cpu_per_life_us": 1e6 * cpu / N}))
