"""Fitting the simulator to the engine: samples from traces, least squares, calibrate, predict,
validate, and the engine runs (subprocesses) they need."""


class EngineRunError(RuntimeError):
    """The engine subprocess failed (not a parity failure: that is reported, not raised).
    Here, not in engine_runs.py: the command line catches it without importing the runs."""
