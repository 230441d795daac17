"""FP8 (E4M3) storage of a first moment, per sub-block scales, and the BF16 fallback.

Layout for a parameter viewed as a rows x cols matrix and sub-blocks of S elements (the
last sub-block of a row may be shorter; sub-blocks never cross rows):

- ``exp_avg``           float8_e4m3fn, the parameter's shape: m * (448 / amax), rounded to nearest;
- ``exp_avg_scale``     fp32 (rows, ceil(cols / S)): amax(|m|) / 448 of each sub-block, or,
                        when negative, -(slot + 1): the sub-block is stored in bf16 in the pool;
- ``exp_avg_pool``      bf16 (2, capacity, S): the fallback sub-blocks, written at step t into
                        half t % 2 and read at step t + 1, so no step overwrites a slot that
                        another sub-block of the same step still has to read;
- ``exp_avg_pool_used`` int32 (2,): slots handed out in each half (the counter of half t % 2
                        counts requests, so anything past ``capacity`` is an overflow). The
                        other half holds step t - 1's count until step t + 1 starts (the
                        kernel) or is cleared at once (this reference); neither reads it.

A sub-block falls back to bf16 when FP8 would lose it: more than UNDERFLOW_FRACTION of its
elements are non-zero but round to zero, or its normwise relative error exceeds
REL_ERROR_BOUND. The second test never passes: an E4M3 normal number rounds with relative
error at most 2^-4 (3 mantissa bits), the largest element is stored exactly (as 448), and the
elements below E4M3's normals (|m| < amax 2^-6 / 448) err by at most 2^-10 of a code each, so
the squared error stays under 2^-8 sum m^2 by at least 2^-8 448^2 codes^2 (the kernel therefore
runs the tests only in a tile with an element that rounds to zero). The underflow test passes
when a sub-block spans more than about 2^18 in magnitude (448 / 2^-10); momentum of one row
segment rarely does, so the pool holds FALLBACK_CAPACITY of the sub-blocks (at least one); when
it is full a sub-block stays in FP8 and counts as an overflow. A sub-block whose largest |m| is
below FLUSH_BELOW is stored as zero (scale 0), FP8 and never pooled. This module is the
reference the Triton kernel follows, in plain PyTorch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

E4M3_MAX = 448.0
UNDERFLOW_FRACTION = 1 / 16
REL_ERROR_BOUND = 2.0**-4
FALLBACK_CAPACITY = 1 / 1024
# Momentum decays by beta1 a step where the gradient stays zero (an embedding row of a token the
# data lacks: below 1e-36 after about 800 steps at beta1 = 0.9). Past amax < 448 / FLT_MAX
# (1.3e-36), 448 / amax overflows and a zero element's code became 0 * inf = NaN; from 2^-100 up
# the scale amax / 448 and every decoded value stay normal fp32, so no GPU's flush of subnormals
# to zero can differ from this reference. An update of such momentum is below lr / eps 2^-100.
FLUSH_BELOW = 2.0**-100
SUB_BLOCKS = (128, 256)


def fp8_layout(rows: int, cols: int, sub_block: int, capacity: float) -> tuple[int, int]:
    """(sub-blocks per row, pool slots per half) for a rows x cols parameter."""
    per_row = -(-cols // sub_block)
    return per_row, max(1, math.ceil(rows * per_row * capacity))


def new_fp8_state(shape: tuple[int, ...], rows: int, cols: int, device, sub_block: int,
                  capacity: float) -> dict[str, Tensor]:  # fmt: skip
    """Zero momentum in the FP8 layout (all sub-blocks FP8 with scale 0)."""
    per_row, slots = fp8_layout(rows, cols, sub_block, capacity)
    return {
        "exp_avg": torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
        "exp_avg_scale": torch.zeros((rows, per_row), dtype=torch.float32, device=device),
        "exp_avg_pool": torch.zeros((2, slots, sub_block), dtype=torch.bfloat16, device=device),
        "exp_avg_pool_used": torch.zeros(2, dtype=torch.int32, device=device),
    }


def _padded(x: Tensor, per_row: int, sub_block: int) -> Tensor:
    """(rows, cols) -> (rows, per_row, S), zero padded."""
    rows, cols = x.shape
    return torch.nn.functional.pad(x, (0, per_row * sub_block - cols)).view(rows, per_row, sub_block)


def dequantize(state: dict, rows: int, cols: int, read_half: int) -> Tensor:
    """The stored momentum as fp32 (rows, cols); bf16 sub-blocks come from pool half ``read_half``."""
    scale = state["exp_avg_scale"]
    per_row, sub_block = scale.shape[1], state["exp_avg_pool"].shape[2]
    q = _padded(state["exp_avg"].view(rows, cols).float(), per_row, sub_block)
    m = q * scale.clamp(min=0)[..., None]
    pooled = scale < 0
    if bool(pooled.any()):
        slots = (-scale[pooled] - 1).long()
        m[pooled] = state["exp_avg_pool"][read_half][slots].float()
    return m.view(rows, per_row * sub_block)[:, :cols]


def quantize_(state: dict, m: Tensor, write_half: int) -> tuple[Tensor, Tensor]:
    """Store fp32 momentum ``m`` (rows, cols); returns (bf16 sub-blocks, overflows) as 0-d
    int64 tensors. Pool half ``write_half`` is filled from slot 0; the other half's counter is
    cleared for the next step."""
    rows, cols = m.shape
    scale_t, pool = state["exp_avg_scale"], state["exp_avg_pool"]
    per_row, sub_block = scale_t.shape[1], pool.shape[2]
    x = _padded(m, per_row, sub_block)
    lengths = torch.full((per_row,), sub_block, device=m.device)
    lengths[-1] = cols - (per_row - 1) * sub_block
    amax = x.abs().amax(dim=-1)
    amax = torch.where(amax < FLUSH_BELOW, torch.zeros_like(amax), amax)
    x = torch.where((amax > 0)[..., None], x, torch.zeros_like(x))  # flushed sub-blocks: zero
    scale = amax / E4M3_MAX
    inv = torch.where(amax > 0, E4M3_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    q = (x * inv[..., None]).to(torch.float8_e4m3fn)  # the kernel's order: one division per sub-block
    back = q.float() * scale[..., None]
    underflow = ((x != 0) & (q.float() == 0)).sum(dim=-1)
    err2, ref2 = ((back - x) ** 2).sum(dim=-1), (x * x).sum(dim=-1)
    wants = (underflow > UNDERFLOW_FRACTION * lengths) | (err2 > REL_ERROR_BOUND**2 * ref2)
    order = wants.flatten().cumsum(0).view(rows, per_row) - 1  # slot of each request, row-major
    granted = wants & (order < pool.shape[1])
    scale = torch.where(granted, -(order + 1).float(), scale)
    if bool(granted.any()):
        pool[write_half][order[granted]] = x[granted].to(torch.bfloat16)
    state["exp_avg"].view(rows, cols).copy_(q.view(rows, per_row * sub_block)[:, :cols])
    scale_t.copy_(scale)
    requests = wants.sum()
    state["exp_avg_pool_used"][write_half] = requests.to(torch.int32)
    state["exp_avg_pool_used"][1 - write_half] = 0
    return granted.sum(), requests - granted.sum()
