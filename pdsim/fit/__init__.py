"""Fitting the simulator to the engine: samples from traces, least squares, calibrate, predict,
validate, and the engine runs (subprocesses) they need."""
