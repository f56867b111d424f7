"""pdgpu: the real PyTorch engine, checked live against pdref.

Modules (one concept each):
  model         Qwen3 / Llama decoder with chunked prefill over a paged KV store
  layers/       its layers: dense_blocks (Qwen3 / Llama), hybrid_blocks, gated_deltanet,
                rope, norms, kv_ports
  attention     prefill attention over a request's contiguous K/V (no mask tensor, no
                repeated K/V), decode attention over rows of one width
  checkpoint    local Hugging Face checkpoints (config.json + *.safetensors), validated first
  source_cache  the producer's paged KV cache (and the contiguous workspace attention reads),
                and the gather of a span out of it
  decoder_pool  the decoder's paged pool; slabs come from pdref's allocator
  prefix_index  block-hash prefix index (chained page keys, holders, LRU, budget; no torch)
  source_prefix  a producer's prefix cache over its source pool (serve's and generate's)
  copier        the copy path of one producer: a span's gather, d2h and h2d each on its own
                lane, a watcher that lands spans as they complete (with streams.py and
                copy_bandwidth.py, the only modules that know streams, events and pinned
                memory)
  copy_job      what goes through the copier and comes back: jobs, stage times, results
  copy_bandwidth  the raw copy bandwidth of a device, each direction, as the copier stages
  streams       lanes (a CUDA stream, or a CPU thread), readiness marks, staging rings
  workload      engine settings, requests, and every check made before allocating
  recorder      the live checks (pdref's FastMonitor in line), the run clock, stage events,
                live-check cost, metrics
  audit         the full pdref Monitor behind the mirror, on its own thread: lag, first error
  live_check    the checked-ledger core: pdref's fast mirror in line, the audit behind it,
                held by the recorder and by serve/ledger.py
  engine_ledger every resource operation of a run, each one call with the event it emits
  faults        fault injection: a failing span, the protocol-breaking debug switches
  payload       export only: the known payload written and checked byte-exact
  host          glibc told to keep freed memory (a serving process keeps its heap)
  engine        serve requests one at a time: the run, and one life of a request
  engine_warmup the warm-up before t = 0 (a throwaway chunk and copies, caches zeroed)
  step_loop     one step loop over pdref.plan.plan_steps per life (whole / chunk / layer)
  compare       the modes side by side: KV parity with whole, ratios
  cli           `pdgpu run` and `pdgpu compare` (and registers serve_cli's commands)
  cli_types     argument types shared by the command lines (integer >= n, finite > 0)
  interrupt     Ctrl-C and SIGTERM: one line, exit 130 / 143, children stopped, no C++ abort
  decode_kv     decode memory: the running requests' K/V in power-of-two-wide rows
  decode_batch  the decode step over them: padded, fed from persistent buffers, capturable
  generate      `pdgpu generate`: single-process greedy reference, no handoff
  serve/        `pdgpu serve`: decoder and producer processes over torch.distributed
  serve_cli     `pdgpu serve` and `pdgpu generate` on the command line
"""
