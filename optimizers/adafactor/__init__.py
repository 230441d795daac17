"""Adafactor, torch.optim.Adafactor's semantics with 8-bit factored statistics (the ``adafactor``
family). optimizer.py: the user class and its PyTorch path; plan.py: the fused launches."""

from .optimizer import Adafactor, ReferenceAdafactor

__all__ = ["Adafactor", "ReferenceAdafactor"]
