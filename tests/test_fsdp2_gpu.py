"""GPU tier: AdamW, Adam, Muon, AdamMini, TurboAdam and Adafactor under FSDP2, and DistributedAdamW, with the
real multi-tensor kernels, two ranks on one GPU over Gloo. Gloo stages through the host: these
runs prove correctness, not speed (one NCCL rank checks that a step needs no host sync)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from fsdp_probe import (
    SHAPES,
    adafactor_equal_to_one_process,
    adafactor_int8_equal_to_one_process,
    adam_mini_equal_to_one_process,
    equal_to_one_process,
    mixed_meshes_equal_to_one_process,
    muon_equal_to_one_process,
    shard_of,
    sharded_muon_state,
    steps_without_host_sync,
    turbo_adam_equal_to_one_process,
)
from zero_probe import zero_equal_to_one_process

from kernel_factory.optimizers.parity.bounds import muon_tol

pytestmark = pytest.mark.gpu


def test_fsdp2_step_on_the_gpu_kernels_is_bitwise_the_one_process_step():
    run_ranks(2, equal_to_one_process, "auto", 0.0, "cuda")


@pytest.mark.parametrize("micro", [1, 2])
def test_distributed_adamw_on_the_gpu_kernels_is_bitwise_the_one_process_step(micro):
    run_ranks(2, zero_equal_to_one_process, "auto", "cuda", micro)


# NS stages cut in runs, or in pairs of batches; the owner's gather and norm by the kernels
@pytest.mark.parametrize("options", [(), ("pair_stages",), ("owner_kernels",)])
def test_muon_under_fsdp2_on_the_gpu_is_within_one_bf16_ns_of_the_one_process_step(options):
    """The owner runs NS on the tuned kernels from torch's momentum ops; one process runs the fused
    momentum and NS kernels: another bf16 rounding of NS (``muon_tol``)."""
    tol = muon_tol([s for s in SHAPES if len(s) >= 2], lr=0.02, steps=4, init_std=1.0)
    run_ranks(2, muon_equal_to_one_process, "auto", tol, "cuda", options)


@pytest.mark.parametrize(("world", "tol"), [(1, 0.0), (2, 1e-6)])
def test_adafactor_under_fsdp2_on_the_gpu_follows_the_one_process_kernels(world, tol):
    """The local parts through the split launches (sums all-reduced over Gloo between them) against
    one process's fused kernels: the same arithmetic per element, only the sums' order differs
    (1e-6; at one rank the same bits, the 3-D tensor on PyTorch ops left out); int8 first moment too
    (a code moved by an ulp of the sums is 1/127 of its block: 1e-3)."""
    run_ranks(world, adafactor_equal_to_one_process, tol, "cuda", "auto", tol == 0.0)
    if world > 1:
        run_ranks(world, adafactor_int8_equal_to_one_process, 1e-3, "cuda")


@pytest.mark.parametrize("name", ["Adafactor", "TurboAdam", "AdamMini"])
def test_under_fsdp2_a_step_needs_no_host_sync(name):
    run_ranks(1, steps_without_host_sync, name, backend="nccl")


@pytest.mark.parametrize(("world", "tol"), [(1, 0.0), (2, 1e-6)])
def test_turbo_adam_under_fsdp2_on_the_gpu_kernels_follows_the_one_process_kernels(world, tol):
    """The local rows through the split-rows launches (stats, one all-reduce of the column sums over
    Gloo, columns, update) against one process's fused kernels: the same approximate arithmetic per
    element, only the column sums' order differs (1e-6, as on the CPU); at one rank, the same bits."""
    run_ranks(world, turbo_adam_equal_to_one_process, tol, "cuda")


def test_adam_mini_under_fsdp2_on_the_gpu_is_within_1e6_of_the_one_process_kernels():
    """fp32 momentum: ours on the local rows against one process's fused kernels (parity's 1e-6)."""
    run_ranks(2, adam_mini_equal_to_one_process, "auto", 1e-6, "cuda", "fp32")


def test_adam_mini_fp8_under_fsdp2_on_the_gpu_is_within_parity_of_the_one_process_kernels():
    """FP8 momentum: codes and row-block scales sharded with the rows, no bf16 fallback pool
    (module docstring of adam_mini/distributed.py); parity's FP8 bounds (params 1e-4, momentum
    states 100x), as between the kernel and the reference in one process."""
    run_ranks(2, adam_mini_equal_to_one_process, "auto", 1e-4, "cuda", "fp8", 1e-2)


@pytest.mark.parametrize("options", [(), ("owner_kernels",)])
def test_sharded_muon_on_the_gpu_does_not_change_with_the_world_size(tmp_path, options):
    """1 rank (one owner NS-es a batch of 3) and 2 ranks (batches of 2 and 1 on two owners): the
    batched NS kernels' per-matrix arithmetic does not depend on the batch, nor the owner's norm
    (torch's, or the gather kernel's fixed tiles) on the split, so the bits agree."""
    path = str(tmp_path / "muon")
    run_ranks(1, sharded_muon_state, path, "cuda", options)
    run_ranks(2, sharded_muon_state, path, "cuda", options)
    (one,) = [torch.load(f"{path}.1.0")]
    for rank in range(2):
        two = torch.load(f"{path}.2.{rank}")
        for i, (full, mine) in enumerate(zip(one, two, strict=True)):
            assert torch.equal(shard_of(full, rank, 2), mine), (rank, i)


@pytest.mark.parametrize(("name", "tol"), [("AdamW", 0.0), ("Muon", None), ("AdamMini", 1e-6)])
def test_tensor_parallel_layouts_on_the_gpu_step_like_one_process(name, tol):
    """Column-split and 2-D layouts on a one-rank mesh (two ranks would gather over Gloo with CUDA
    tensors, which crashed torch 2.11): the paths that take them run on the GPU (Muon's gathered
    batches in the device's NS graph, AdamMini's PyTorch ops beside its kernel), against one process."""
    if tol is None:  # NS from other momentum ops than one process's fused kernel: a bf16 rounding of NS
        from fsdp_probe import TENSOR_PARALLEL

        tol = muon_tol([s for _, s, _ in TENSOR_PARALLEL if len(s) >= 2], lr=0.02, steps=3, init_std=1.0)
    run_ranks(1, mixed_meshes_equal_to_one_process, name, "auto", tol, "tensor_parallel", "cuda")
