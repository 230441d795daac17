"""The Triton Newton–Schulz kernels (fp32 variant) under TRITON_INTERPRET=1 vs torch's fp32 matmuls."""

from __future__ import annotations

import pytest
import torch

from kernel_factory.generator import NEWTON_SCHULZ, interpreter_enabled
from kernel_factory.optimizers.newton_schulz import coefficient_schedule, iterate
from kernel_factory.optimizers.newton_schulz_triton import triton_newton_schulz
from kernel_factory.optimizers.parity import compare_tensors

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tier)")
FP32_TOL = 1e-5  # fp32 (IEEE dot, no tf32): rounding and summation order only, over 3 iterations
SMALL = dict(impl="triton", BLOCK=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=2)


# (batch, m, n): one tile; several tiles with ragged edges (130: a 3 x 3 tile grid, 6 programs,
# mirrored writes); a wide batch; a tall matrix handed over as its transposed view (no copy).
@pytest.mark.parametrize("shape, tall", [((1, 40, 40), False), ((1, 130, 150), False), ((3, 40, 72), False),
                                         ((2, 72, 40), True)])  # fmt: skip
def test_fp32_kernels_match_torch(shape, tall):
    assert NEWTON_SCHULZ.is_legal(SMALL)
    x = torch.randn(shape)
    x = x.mT if tall else x
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    for coefficients in (None, "polar_express"):
        schedule = coefficient_schedule(coefficients, 3)
        out = triton_newton_schulz(x, schedule, SMALL)
        assert out.shape == x.shape and out.is_contiguous()
        assert compare_tensors("ns", "X", out, iterate(x, schedule, dict(SMALL, impl="torch")), FP32_TOL).passed


def test_rejects_tall_or_unsupported_inputs():
    with pytest.raises(ValueError, match="m <= n"):
        triton_newton_schulz(torch.randn(1, 72, 40), coefficient_schedule(None, 1), SMALL)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        triton_newton_schulz(torch.randn(1, 8, 8, dtype=torch.float64), coefficient_schedule(None, 1), SMALL)
