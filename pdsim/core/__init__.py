"""The simulator proper: event loop, producers, copier, decoder, steps, costs, workload, faults,
metrics. Imports nothing from pdsim.fit, pdsim.views or the command line."""
