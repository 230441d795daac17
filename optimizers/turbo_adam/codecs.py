"""TurboAdam's state codecs in plain PyTorch: the reference the kernels follow (docs/turbo_adam.md
gives the design and the measurements behind each choice).

A parameter is viewed as a rows x cols matrix (rows = shape[0], a vector is one row); blocks are
``block`` consecutive elements of one row (the last block of a row may be shorter), so per-block
values are an (R, ceil(C / block)) array, as FSDP2 shards rows.

Codes are packed in planes (``log_codes.pack_planar``: byte j of each 128-element group of a row
holds elements j, j + w, ... of it), the layout the kernels read without shuffles.

- **First moment** (``encode_m`` / ``decode_m``): m relative to the root of the second moment
  as the next step decodes it, w = m / sqrt(v_dec), in 4-bit signed codes in [-7, 7] with one bf16
  scale per block, stochastically rounded. The scale is amax |w| / 7 rounded *up* to bf16 (bf16
  has fp32's exponent range: no underflow), and the codes are computed against the rounded scale,
  so decode (q scale sqrt(v_dec)) uses the lattice encode used. Why relative to sqrt(v): a block's
  elements then share a scale in units of their own update, so an element whose gradients are
  small beside its block's largest keeps its share of the update (with m coded as is, a code step
  of amax / 7 lost them: update cosine 0.63 where a row's columns differ by 2 decades). Why
  stochastic: with nearest rounding a code stays put until 0.1 |g - m| exceeds half a code step,
  a drag that stalled one of three convergence runs (docs/turbo_adam.md, "m's codec").
- **Second moment, factored** (``FACTORED``, matrices): Adafactor's row and column means of g²
  (exact fp32 EMAs) give a base r_i c_j / mean(c); each element keeps a 2-bit code k in
  {-1.5, -0.5, 0.5, 1.5} with v = base * 2^(k / 3). The base moves with the element's own expected motion,
  so an element off its code only re-rounds by the EMA's small step: stochastic rounding then
  moves a code with probability ~(1 - beta2) / step, and the stored v does not random-walk.
- **Second moment, per element** (``LOG4`` / ``LOG8``): the log codes of ``shared/log_codes.py``
  (an int16 base per block that moves by whole grid steps, code 0 for exact zero), at 4 bits on a
  grid of half an octave and at 8 bits on a sixteenth.

Random bits for the stochastic roundings: ``shared/log_codes.uniform``, a counter hash of (seed,
step, global element index).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..shared.log_codes import (
    decode_linear,
    decode_log,
    encode_linear,
    encode_log,
    pack_planar,
    stochastic_round,
    unpack_planar,
)

M_LEVELS = 7  # codes -7..7 of the 4-bit first moment
FACTORED, LOG4, LOG8 = "factored", "log4", "log8"
# (bits per element, grid step in octaves of v) of each second-moment codec
V_CODECS = {FACTORED: (2, 1 / 3), LOG4: (4, 1 / 2), LOG8: (8, 1 / 16)}
FACTORED_LOW = -1.5  # the factored codes 0..3 stand for k = -1.5..1.5
# v / base of the factored codes 0..3, 2^(k / 3): fp32 constants, rounded once from double, that
# the kernels use too (an exp per element would round differently on the GPU)
FACTORED_RATIOS = tuple(2.0 ** ((k + FACTORED_LOW) / 3) for k in range(4))


M_STREAM = 0x6A09E667  # the random stream of m's rounding (log_codes.plane_uniforms), apart from v's
# The first moment's codec, recorded in every param group: a state dict whose groups lack it was
# saved with the earlier codec (m itself per block), whose codes ``decode_m_unscaled`` reads.
M_CODEC = "m_over_root_v"


def inverse_root(v: Tensor) -> Tensor:
    """1 / sqrt(v) of an exact second moment, 0 where v = 0 (an element that never had a gradient:
    its m is 0 too)."""
    return torch.where(v > 0, torch.rsqrt(torch.where(v > 0, v, torch.ones_like(v))), torch.zeros_like(v))


def root(v: Tensor) -> Tensor:
    """sqrt(v) as the kernels take it, v rsqrt(max(v, FLT_MIN)): 0 for 0."""
    return v * torch.rsqrt(v.clamp_min(torch.finfo(torch.float32).tiny))


def encode_m(m: Tensor, root_inv: Tensor, block: int, u: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 m (R, C) relative to sqrt(v), ``root_inv`` (R, C) 1 / sqrt of the second moment as the
    next step decodes it (``inverse_root``, ``factored_inverse_root``, ``log_inverse_root``),
    rounded stochastically with uniforms u (R, C) -> (4-bit codes, planar-packed uint8
    (R, planar_bytes(C, 4)), bf16 scales (R, ceil(C / block))): ``log_codes.encode_linear`` of
    m / sqrt(v) at 7 levels."""
    q, scale = encode_linear(m * root_inv, M_LEVELS, block, u)
    return pack_planar(q + M_LEVELS, 4, pad=M_LEVELS), scale  # padding: the code of 0, as the kernels write


