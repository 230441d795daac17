"""Tolerances of Muon comparisons, from the arithmetic of its bf16 Newton–Schulz."""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..muon.plan import adjusted_lr

NS_TOL = 2e-2  # one bf16 NS5, ours against torch's: each a bf16 rounding of it (tests/test_muon_gpu.py)


def muon_tol(shapes: Iterable[tuple[int, ...]], lr: float, steps: int, init_std: float,
             adjust_lr_fn: str | None = None) -> float:  # fmt: skip
    """Normwise bound on the params of our Muon against torch.optim.Muon's after ``steps`` steps
    from N(0, init_std) params of ``shapes`` (viewed (shape[0], rest)), where our NS is another bf16
    rounding of torch's: on the GPU the kernels fold a·I into the poly product; under the
    interpreter the momentum kernel writes NS's bf16 input and its bf16 norm, whose rounding may
    flip against torch's (one bf16 ulp of the norm scales X by 2^-8). Each NS lands within NS_TOL
    of torch's, and each step moves a rows x cols param by its adjusted lr times O, which is about
    orthogonal (Frobenius norm sqrt(min(rows, cols))): the params may differ by NS_TOL times the
    most any of them can have moved, relative to its norm."""
    moved = 0.0
    for shape in shapes:
        rows, cols = shape[0], math.prod(shape[1:])
        step = adjusted_lr(lr, adjust_lr_fn, rows, cols) * math.sqrt(min(rows, cols))
        moved = max(moved, steps * step / (init_std * math.sqrt(rows * cols)))
    return NS_TOL * moved
