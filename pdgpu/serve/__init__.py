"""`pdgpu serve`: a decoder process and N producer processes over torch.distributed.

Modules (one concept each):
  transport  point-to-point messages (one interface; KV lanes: gloo, shared memory, NCCL,
             and NIXL in transport_nixl, `--kv-lane nixl`)
  link       a message, that interface, one connected peer's link
  transport_shm  KV through shared memory on one machine (page-locked on one GPU)
  lane_probe KV bytes/s between two processes through a lane vs a same-size copy (benches)
  config     the run's settings, producer capabilities, the handshake's servability rule
  workload   requests drawn or read from a prompts file, arrival times
  digest     compute-time row checksums of KV, checked when a span lands (--verify)
  producer   chunked prefill into the source cache, spans bounded by max_pending
  span_sender  a producer's sender thread: slots, issue, gather, pacing, `stopped`
  producer_cache  a producer's automatic prefix cache (--prefix-cache): hit, plan, cache,
             evict, and the messages that make them trace events
  bugs       the hand-made copy bugs of --debug, one object a producer calls at fixed hooks
  ledger     the decoder's protocol authority: each resource operation and its pdref event
             are one call (decides and records; moves no bytes)
  landing    the decoder's handoff memory: slabs, the fixed prefix's pages, landing slots,
             bytes written and checked, where an admitted context lies
  decoder    schedule -> run -> postprocess, the continuous decode batch, admission
  postprocess  the decoder's part turning every producer message into its pdref event
  decoder_prefix  the decoder's automatic prefix cache over its pool (--prefix-cache):
             hits at reserve, pages cached after admission, idle pages evicted LRU
  recovery   the decoder's part for faults: failed lives, cancels, deadlines, lost producers
  launch     processes, handshake, shutdown
  command    what `pdgpu serve` and `--http` share: checks, the run, its outputs
  report     results lines and the summary
  status     stderr while serving: producer deaths, restarts, rejoins; progress off a terminal
"""
