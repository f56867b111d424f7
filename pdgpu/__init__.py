"""pdgpu: the real PyTorch engine, checked live against pdref.

Modules (one concept each):
  model         Qwen3 / Llama decoder with chunked prefill over a paged KV store
  checkpoint    local Hugging Face checkpoints (config.json + *.safetensors), validated first
  source_cache  the producer's paged KV cache and the gather of a span out of it
  decoder_pool  the decoder's paged pool; slabs come from pdref's allocator
  copier        the one copy worker per producer (the only module that knows streams,
                events and pinned memory; CPU threads with the same structure)
  workload      engine settings, requests, and every check made before allocating
  recorder      the live pdref Monitor, the run clock, stage events, metrics
  engine        schedule -> run -> finish, per request, in whole / chunk / layer mode
  compare       the modes side by side: KV parity with whole, ratios
  cli           `pdgpu run` and `pdgpu compare` (and registers serve_cli's commands)
  decode_kv     a request's K/V for decoding and the batch the model's decode_step takes
  generate      `pdgpu generate`: single-process greedy reference, no handoff
  serve/        `pdgpu serve`: decoder and producer processes over torch.distributed
  serve_cli     `pdgpu serve` and `pdgpu generate` on the command line
"""