def decode_m(codes: Tensor, scale: Tensor, v: Tensor, block: int) -> Tensor:
    """``encode_m``'s inverse given the decoded v (R, cols) it was coded against: fp32 (R, cols)."""
    return decode_m_unscaled(codes, scale, v.shape[1], block) * root(v)


def decode_m_unscaled(codes: Tensor, scale: Tensor, cols: int, block: int) -> Tensor:
    """fp32 m (R, cols) of the earlier codec's codes (q scale, m itself per block; before ``M_CODEC``)."""
    return decode_linear(unpack_planar(codes, 4, cols) - M_LEVELS, scale, block)


def factored_base(row: Tensor, col: Tensor, col_mean: Tensor | None = None) -> Tensor:
    """Adafactor's estimate of E[g²] from row means ``row`` (R,) and column means ``col`` (C,):
    row_i col_j / mean(col), fp32 (R, C); 0 where a row or a column never had a gradient. mean(col)
    is Adafactor's mean(row) (both are the mean of g²'s EMA), and every rank holds all columns when
    FSDP2 splits the rows: the base of a rank's rows needs no collective. ``col_mean``: mean(col)
    as a kernel summed it (the base codes were written against), else torch's."""
    return torch.outer(row_factor(row, col, col_mean), col)


def row_factor(row: Tensor, col: Tensor, col_mean: Tensor | None = None) -> Tensor:
    """row / mean(col) (R,): the row's part of ``factored_base`` (a kernel forms it once per row)."""
    mean = col.mean() if col_mean is None else col_mean
    return row / torch.where(mean > 0, mean, torch.ones_like(mean))


def decode_v_factored(codes: Tensor, row: Tensor, col: Tensor, col_mean: Tensor | None = None) -> Tensor:
    """v (R, C) fp32 of the factored codec: base * 2^(k / 3) (``FACTORED_RATIOS``)."""
    ratios = torch.tensor(FACTORED_RATIOS, dtype=torch.float32, device=codes.device)
    return factored_base(row, col, col_mean) * ratios[unpack_planar(codes, 2, col.numel()).long()]


def encode_v_factored(v: Tensor, row: Tensor, col: Tensor, u: Tensor, col_mean: Tensor | None = None) -> Tensor:
    """Codes of fp32 v (R, C) against the (updated) factored base, stochastically rounded (u)."""
    bits, step = V_CODECS[FACTORED]
    # where the base is 0 (a row or column without gradient so far) log2 base = -inf: x = +inf, the
    # top code, which decodes to 0 all the same
    ok = v > 0
    log2_base = torch.log2(row_factor(row, col, col_mean))[:, None] + torch.log2(col)[None, :]
    x = torch.where(ok, (torch.log2(torch.where(ok, v, torch.ones_like(v))) - log2_base) * (1 / step),
                    torch.zeros_like(v))  # fmt: skip
    return pack_planar(stochastic_round(x - FACTORED_LOW, u).clamp_(0, (1 << bits) - 1), bits)


def factored_inverse_root(codes: Tensor, row: Tensor, col: Tensor, col_mean: Tensor | None = None) -> Tensor:
    """1 / sqrt of the factored v that ``codes`` decode to, (R, C) fp32, taken in the log domain as
    the kernels take it: 2^(-(3 log2 base + k) / 6), 0 where the base is 0."""
    log2_base3 = torch.log2(col)[None, :] * 3.0 + (torch.log2(row_factor(row, col, col_mean)) * 3.0)[:, None]
    k = unpack_planar(codes, 2, col.numel()).float() + FACTORED_LOW
    ok = log2_base3 > -torch.inf
    return torch.where(ok, torch.exp2((log2_base3 + k) * (-1.0 / 6.0)), torch.zeros_like(log2_base3))


def log_inverse_root(codes: Tensor, base: Tensor, codec: str, cols: int, block: int) -> Tensor:
    """1 / sqrt of the per-element log codes' v, (R, cols) fp32: 2^(-(base + code) step / 2), 0 for
    code 0 (``decode_log`` on a grid of -step / 2, a power of two too: the exponent stays exact)."""
    bits, step = V_CODECS[codec]
    return decode_log(unpack_planar(codes, bits, cols), base, -step / 2, block)


def decode_v_log(codes: Tensor, base: Tensor, codec: str, cols: int, block: int) -> Tensor:
    """v (R, cols) fp32 of a per-element log codec (``log_codes.decode_log``)."""
    bits, step = V_CODECS[codec]
    return decode_log(unpack_planar(codes, bits, cols), base, step, block)


def encode_v_log(v: Tensor, base: Tensor, codec: str, block: int, u: Tensor) -> Tensor:
    """Codes of fp32 v (R, C) >= 0 in a per-element log codec (``log_codes.encode_log``), planar-packed."""
    bits, step = V_CODECS[codec]
    return pack_planar(encode_log(v, base, bits, step, block, u), bits)
