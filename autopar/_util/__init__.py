"""Layer 0: utilities every other module may use (environment, process world, logging, files, batches)."""
