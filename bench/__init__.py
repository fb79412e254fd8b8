"""Benchmarks (run on the GPU machine with the repository on PYTHONPATH)."""
