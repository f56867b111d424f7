"""pdsim: discrete-event simulator of chunked prefill and KV handoff, driven by pdref."""
