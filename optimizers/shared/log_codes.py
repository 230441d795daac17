"""Low-bit codes shared by the compressed optimizers: a counter hash for random bits, stochastic
rounding, row blocks, bit packing, ln-domain codes whose grid moves by whole steps only, and
linear codes with a bf16 scale per block (first moments).

A tensor is viewed as rows x cols; blocks are ``block`` consecutive elements of a row (the last
may be shorter), so per-block values are (R, ceil(C / block)) arrays, as FSDP2 shards rows.

Per-element log codes (``encode_log`` / ``decode_log``): k-bit codes of log2 v on a grid of ``step``
octaves with an int16 exponent base per block, code 0 for exact zero. The base moves only by whole grid
steps (up when the largest code would overflow, down when it sits two steps below the top), so
moving a block's range never moves a stored value; the fresh value is rounded stochastically
(unbiased in log v) against that fixed grid. Random bits are a counter hash of (seed, step,
element index), or (``weyl_uniform``) a hashed start per element advanced by a Weyl sequence in
the step: no stored buffer, the same bits for the same step from the same state, and for an
element whatever rank holds it (global indices).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_MASK = 0xFFFFFFFF
PLANE_GROUP = 128  # elements of a row per planar group (``pack_planar``)
PLANE_WIDTH = 32  # elements of a plane per group: a group is 4 planes, one per byte of a hash


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (lowbias32: xor-shift-multiply) of int64 x, elementwise, in int64
    arithmetic that wraps like uint32 (products of two 32-bit numbers are taken mod 2^32)."""
    x = x & _MASK
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def _key(seed: int, step: int, device: torch.device) -> Tensor:
    """The hash key of (seed, step): lowbias32(seed * 0x9E3779B1 + step * 0x85EBCA77 mod 2^32)."""
    return _hash32(torch.tensor((seed * 0x9E3779B1 + step * 0x85EBCA77) & _MASK, dtype=torch.int64)).to(device)


def uniform(seed: int, step: int, index: Tensor) -> Tensor:
    """fp32 uniforms in [0, 1) (23 random bits: a kernel makes them as the mantissa of a float in
    [1, 2), less 1, with no int-to-float conversion) for elements ``index`` (int64) at ``step``."""
    return (_hash32(index ^ _key(seed, step, index.device)) >> 9).to(torch.float32) * 2.0**-23


WEYL_STEP = 0x9E3779B9  # 2^32 / golden ratio: the Weyl sequence's increment per step


def weyl_uniform(seed: int, step: int, index: Tensor) -> Tensor:
    """fp32 uniforms in [0, 1) (23 bits) for elements ``index`` (int64) at ``step`` that follow, for
    each element, a Weyl sequence in time: a hashed start lowbias32(index ^ key(seed, 0)), plus
    step x 2^32 / golden ratio, mod 2^32. At any step they are uniform across elements; over the
    steps of one element they are equidistributed, so the roundings an element takes over N steps
    go up within about one of the expected count (an error that stays bounded), where fresh random
    bits give a count off by about sqrt(N) (a random walk, which an EMA whose weight 1 - beta_t
    shrinks with t lets grow)."""
    h = (_hash32(index ^ _key(seed, 0, index.device)) + step * WEYL_STEP) & _MASK
    return (h >> 9).to(torch.float32) * 2.0**-23


def plane_uniforms(seed: int, step: int, rows_index: Tensor, cols: int, stream: int = 0) -> Tensor:
    """fp32 uniforms (R, cols) in (0, 1) for codes kept in planes (``pack_planar``): one hash per
    position of a group's first 32-column plane, of its global index (row * cols + column), whose
    byte k serves the same position of plane k: (byte + 1/2) / 256. A kernel thread holding the
    four planes' elements of a position hashes once for four roundings (a rounding's bias is at
    most 1/512 of a code step). ``stream`` != 0: an independent set of bits for a second rounding
    of the same elements, keyed by lowbias32(key ^ stream)."""
    col = torch.arange(cols, dtype=torch.int64, device=rows_index.device)
    plane = col % PLANE_GROUP // PLANE_WIDTH
    key = _key(seed, step, rows_index.device)
    if stream:
        key = _hash32(key ^ stream)
    h = _hash32((rows_index[:, None] * cols + (col - plane * PLANE_WIDTH)) ^ key)
    return ((h >> (8 * plane)) & 255).to(torch.float32).add_(0.5).mul_(1 / 256)


def stochastic_round(x: Tensor, u: Tensor) -> Tensor:
    """floor(x + u), u uniform in [0, 1): floor(x) + 1 with probability frac(x), unbiased (E = x)."""
    return torch.floor(x + u)


