"""The simulator proper: event loop, producers, copier, decoder, steps, costs, workload, faults,
metrics. Imports nothing from pdsim.fit, pdsim.views or the command line."""

from pdref.accel import compiled_path

# the hot modules' compiled builds, first, while they match their sources (pdref/accel.py)
__path__ = compiled_path(__name__, __path__)
