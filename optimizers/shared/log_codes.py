"""Low-bit codes shared by the compressed optimizers: a counter hash for random bits, stochastic
rounding, row blocks, bit packing, and ln-domain codes whose grid moves by whole steps only.

A tensor is viewed as rows x cols; blocks are ``block`` consecutive elements of a row (the last
may be shorter), so per-block values are (R, ceil(C / block)) arrays, as FSDP2 shards rows.

Per-element ln codes (``encode_log`` / ``decode_log``): k-bit codes of ln v on a grid of ``delta``
with an int16 exponent base per block, code 0 for exact zero. The base moves only by whole grid
steps (up when the largest code would overflow, down when it sits two steps below the top), so
moving a block's range never moves a stored value; the fresh value is rounded stochastically
(unbiased in ln v) against that fixed grid. Random bits are a counter hash of (seed, step,
element index): no stored buffer, the same bits for the same step from the same state, and for
an element whatever rank holds it (global indices).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_MASK = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (lowbias32: xor-shift-multiply) of int64 x, elementwise, in int64
    arithmetic that wraps like uint32 (products of two 32-bit numbers are taken mod 2^32)."""
    x = x & _MASK
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def uniform(seed: int, step: int, index: Tensor) -> Tensor:
    """fp32 uniforms in [0, 1) (24 random bits) for elements ``index`` (int64) at ``step``."""
    key = _hash32(torch.tensor((seed * 0x9E3779B1 + step * 0x85EBCA77) & _MASK, dtype=torch.int64))
    return (_hash32(index ^ key.to(index.device)) >> 8).to(torch.float32) * 2.0**-24


def stochastic_round(x: Tensor, u: Tensor) -> Tensor:
    """floor(x) + 1 with probability frac(x) (u: uniforms in [0, 1)): unbiased, E = x."""
    low = torch.floor(x)
    return low + (u < x - low).to(x.dtype)


def blocks_of(x: Tensor, block: int) -> Tensor:
    """(R, C) -> (R, nb, block), zero padded at the end of each row."""
    rows, cols = x.shape
    pad = -cols % block
    return torch.nn.functional.pad(x, (0, pad)).view(rows, (cols + pad) // block, block)


def flat_rows(b: Tensor) -> Tensor:
    """(R, nb, block) -> (R, nb * block) (``blocks_of``'s inverse, padding kept; R may be 0)."""
    return b.reshape(b.shape[0], b.shape[1] * b.shape[2])


def pack(codes: Tensor, bits: int) -> Tensor:
    """(R, C) small non-negative integers -> uint8 (R, ceil(C * bits / 8)), low bits first."""
    per = 8 // bits
    rows, cols = codes.shape
    c = torch.nn.functional.pad(codes.to(torch.int32), (0, -cols % per)).view(rows, -(-cols // per), per)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack(packed: Tensor, bits: int, cols: int) -> Tensor:
    """``pack``'s inverse: int32 (R, cols)."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return flat_rows(codes)[:, :cols]


def decode_log(codes: Tensor, base: Tensor, bits: int, delta: float, cols: int, block: int) -> Tensor:
    """v (R, cols) fp32 of ``bits``-bit ln codes: exp((base + code) delta), 0 for code 0."""
    c = blocks_of(unpack(codes, bits, cols).float(), block)
    v = torch.where(c > 0, torch.exp((base.float()[..., None] + c) * delta), torch.zeros_like(c))
    return flat_rows(v)[:, :cols]


def encode_log(v: Tensor, base: Tensor, bits: int, delta: float, block: int, u: Tensor) -> Tensor:
    """``bits``-bit ln codes (packed uint8) of fp32 v (R, C) >= 0 on a grid of ``delta``; ``base``
    (int16 (R, nb)) is moved in place by whole steps only; ``u``: uniforms (R, C) for the rounding."""
    top_code = (1 << bits) - 1
    rows, cols = v.shape
    vb, ub = blocks_of(v, block), blocks_of(u, block)
    nz = vb > 0
    x = torch.log(torch.where(nz, vb, torch.ones_like(vb))) / delta - base.float()[..., None]
    top = torch.ceil(torch.where(nz, x, torch.full_like(x, -math.inf)).amax(-1))
    # up when the top would overflow; down when it sits more than two steps under the top code
    shift = torch.where(top > top_code, top - top_code, torch.where(top < top_code - 2, top - (top_code - 2), 0.0))
    shift = torch.where(nz.any(-1), shift, torch.zeros_like(shift))
    base += shift.to(base.dtype)
    q = stochastic_round(x - shift[..., None], ub).clamp_(1, top_code)
    q = flat_rows(torch.where(nz, q, torch.zeros_like(q)))[:, :cols]
    return pack(q, bits)
