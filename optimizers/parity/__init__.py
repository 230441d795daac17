"""Parity tools: ``parity_check`` and ``compare_tensors`` (check.py), and the parity matrix run by
``nox -s parity`` (``python -m kernel_factory.optimizers.parity.matrix``)."""

from .check import ParityReport, ParityRow, compare_tensors, parity_check, relative_error

__all__ = ["ParityReport", "ParityRow", "compare_tensors", "parity_check", "relative_error"]