def blocks_of(x: Tensor, block: int) -> Tensor:
    """(R, C) -> (R, nb, block), zero padded at the end of each row."""
    rows, cols = x.shape
    pad = -cols % block
    return torch.nn.functional.pad(x, (0, pad)).view(rows, (cols + pad) // block, block)


def flat_rows(b: Tensor) -> Tensor:
    """(R, nb, block) -> (R, nb * block) (``blocks_of``'s inverse, padding kept; R may be 0)."""
    return b.reshape(b.shape[0], b.shape[1] * b.shape[2])


def bf16_up(x: Tensor) -> Tensor:
    """x (fp32, >= 0) rounded up to a bf16 value, as bf16."""
    y = x.to(torch.bfloat16)
    low = y.float() < x
    return torch.where(low, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def encode_linear(x: Tensor, levels: int, block: int, u: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Signed linear codes of fp32 x (R, C): (q, int32 (R, C) in [-levels, levels]; bf16 scales
    (R, ceil(C / block))), x ~ q * scale, rounded to nearest (half to even), or with uniforms
    ``u`` (R, C) stochastically (``stochastic_round``, unbiased).

    The scale is amax / levels rounded *up* to bf16 and the codes are taken against that rounded
    scale: decode uses the lattice encode used, no element clips, and bf16's 8-bit exponent keeps
    scales of |x| ~ 1e-30 (fp16 scales underflow near 6e-8). Divided by a tensor: CUDA divides by
    a Python scalar as a product with its rounded reciprocal, an ulp over amax / levels where that
    is a bf16 value (a decoded block, whose amax is levels x scale), which would move its scale."""
    cols = x.shape[1]
    b = blocks_of(x, block)
    amax = b.abs().amax(-1)
    scale = bf16_up(amax / torch.full_like(amax, levels))
    s = scale.float()[..., None]
    inv = 1.0 / torch.where(s > 0, s, torch.ones_like(s))  # the kernels multiply by one reciprocal a block
    y = b * inv
    q = torch.round(y) if u is None else stochastic_round(y, blocks_of(u, block))
    return flat_rows(q.clamp_(-levels, levels))[:, :cols].to(torch.int32), scale


def decode_linear(q: Tensor, scale: Tensor, block: int) -> Tensor:
    """``encode_linear``'s inverse: fp32 (R, C) of integer codes q (R, C) and scales (R, nb)."""
    cols = q.shape[1]
    return flat_rows(blocks_of(q.float(), block) * scale.float()[..., None])[:, :cols]


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


def planar_bytes(cols: int, bits: int) -> int:
    """Bytes per row of ``pack_planar``'s output: whole 128-element groups."""
    return -(-cols // PLANE_GROUP) * PLANE_GROUP * bits // 8


def pack_planar(codes: Tensor, bits: int, pad: int = 0) -> Tensor:
    """(R, C) small non-negative integers -> uint8 (R, planar_bytes(C, bits)), in planes: each row is
    cut into groups of 128 elements, and byte j of a group (width w = 128 bits / 8) holds elements
    j, j + w, j + 2w, ... of it, lowest bits first. A kernel thread that holds a run of contiguous
    elements of each plane then finds their codes in one run of contiguous bytes, with no shuffle.
    Columns past C (to whole groups) hold ``pad``."""
    per = 8 // bits
    rows, cols = codes.shape
    c = torch.nn.functional.pad(codes.to(torch.int32), (0, -cols % PLANE_GROUP), value=pad)
    c = c.view(rows, c.shape[1] // PLANE_GROUP, per, PLANE_GROUP // per)  # (no -1: rows may be 0)
    shifts = (torch.arange(per, dtype=torch.int32, device=codes.device) * bits)[:, None]
    return (c << shifts).sum(-2).to(torch.uint8).view(rows, c.shape[1] * c.shape[3])


def unpack_planar(packed: Tensor, bits: int, cols: int) -> Tensor:
    """``pack_planar``'s inverse: int32 (R, cols)."""
    per = 8 // bits
    rows = packed.shape[0]
    width = PLANE_GROUP // per
    b = packed.to(torch.int32).view(rows, packed.shape[1] // width, 1, width)
    shifts = (torch.arange(per, dtype=torch.int32, device=packed.device) * bits)[:, None]
    return ((b >> shifts) & ((1 << bits) - 1)).reshape(rows, b.shape[1] * PLANE_GROUP)[:, :cols]


def decode_log(codes: Tensor, base: Tensor, step: float, block: int) -> Tensor:
    """v (R, C) fp32 of integer log codes (R, C): 2^((base + code) step), 0 for code 0. ``step`` is
    a power of two (octaves per code), so the exponent is exact and only exp2 rounds."""
    cols = codes.shape[1]
    c = blocks_of(codes.float(), block)
    v = torch.where(c > 0, torch.exp2((base.float()[..., None] + c) * step), torch.zeros_like(c))
    return flat_rows(v)[:, :cols]


def encode_log(v: Tensor, base: Tensor, bits: int, step: float, block: int, u: Tensor) -> Tensor:
    """``bits``-bit integer log codes (int32 (R, C)) of fp32 v (R, C) >= 0 on a grid of ``step``
    octaves (a power of two); ``base`` (int16 (R, nb)) is moved in place by whole steps only; ``u``:
    uniforms (R, C) for the rounding."""
    top_code = (1 << bits) - 1
    rows, cols = v.shape
    vb, ub = blocks_of(v, block), blocks_of(u, block)
    nz = vb > 0
    x = torch.log2(torch.where(nz, vb, torch.ones_like(vb))) * (1.0 / step) - base.float()[..., None]
    top = torch.ceil(torch.where(nz, x, torch.full_like(x, -math.inf)).amax(-1))
    # up when the top would overflow; down when it sits more than two steps under the top code
    shift = torch.where(top > top_code, top - top_code, torch.where(top < top_code - 2, top - (top_code - 2), 0.0))
    shift = torch.where(nz.any(-1), shift, torch.zeros_like(shift))
    base += shift.to(base.dtype)
    q = stochastic_round(x - shift[..., None], ub).clamp_(1, top_code)
    return flat_rows(torch.where(nz, q, torch.zeros_like(q)))[:, :cols].to(torch.int32)
