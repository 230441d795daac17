"""Benchmarks and the convergence harness (run from the repository root: python -m benchmarks...)."""
