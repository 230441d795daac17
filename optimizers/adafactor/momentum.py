"""Adafactor's optional first moment (``beta1``) in its three storages: bf16, fp32, or 8-bit codes.

m = beta1 m + (1 - beta1) coef u, where coef u is the step's clipped, scaled update, and p moves by
m (Shazeer & Stern 2018, as Hugging Face's Adafactor applies it). It is formed in fp32 from the
stored value and stored rounded.

``int8``: signed linear codes in [-127, 127] with a bf16 scale per block of 128 values of a row
(``log_codes.encode_linear``: amax / 127 rounded up to bf16, codes against that scale, rounded to
nearest), 1.016 bytes a value. Nearest rounding rather than stochastic: m moves by (1 - beta1) coef u
a step, more than a code step (amax / 127), so the rounding errors do not repeat step after step,
and their variance is half of stochastic rounding's. A value's error is at most scale / 2, amax /
254 of its block. State: ``exp_avg_codes`` (int8, the param's shape) and ``exp_avg_scale`` (bf16,
shape[:-1] + (ceil(shape[-1] / 128),), (1,) for a scalar); a DTensor vector (FSDP2 splits a vector
inside its blocks) keeps bf16 ``exp_avg`` instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..shared import log_codes
from ..shared.dtensor import DTensor, local, split_like

MOMENTUM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8}
LEVELS = 127  # codes -127..127 of the int8 first moment
BLOCK = 128  # values of a row per bf16 scale


def coded(p: Tensor, momentum_dtype: str) -> bool:
    """Whether ``p``'s first moment is kept as int8 codes (else as ``exp_avg`` in ``stored_dtype``)."""
    return momentum_dtype == "int8" and not (isinstance(p, DTensor) and p.dim() < 2)


def stored_dtype(p: Tensor, momentum_dtype: str) -> torch.dtype:
    """The dtype of ``p``'s stored first moment: int8 where ``coded``, bf16 for a sharded vector that
    asked for int8, else the one asked for."""
    if momentum_dtype == "int8" and not coded(p, momentum_dtype):
        return torch.bfloat16
    return MOMENTUM_DTYPES[momentum_dtype]


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor's shape as (rows, values of a row): its last dim is a row, a scalar one value."""
    cols = shape[-1] if shape else 1
    return (torch.Size(shape).numel() // cols if cols else 0), cols


def new_state(p: Tensor, momentum_dtype: str) -> dict[str, Tensor]:
    """Zero first-moment state of ``p`` (DTensors split like ``p`` where ``p`` is one)."""
    dtype = stored_dtype(p, momentum_dtype)
    if dtype != torch.int8:
        return {"exp_avg": torch.zeros_like(p, dtype=dtype)}
    blocks = -(-_rows(tuple(p.shape))[1] // BLOCK)
    shape = (*p.shape[:-1], blocks) if p.dim() else (1,)
    if isinstance(p, DTensor):  # rows split (a vector is not coded): the scales split with them
        scale = split_like(p, torch.zeros((*local(p).shape[:-1], blocks), dtype=torch.bfloat16,
                                          device=local(p).device), shape)  # fmt: skip
    else:
        scale = torch.zeros(shape, dtype=torch.bfloat16, device=p.device)
    return {"exp_avg_codes": torch.zeros_like(p, dtype=torch.int8), "exp_avg_scale": scale}


def read(state: dict) -> Tensor:
    """The first moment (fp32, the param's local shape; a copy)."""
    if "exp_avg" in state:
        return local(state["exp_avg"]).float()
    codes, scale = local(state["exp_avg_codes"]), local(state["exp_avg_scale"])
    rows, cols = _rows(tuple(codes.shape))
    m = log_codes.decode_linear(codes.reshape(rows, cols), scale.reshape(rows, scale.shape[-1]), BLOCK)
    return m.view(codes.shape)


def write(state: dict, m: Tensor) -> None:
    """Store fp32 ``m`` (the param's local shape): rounded to the stored dtype, or coded."""
    if "exp_avg" in state:
        local(state["exp_avg"]).copy_(m)
        return
    codes, scale = local(state["exp_avg_codes"]), local(state["exp_avg_scale"])
    rows, cols = _rows(tuple(codes.shape))
    q, s = log_codes.encode_linear(m.reshape(rows, cols), LEVELS, BLOCK)
    codes.copy_(q.view(codes.shape))
    scale.copy_(s.view(scale.shape))


def step(state: dict, beta1: float, update: Tensor, coef: float | Tensor) -> Tensor:
    """m = beta1 m + (1 - beta1) coef update in fp32, stored; returns the fp32 m p moves by."""
    m = read(state).mul_(beta1).add_(update.float() * coef, alpha=1 - beta1)
    write(state, m)
    return m
