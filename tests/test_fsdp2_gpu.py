"""GPU tier: AdamW, Adam, Muon and AdamMini under FSDP2, and DistributedAdamW, with the real multi-tensor kernels,
two ranks on one GPU over Gloo. Gloo stages through the host: these runs prove correctness, not
speed."""

from __future__ import annotations

import pytest
from distributed import run_ranks
from fsdp_probe import (
    SHAPES,
    adam_mini_equal_to_one_process,
    equal_to_one_process,
    muon_equal_to_one_process,
)
from zero_probe import zero_equal_to_one_process

from kernel_factory.optimizers.parity.bounds import muon_tol

pytestmark = pytest.mark.gpu


def test_fsdp2_step_on_the_gpu_kernels_is_bitwise_the_one_process_step():
    run_ranks(2, equal_to_one_process, "auto", 0.0, "cuda")


@pytest.mark.parametrize("micro", [1, 2])
def test_distributed_adamw_on_the_gpu_kernels_is_bitwise_the_one_process_step(micro):
    run_ranks(2, zero_equal_to_one_process, "auto", "cuda", micro)


def test_muon_under_fsdp2_on_the_gpu_is_within_one_bf16_ns_of_the_one_process_step():
    """The owner runs NS on the tuned kernels from torch's momentum ops; one process runs the fused
    momentum and NS kernels: another bf16 rounding of NS (``muon_tol``)."""
    tol = muon_tol([s for s in SHAPES if len(s) >= 2], lr=0.02, steps=4, init_std=1.0)
    run_ranks(2, muon_equal_to_one_process, "auto", tol, "cuda")


def test_adam_mini_under_fsdp2_on_the_gpu_is_within_1e6_of_the_one_process_kernels():
    """fp32 momentum: ours on the local rows against one process's fused kernels (parity's 1e-6)."""
    run_ranks(2, adam_mini_equal_to_one_process, "auto", 1e-6, "cuda", "fp32")


def test_adam_mini_fp8_under_fsdp2_on_the_gpu_is_within_parity_of_the_one_process_kernels():
    """FP8 momentum: codes and row-block scales sharded with the rows, no bf16 fallback pool
    (module docstring of adam_mini/distributed.py); parity's FP8 bounds (params 1e-4, momentum
    states 100x), as between the kernel and the reference in one process."""
    run_ranks(2, adam_mini_equal_to_one_process, "auto", 1e-4, "cuda", "fp8", 1e-2)
