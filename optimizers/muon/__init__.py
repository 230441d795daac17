"""Muon with batched Newton–Schulz: two kernel families, ``muon`` (the elementwise work around NS,
kernel_templates/muon.py.j2) and ``newton_schulz`` (kernel_templates/newton_schulz.py.j2).

optimizer.py: the user class; plan.py: launch plans (one NS batch per shape); tune.py: the muon
kernels' tuner workloads; newton_schulz.py: ``fast_newton_schulz``, its reference and coefficient
schedules; newton_schulz_launch.py: the NS kernels' launches; newton_schulz_tune.py: their
tuner workloads.
"""

from .newton_schulz import fast_newton_schulz
from .optimizer import Muon

__all__ = ["Muon", "fast_newton_schulz"]
