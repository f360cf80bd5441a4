"""autopar's benchmarks: run each from the repository root as a module, `python -m bench.<name>` (bench/README.md)."""
