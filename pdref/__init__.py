"""pdref: the executable specification of the KV handoff protocol (no torch, no I/O in the core)."""
