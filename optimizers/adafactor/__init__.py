"""Adafactor, torch.optim.Adafactor's semantics with 8-bit factored statistics (the ``adafactor``
family). optimizer.py: the user class (PyTorch ops for now)."""

from .optimizer import Adafactor

__all__ = ["Adafactor"]
