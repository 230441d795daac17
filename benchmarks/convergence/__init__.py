"""Convergence harness: a small Llama-style character model trained on real text with each
registered optimizer (``python -m benchmarks.convergence`` or ``nox -s convergence``)."""
