"""Launches of the Triton Newton–Schulz kernels (kernel_templates/newton_schulz.py.j2)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from kernel_factory.generator import NEWTON_SCHULZ, detect_arch, load, select

TRITON_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def ns_config(x: Tensor) -> Mapping[str, int]:
    """The tuned config for x's variant and matrix size (the family default on CPU)."""
    arch = "cpu" if x.device.type == "cpu" else detect_arch(x.device)
    dtype = TRITON_DTYPES[x.dtype]
    # Keyed by the elements of the whole batch: how many programs a tile size gives matters as
    # much as the matrix size (one 1024^2 matrix wants small tiles, 48 of 768^2 large ones).
    return select(NEWTON_SCHULZ, arch, NEWTON_SCHULZ.variant(dtype=dtype), dtype, x.numel())


def triton_newton_schulz(x: Tensor, schedule: list[tuple[float, float, float]],
                         config: Mapping[str, int] | None = None) -> Tensor:  # fmt: skip
    """The iterations of ``schedule`` on x (B, m, n), m <= n, already normalized; x may be any
    strided view (a transposed tall matrix) and is not written. bf16 or fp32 (the interpreter's).
    Returns a new contiguous (B, m, n) tensor of x's dtype."""
    if x.dtype not in TRITON_DTYPES or x.dim() != 3 or x.shape[1] > x.shape[2]:
        raise ValueError(f"triton_newton_schulz takes (B, m, n), m <= n, bf16 or fp32; got {tuple(x.shape)} {x.dtype}")
    config = dict(config or ns_config(x))
    kernels = load(NEWTON_SCHULZ, NEWTON_SCHULZ.variant(dtype=TRITON_DTYPES[x.dtype]))
    batch, m, n = x.shape
    gram = torch.empty(batch, m, m, dtype=x.dtype, device=x.device)
    poly = torch.empty_like(gram)
    outs = [torch.empty(batch, m, n, dtype=x.dtype, device=x.device) for _ in range(min(2, len(schedule)))]
    block, block_n, block_k = config["BLOCK"], config["BLOCK_N"], config["BLOCK_K"]
    launch = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    tiles = -(-m // block)
    sym_grid = (tiles * (tiles + 1) // 2, batch)
    update_grid = (tiles * -(-n // block_n), batch)
    for step, (a, b, c) in enumerate(schedule):
        out = outs[step % 2]
        kernels.sym_kernel[sym_grid](x, gram, gram, m, n, *x.stride(), *gram.stride(), *gram.stride(), 1.0, 0.0,
                                     HAS_C=False, BLOCK=block, BLOCK_K=block_k, **launch)  # fmt: skip
        kernels.sym_kernel[sym_grid](gram, gram, poly, m, m, *gram.stride(), *gram.stride(), *poly.stride(), c, b,
                                     HAS_C=True, BLOCK=block, BLOCK_K=block_k, **launch)  # fmt: skip
        kernels.update_kernel[update_grid](poly, x, out, m, n, *poly.stride(), *x.stride(), *out.stride(), a,
                                           BLOCK=block, BLOCK_N=block_n, BLOCK_K=block_k,
                                           GROUP_M=config["GROUP_M"], **launch)  # fmt: skip
        x = out
    return x if schedule else x.contiguous()
