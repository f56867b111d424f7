"""pdref: the executable specification of the KV handoff protocol (no torch, no I/O in the core)."""

from pdref.accel import compiled_path

# the hot modules' compiled builds, first, while they match their sources (accel.py)
__path__ = compiled_path(__name__, __path__)
