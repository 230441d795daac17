"""TurboAdam's state codecs in plain PyTorch: the reference the kernels follow (docs/turbo_adam.md
gives the design and the measurements behind each choice).

A parameter is viewed as a rows x cols matrix (rows = shape[0], a vector is one row); blocks are
``block`` consecutive elements of one row (the last block of a row may be shorter), so per-block
values are an (R, ceil(C / block)) array, as FSDP2 shards rows.

- **First moment** (``encode_m`` / ``decode_m``): 4-bit signed codes in [-7, 7], one bf16 scale per
  block, rounded to nearest. The scale is amax / 7 rounded *up* to bf16 (bf16 has fp32's exponent
  range: no underflow at |m| ~ 1e-30), and the codes are computed against the rounded scale, so
  decode uses the lattice encode used. Nearest rounding, not stochastic: m moves by a tenth of g
  each step, more than a code step, so nearest-rounding errors do not repeat (no drag), and their
  variance is half that of stochastic rounding (measured: update cosine 0.956 vs 0.927).
- **Second moment, factored** (``FACTORED``, matrices): Adafactor's row and column means of g²
  (exact fp32 EMAs) give a base r_i c_j / mean(c); each element keeps a 2-bit code k in
  {-1, 0, 1, 2} with v = base * 2^(k / 3). The base moves with the element's own expected motion,
  so an element off its code only re-rounds by the EMA's small step: stochastic rounding then
  moves a code with probability ~(1 - beta2) / step, and the stored v does not random-walk.
- **Second moment, per element** (``LOG4`` / ``LOG8``): k-bit codes of ln v on a grid of
  ``delta`` with an int16 exponent base per block, code 0 for exact zero. The base moves only by
  whole grid steps (up when the largest code would overflow, down when it sits two steps below the
  top), so moving the block's range never moves a stored value; stochastic rounding (unbiased in
  ln v) of the fresh value against that fixed grid.

Random bits come from a counter hash of (seed, step, element index) (``uniform``): no stored
buffer, the same bits for the same step from the same state, and for an element whatever rank
holds it (global indices).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

M_LEVELS = 7  # codes -7..7 of the 4-bit first moment
FACTORED, LOG4, LOG8 = "factored", "log4", "log8"
# (bits per element, grid step in ln v) of each second-moment codec
V_CODECS = {FACTORED: (2, math.log(2) / 3), LOG4: (4, math.log(2) / 2), LOG8: (8, math.log(2) / 16)}
FACTORED_LOW = -1.5  # the factored codes 0..3 stand for k = -1.5..1.5
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


def _bf16_up(x: Tensor) -> Tensor:
    """x (fp32, >= 0) rounded up to a bf16 value, as bf16."""
    y = x.to(torch.bfloat16)
    low = y.float() < x
    return torch.where(low, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def encode_m(m: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """fp32 m (R, C) -> (4-bit codes packed uint8 (R, ceil(C / 2)), bf16 scales (R, ceil(C / block)))."""
    rows, cols = m.shape
    b = blocks_of(m, block)
    scale = _bf16_up(b.abs().amax(-1) / M_LEVELS)
    s = scale.float()[..., None]
    q = torch.round(b / torch.where(s > 0, s, torch.ones_like(s))).clamp_(-M_LEVELS, M_LEVELS)
    q = flat_rows(q)[:, :cols]
    return pack(q + M_LEVELS, 4), scale


def decode_m(codes: Tensor, scale: Tensor, cols: int, block: int) -> Tensor:
    """``encode_m``'s inverse: fp32 (R, cols)."""
    q = (unpack(codes, 4, cols) - M_LEVELS).float()
    return flat_rows(blocks_of(q, block) * scale.float()[..., None])[:, :cols]


def factored_base(row: Tensor, col: Tensor) -> Tensor:
    """Adafactor's estimate of E[g²] from row means ``row`` (R,) and column means ``col`` (C,):
    row_i col_j / mean(col), fp32 (R, C); 0 where a row or a column never had a gradient. mean(col)
    is Adafactor's mean(row) (both are the mean of g²'s EMA), and every rank holds all columns when
    FSDP2 splits the rows: the base of a rank's rows needs no collective."""
    mean = col.mean()
    return torch.outer(row, col) / torch.where(mean > 0, mean, torch.ones_like(mean))


def decode_v_factored(codes: Tensor, row: Tensor, col: Tensor) -> Tensor:
    """v (R, C) fp32 of the factored codec: base * 2^(k / 3), k = code - 1."""
    _, delta = V_CODECS[FACTORED]
    k = unpack(codes, 2, col.numel()).float() + FACTORED_LOW
    return factored_base(row, col) * torch.exp(k * delta)


def encode_v_factored(v: Tensor, row: Tensor, col: Tensor, u: Tensor) -> Tensor:
    """Codes of fp32 v (R, C) against the (updated) factored base, stochastically rounded (u)."""
    bits, delta = V_CODECS[FACTORED]
    base = factored_base(row, col)
    ok = (v > 0) & (base > 0)
    x = torch.where(ok, torch.log(torch.where(ok, v / base, torch.ones_like(v))) / delta, torch.zeros_like(v))
    return pack(stochastic_round(x - FACTORED_LOW, u).clamp_(0, (1 << bits) - 1), bits)


def decode_v_log(codes: Tensor, base: Tensor, codec: str, cols: int, block: int) -> Tensor:
    """v (R, cols) fp32 of a per-element log codec: exp((base + code) delta), 0 for code 0."""
    bits, delta = V_CODECS[codec]
    c = blocks_of(unpack(codes, bits, cols).float(), block)
    v = torch.where(c > 0, torch.exp((base.float()[..., None] + c) * delta), torch.zeros_like(c))
    return flat_rows(v)[:, :cols]


def encode_v_log(v: Tensor, base: Tensor, codec: str, block: int, u: Tensor) -> Tensor:
    """Codes of fp32 v (R, C) >= 0; ``base`` (int16 (R, nb)) is moved in place by whole steps only."""
    bits, delta = V_CODECS[codec]
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
