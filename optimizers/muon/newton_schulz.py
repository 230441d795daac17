"""Newton–Schulz orthogonalization (Muon's zeroth power of a matrix), batched.

The reference is torch.optim.Muon's ``_zeropower_via_newtonschulz``: cast to bf16, transpose a
tall matrix (a view), divide by the Frobenius norm clamped at ``eps``, then ``steps`` times

    A = X Xᵀ;  B = b·A + c·A·A;  X = a·X + B·X

with (a, b, c) = (3.4445, -4.7750, 2.0315) (Keller Jordan's quintic). ``fast_newton_schulz`` runs
the same arithmetic on a batch of same-shape matrices in one chain of batched matmuls, and takes
other coefficient schedules (one triple per step, e.g. Polar Express). Its CUDA kernels compute
X = (B + a·I)·X, a·I added before B is rounded to bf16 (kernel_templates/newton_schulz.py.j2).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernel_factory.generator import backend_mode, triton_available

from .newton_schulz_launch import graphed_newton_schulz, ns_config, per_product

NS5_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): the published schedule for
# 5 iterations (safety factor 2e-2, cushion 2), one (a, b, c) per step.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
SCHEDULES = {"ns5": NS5_COEFFICIENTS, "polar_express": POLAR_EXPRESS_COEFFICIENTS}
DEFAULT_EPS = 1e-7


def coefficient_schedule(coefficients, steps: int) -> list[tuple[float, float, float]]:
    """One (a, b, c) per step from ``coefficients``: None (NS5), a name in ``SCHEDULES``, one
    triple (every step) or a sequence of triples (in order; the last repeats past its end)."""
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps < 100:
        raise ValueError(f"steps must be an int in [0, 100), got {steps!r}")
    if coefficients is None:
        coefficients = NS5_COEFFICIENTS
    if isinstance(coefficients, str):
        if coefficients not in SCHEDULES:
            raise ValueError(f"coefficients must be one of {sorted(SCHEDULES)} or (a, b, c) triples, "
                             f"got {coefficients!r}")  # fmt: skip
        coefficients = SCHEDULES[coefficients]
    if not isinstance(coefficients, Sequence) or not coefficients:
        raise ValueError(f"coefficients must be (a, b, c) or a sequence of them, got {coefficients!r}")
    triples = [coefficients] if not isinstance(coefficients[0], Sequence) else list(coefficients)
    for t in triples:
        if len(t) != 3 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in t):
            raise ValueError(f"each Newton-Schulz coefficient set must be 3 floats (a, b, c), got {t!r}")
    return [tuple(float(x) for x in triples[min(i, len(triples) - 1)]) for i in range(steps)]


def _check_input(G: Tensor, eps: float) -> None:
    if not isinstance(G, Tensor):
        raise TypeError(f"G must be a Tensor, got {type(G).__name__}")
    if G.dim() not in (2, 3):
        raise ValueError(f"G must be a matrix (m, n) or a batch of them (B, m, n), got shape {tuple(G.shape)}")
    if not G.is_floating_point() or G.is_complex():
        raise TypeError(f"G must be a real floating-point tensor, got {G.dtype}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")


def reference_newton_schulz(G: Tensor, steps: int = 5, coefficients=None, eps: float = DEFAULT_EPS) -> Tensor:
    """torch.optim.Muon's NS on each matrix of ``G`` ((m, n) or (B, m, n), any float dtype), one at
    a time with torch's operations; returns bf16 of G's shape."""
    _check_input(G, eps)
    schedule = coefficient_schedule(coefficients, steps)
    if G.dim() == 3:
        return torch.stack([reference_newton_schulz(g, steps, schedule, eps) for g in G]) if len(G) else \
            G.to(torch.bfloat16)  # fmt: skip
    x = G.bfloat16()
    tall = G.size(0) > G.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for a, b, c in schedule:
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def fast_newton_schulz(G: Tensor, steps: int = 5, coefficients=None, eps: float = DEFAULT_EPS) -> Tensor:
    """Newton–Schulz orthogonalization of a matrix or a batch of same-shape matrices.

    Args:
        G: (m, n) or (B, m, n), any float dtype and device; tall matrices (m > n) are handled
            through a transposed view, so X·Xᵀ is always the smaller Gram matrix (the kernels
            read the view's strides; only a batch small enough to replay a CUDA graph, at most
            ``GRAPH_MAX_NUMEL`` elements, is copied, into the graph's input).
        steps: iterations (0 <= steps < 100).
        coefficients: None (NS5: 3.4445, -4.7750, 2.0315), ``"polar_express"``, one (a, b, c)
            triple, or a sequence of triples, one per step (the last repeats).
        eps: the norm's lower clamp (torch.optim.Muon's 1e-7).
    Returns:
        bf16 tensor of G's shape: the approximate orthogonal factor U·S'·Vᵀ of each matrix.
    """
    _check_input(G, eps)
    schedule = coefficient_schedule(coefficients, steps)
    if G.numel() == 0:
        return G.to(torch.bfloat16)
    x = G.bfloat16()
    tall = G.size(-2) > G.size(-1)
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = iterate(x / norm.clamp(min=eps), schedule)
    return x.mT if tall else x


def iterate(x: Tensor, schedule: list[tuple[float, float, float]], config=None) -> Tensor:
    """The NS iterations on a normalized bf16 x, (m, n) or (B, m, n) with m <= n (any strides).
    ``config``: a newton_schulz family config, or one per product (``per_product``); each
    ``impl`` picks the "classic" or "hopper" Triton kernels or torch's matmuls. None takes the
    tuned ones for CUDA tensors and torch's matmuls elsewhere."""
    if config is None and ns_on_triton(x):
        config = ns_config(x)
    if config is not None and any(c["impl"] != "torch" for c in per_product(config).values()):
        out = graphed_newton_schulz(x if x.dim() == 3 else x[None], schedule, config)
        return out if x.dim() == 3 else out[0]
    # 2-D takes torch's addmm (the reference's exact operations); a batch takes baddbmm.
    fma = torch.addmm if x.dim() == 2 else torch.baddbmm
    for a, b, c in schedule:
        gram = x @ x.mT
        update = fma(gram, gram, gram, beta=b, alpha=c)
        x = fma(x, update, x, beta=a)
    return x


def ns_on_triton(x: Tensor) -> bool:
    """Whether NS on ``x`` takes the Triton kernels: CUDA tensors do unless KERNEL_FACTORY_BACKEND=torch;
    CPU tensors take torch's matmuls (the interpreter's bf16 tl.dot is wrong; the fp32 variant is
    tested directly)."""
    return x.is_cuda and backend_mode() != "torch" and triton_available()
