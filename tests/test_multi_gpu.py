"""GPU tier on several GPUs: the distributed layer over NCCL, one process per GPU (torchrun's
layout), at 2 and 4 ranks where that many GPUs are visible. The probe (``fsdp_probe.py``) makes the
averaged gradient exact at any world size, so NCCL's reduction order cannot move it: what differs
from one process is only what the optimizer itself sums across ranks. One-GPU machines run the same
probes with two Gloo ranks on one GPU (``test_fsdp2_gpu.py``); this file needs 2+ GPUs.

    python -m pytest -m gpu tests/test_multi_gpu.py       # NCCL_NVLS_ENABLE=0 on NVLink hosts
"""

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
    load_checkpoint_and_step,
    muon_equal_to_one_process,
    save_checkpoint,
    steps_without_host_sync,
    turbo_adam_equal_to_one_process,
)
from zero_probe import zero_equal_to_one_process, zero_gathers_in_forward, zero_gathers_in_the_forward_order

from kernel_factory.optimizers.parity.bounds import muon_tol

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [w for w in (2, 4) if w <= GPUS]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs 2 or more GPUs (NCCL: one rank per GPU)")]
# Muon's owner runs NS on the tuned kernels from torch's momentum ops; one process runs the fused
# momentum and NS kernels: another bf16 rounding of NS.
MUON_TOL = muon_tol([s for s in SHAPES if len(s) >= 2], lr=0.02, steps=4, init_std=1.0)


def nccl(world: int, fn, *args) -> None:
    run_ranks(world, fn, *args, backend="nccl")


@pytest.mark.parametrize("world", WORLDS)
def test_adamw_and_adam_under_fsdp2_are_bitwise_the_one_process_step(world):
    nccl(world, equal_to_one_process, "auto", 0.0, "cuda")


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("world", WORLDS)
def test_distributed_adamw_is_bitwise_the_one_process_step(world, micro):
    nccl(world, zero_equal_to_one_process, "auto", "cuda", micro)


@pytest.mark.parametrize("world", WORLDS)
def test_distributed_adamw_gathers_left_to_the_next_forward_give_the_same_steps(world):
    nccl(world, zero_gathers_in_forward, "cuda")


@pytest.mark.parametrize("world", WORLDS)
def test_distributed_adamw_gathers_go_out_in_the_order_the_forward_asks_for_them(world):
    nccl(world, zero_gathers_in_the_forward_order, "cuda")


# NS stages cut in runs or in pairs of batches; a stage's all-to-alls one by one or as one NCCL group;
# the owner's gather and norm by the kernels; the exchanges as copies into the peers' symmetric buffers
@pytest.mark.parametrize("options", [(), ("pair_stages",), ("coalesce",), ("pair_stages", "coalesce"),
                                     ("coalesce", "owner_kernels"), ("owner_kernels", "peer_copies"),
                                     ("owner_kernels", "peer_copies", "replies_scattered", "pieces_gathered"),
                                     ("coalesce", "owner_kernels", "peer_copies_auto")])  # fmt: skip
@pytest.mark.parametrize("world", WORLDS)
def test_muon_under_fsdp2_is_within_one_bf16_ns_of_the_one_process_step(world, options):
    nccl(world, muon_equal_to_one_process, "auto", MUON_TOL, "cuda", options)


@pytest.mark.skipif(GPUS < 4, reason="HSDP here: 2 replicas of 2 shards, a GPU each")
@pytest.mark.parametrize("options", [(), ("coalesce",), ("owner_kernels", "peer_copies")])
def test_muon_under_hsdp_is_within_one_bf16_ns_of_the_one_process_step(options):
    """The all-to-alls (one by one, or grouped by NCCL) run in each replica's shard group."""
    nccl(4, muon_equal_to_one_process, "auto", MUON_TOL, "cuda", options, True)


@pytest.mark.parametrize("world", WORLDS)
def test_adam_mini_under_fsdp2_follows_the_one_process_kernels(world):
    """fp32 momentum within parity's 1e-6; FP8 momentum within parity's FP8 bounds (params 1e-4,
    momentum states 1e-2), as on one GPU over Gloo."""
    nccl(world, adam_mini_equal_to_one_process, "auto", 1e-6, "cuda", "fp32")
    nccl(world, adam_mini_equal_to_one_process, "auto", 1e-4, "cuda", "fp8", 1e-2)


@pytest.mark.parametrize("world", WORLDS)
def test_turbo_adam_under_fsdp2_follows_the_one_process_kernels(world):
    """Split-rows launches with the column sums all-reduced over NCCL: only their order differs."""
    nccl(world, turbo_adam_equal_to_one_process, 1e-6, "cuda")


@pytest.mark.parametrize("world", WORLDS)
def test_adafactor_under_fsdp2_follows_the_one_process_kernels(world):
    """Split launches, their sums all-reduced over NCCL: only the sums' order differs."""
    nccl(world, adafactor_equal_to_one_process, 1e-6, "cuda")
    nccl(world, adafactor_int8_equal_to_one_process, 1e-3, "cuda")


@pytest.mark.parametrize("name", ["Adafactor", "TurboAdam", "AdamMini"])
def test_a_sharded_step_needs_no_host_sync(name):
    nccl(2, steps_without_host_sync, name)


# On the GPU every name takes its fused kernels (AdamW, AdamMini fp32 and FP8, TurboAdam) or PyTorch
# ops on CUDA (Muon's reference, Adafactor); a resumed run differs from the saving one only in what
# is summed across ranks, as on the CPU, except Muon: NS on torch's batched matmuls may round a
# matrix otherwise in batches of another size (one bf16 NS).
GPU_CHECKPOINTED = {"AdamW": 0.0, "AdamMini-fp8": 1e-6, "AdamMini-fp32": 1e-6, "TurboAdam": 1e-6, "Adafactor": 1e-6,
                    "Muon": MUON_TOL}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GPU_CHECKPOINTED))
def test_a_dcp_checkpoint_of_n_ranks_resumes_at_1_and_n(tmp_path, name):
    world = WORLDS[-1]
    path = str(tmp_path / "ckpt")
    nccl(world, save_checkpoint, path, name, "cuda")
    for resumed in (1, world):
        nccl(resumed, load_checkpoint_and_step, path, name, "cuda", GPU_CHECKPOINTED[name])
