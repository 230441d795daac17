"""Tolerances from the arithmetic, for tests that compare two implementations of a step which round
differently: an FMA where the other multiplies and adds, another SIMD width's summation order
(torch's CPU kernels depend on ATEN_CPU_CAPABILITY), another libm. Where the same kernel runs on
both sides, tests assert bitwise equality instead.

Each step may leave every stored value one ulp (``eps`` of the dtype, relative) apart, and those
differences add up over the steps; a reduction of n terms summed in another order adds about
log2(n) ulps (pairwise summation's bound, Higham, Accuracy and Stability of Numerical Algorithms,
section 4.2).
"""

from __future__ import annotations

import math

import torch


def drift_tol(steps: int, dtype: torch.dtype = torch.float32, ulps_per_step: float = 1.0) -> float:
    """Relative bound (elementwise, hence normwise) after ``steps`` steps that each may round
    ``ulps_per_step`` ulps apart: steps x ulps_per_step x eps(dtype)."""
    return steps * ulps_per_step * torch.finfo(dtype).eps


def sum_ulps(n: int) -> int:
    """Ulps by which a sum of ``n`` terms may differ between two summation orders: log2(n)."""
    return math.ceil(math.log2(max(n, 2)))


def adam_update_bound(beta1: float, beta2: float) -> float:
    """The largest |m̂ / √v̂| Adam can reach (beta1² < beta2): by Cauchy–Schwarz over the EMA weights,
    |m_t| <= (1 - b1) / sqrt((1 - b2)(1 - b1²/b2)) · sqrt(v_t); 7.3 at (0.9, 0.999)."""
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1**2 / beta2))


def adam_drift_atol(steps: int, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                    dtype: torch.dtype = torch.float32) -> float:  # fmt: skip
    """Absolute bound for parameters near zero (where a relative one means nothing): each step
    moves a parameter by lr·|m̂/(√v̂+ε)| <= lr·adam_update_bound, computed one ulp apart."""
    return drift_tol(steps, dtype) * lr * adam_update_bound(*betas)
