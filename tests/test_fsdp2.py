"""AdamW and Adam under FSDP2 (``fully_shard``) on Gloo ranks, and DCP checkpoints across world
sizes (CPU tier; ``tests/distributed.py`` spawns the ranks).

The probe (``tests/fsdp_probe.py``) makes the averaged gradient bitwise the same at 1, 2 and 4
ranks. An elementwise step whose arithmetic does not depend on an element's position then gives
the same bits however the elements are sharded: our kernels (here under the interpreter) and the
PyTorch reference do. torch's fused CPU kernel (the ``auto`` path on CPU) does not: its vectorized body
and its scalar tail round differently, so a shard boundary moves an element from one to the other;
it is held to an ulp per step.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from fsdp_probe import (
    CHECKPOINTED,
    OPTIMIZERS,
    SHAPES,
    Probe,
    adafactor_equal_to_one_process,
    adafactor_int8_equal_to_one_process,
    adam_mini_equal_to_one_process,
    equal_to_one_process,
    fsdp_step,
    hsdp_equal_to_one_process,
    load_checkpoint_and_step,
    mixed_meshes_equal_to_one_process,
    muon_all_to_alls_skip_this_rank,
    muon_equal_to_one_process,
    muon_kernels_equal_to_one_process,
    peer_copies_switch_checks,
    save_checkpoint,
    sharded,
    targets,
    turbo_adam_equal_to_one_process,
)
from tolerances import drift_tol
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kernel_factory.optimizers import Adafactor, AdamW
from kernel_factory.optimizers.parity.bounds import muon_tol
from kernel_factory.optimizers.shared.dtensor import local


@pytest.mark.parametrize("backend", ["triton", "torch"])  # ours under the interpreter; the reference
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_step_is_bitwise_the_one_process_step(world, backend):
    run_ranks(world, equal_to_one_process, backend, 0.0)


def test_fsdp2_step_on_torchs_fused_cpu_kernel_is_within_an_ulp_per_step():
    run_ranks(2, equal_to_one_process, "auto", drift_tol(4))


@pytest.mark.parametrize(("world", "backend", "tol", "options"),
                         [(2, "torch", 0.0, ()), (4, "torch", 0.0, ()), (2, "auto", drift_tol(4), ()),
                          (2, "torch", 0.0, ("pair_stages",)), (4, "torch", 0.0, ("pair_stages",)),
                          (2, "torch", 0.0, ("coalesce_on_gloo",)),
                          (4, "torch", 0.0, ("coalesce_on_gloo", "pair_stages"))])  # fmt: skip
def test_muon_under_fsdp2_equals_the_one_process_step(world, backend, tol, options):
    """Muon with an owner rank per matrix, NS on torch's matmuls: bitwise the one-process step on the
    reference path; on ``auto`` the non-matrix params take torch's fused CPU AdamW (an ulp a step).
    ``options``: NS stages cut in pairs of batches, the batches sent in the stages' order; the
    stages' all-to-alls issued together after the stage's last momentum or packing, waited through
    one object, as NCCL's coalescing manager groups them (Gloo has none: a stand-in that issues
    them one by one, ``fsdp_probe.set_muon_plan_options``)."""
    run_ranks(world, muon_equal_to_one_process, backend, tol, "cpu", options)


def test_muon_under_hsdp_with_grouped_all_to_alls_equals_the_one_process_step():
    """HSDP's shard groups (2 replicas of 2 shards) under the grouped path (Gloo stand-in)."""
    run_ranks(4, muon_equal_to_one_process, "torch", 0.0, "cpu", ("coalesce_on_gloo",), True)


@pytest.mark.parametrize(("world", "options", "hsdp"), [(2, (), False), (4, ("pair_stages",), False), (4, (), True),
                                                        (2, ("coalesce_on_gloo",), False),
                                                        (2, ("pair_stages", "light_last"), False),
                                                        (2, ("replies_scattered", "pieces_gathered"), False)],
                         )  # fmt: skip
def test_muon_exchanging_by_peer_copies_equals_the_one_process_step(world, options, hsdp):
    """The exchanges as copies into the peers' buffers and flags (``peer_copies``; the pools shared
    files, ``peer_pool_stand_in``): no all-to-all, every flag raised once per stage, way and step,
    and bitwise the one-process step, at 2 and 4 ranks, in HSDP's shard groups, with the NCCL
    batches' grouping switched on beside them, and with the pieces gathered from a receive
    buffer and O's rows scattered into a reply buffer (``direct_pieces``, ``direct_replies``
    off; on, the pieces land in the owner's rows and the wide matrices' replies leave from O)."""
    run_ranks(world, muon_equal_to_one_process, "torch", 0.0, "cpu", ("peer_copies_on_files", *options), hsdp)


def test_peer_copies_auto_asks_for_gpus_that_reach_each_other_and_nccl_and_bad_values_are_named():
    run_ranks(2, peer_copies_switch_checks)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_muon_keeps_a_ranks_own_pieces_out_of_its_all_to_alls(world):
    run_ranks(world, muon_all_to_alls_skip_this_rank)


# another bf16 rounding of NS (as tests/test_multi_gpu.py bounds it)
MUON_TOL = muon_tol([s for s in SHAPES if len(s) >= 2], lr=0.02, steps=4, init_std=1.0)


@pytest.mark.parametrize(("world", "options"), [(2, ()), (4, ()), (2, ("pair_stages",)), (2, ("owner_kernels",)),
                                               (4, ("owner_kernels",)), (2, ("owner_kernels", "peer_copies_on_files")),
                                               (4, ("peer_copies_on_files",)),
                                               (2, ("owner_kernels", "peer_copies_on_files", "pieces_gathered"))],
                         )  # fmt: skip
def test_muon_under_fsdp2_on_the_kernels_is_within_one_bf16_ns_of_the_one_process_kernels(world, options):
    """Each rank's rows through the momentum and update kernels (the interpreter), tall matrices'
    pieces written and read transposed, uneven splits and an empty rank at 4 ((5, 3): 2, 2, 1, 0 rows);
    the owner's norm (torch's vector_norm against the kernels' tile sums) and NS (torch's ops on
    the owner, the same as one process's under the interpreter) round otherwise: one bf16 NS.
    ``options``: NS stages cut in pairs of batches; the owner's pieces gathered, its norm taken and
    O scattered back by the kernels (``owner_pieces``); the exchanges as peer copies (the update
    reads the owner's own rows of wide matrices in O itself, ``direct_replies``)."""
    run_ranks(world, muon_kernels_equal_to_one_process, MUON_TOL, "cpu", options)


@pytest.mark.parametrize("backend", ["auto", "triton"])  # PyTorch ops on CPU; the fused kernel (interpreter)
@pytest.mark.parametrize("world", [2, 4])
def test_adam_mini_under_fsdp2_is_within_1e6_of_the_one_process_step(world, backend):
    """Every block kind, heads split across ranks at 4; fp32 momentum. Only the order of the block
    sums of g² differs from one process (a partial sum per rank, then the all-reduce)."""
    run_ranks(world, adam_mini_equal_to_one_process, backend, 1e-6)


# the reference on the CPU (auto); the fused kernels under the interpreter (triton: slow, 1 and 2 ranks)
@pytest.mark.parametrize(("world", "backend", "tol"), [(2, "auto", 1e-6), (4, "auto", 1e-6), (1, "triton", 0.0),
                                                       (2, "triton", 1e-6)])  # fmt: skip
def test_turbo_adam_under_fsdp2_follows_the_one_process_step(world, backend, tol):
    """Codes, block scales and row means split like the rows, column means all-reduced (the fused
    path: the stats launch's sums of this rank's rows, one all-reduce, a columns launch); the random
    bits follow the global element. Only the column sums' order differs from one process: at one
    rank nothing does, and the split-rows launches give the one-process launches' bits."""
    run_ranks(world, turbo_adam_equal_to_one_process, tol, "cpu", backend)


@pytest.mark.parametrize(("world", "backend"), [(2, "auto"), (4, "auto"), (1, "triton")])
def test_adafactor_int8_momentum_under_fsdp2_follows_the_one_process_step(world, backend):
    """int8 first-moment codes and their per-row block scales split like the rows: a rank codes its
    own rows' blocks, no collective; params within 1e-5 (a moved code is 1/127 of its block)."""
    run_ranks(world, adafactor_int8_equal_to_one_process, 1e-5, "cpu", backend)


# PyTorch ops on CPU (auto); the split launches under the interpreter (triton: slow, 1 and 2 ranks)
@pytest.mark.parametrize(("world", "backend", "tol"), [(2, "auto", 1e-6), (4, "auto", 1e-6), (1, "triton", 0.0),
                                                       (2, "triton", 1e-6)])  # fmt: skip
def test_adafactor_under_fsdp2_follows_the_one_process_step(world, backend, tol):
    """torch.optim.Adafactor fails under FSDP2; ours adds the split matrices' column sums of g², the
    sums of their row statistics and the sums of p² and u² across the ranks (two all-reduces a step,
    between the split launches' phases): only those sums' order differs from one process, so at one
    rank the split launches give the one-process launches' bits (the 3-D tensor, PyTorch ops on both
    sides with step sizes rounded otherwise, left out there)."""
    run_ranks(world, adafactor_equal_to_one_process, tol, "cpu", backend, tol == 0.0)


def _adafactor_refuses_column_splits(rank: int, world: int) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    with pytest.raises(RuntimeError, match="split otherwise than along dim 0"):
        Adafactor([p])


def test_adafactor_refuses_a_tensor_parallel_layout_with_a_clear_error():
    run_ranks(2, _adafactor_refuses_column_splits)


def test_hsdp_replicas_step_their_shards_like_one_process():
    """2 replicas x 2 shards: the shard group's reductions and exchanges leave the replicate dim out."""
    run_ranks(4, hsdp_equal_to_one_process)


@pytest.mark.parametrize(("name", "backend", "tol"), [("AdamW", "triton", 0.0), ("Muon", "torch", 0.0),
                                                      ("AdamMini", "auto", 1e-6)])  # fmt: skip
def test_one_optimizer_over_params_on_two_meshes_and_a_non_contiguous_shard(name, backend, tol):
    """FSDP and HSDP meshes in one optimizer; a transposed local shard takes AdamW's reference path
    (``kernel_path``), elementwise the kernel's arithmetic, so the result stays bitwise."""
    run_ranks(4, mixed_meshes_equal_to_one_process, name, backend, tol)


@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_a_dcp_checkpoint_of_2_ranks_resumes_identically_at_1_and_4(tmp_path, name):
    path = str(tmp_path / "ckpt")
    run_ranks(2, save_checkpoint, path, name)
    for world in (1, 4):
        run_ranks(world, load_checkpoint_and_step, path, name)


def _checkpoints_move_between_torch_adamw_and_ours(rank: int, world: int, path: str) -> None:
    os.environ["KERNEL_FACTORY_BACKEND"] = "triton"
    torch_adamw = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # noqa: E731
    for name, (first, second) in {"torch_to_ours": (torch_adamw, OPTIMIZERS["AdamW"]),
                                  "ours_to_torch": (OPTIMIZERS["AdamW"], torch_adamw)}.items():  # fmt: skip
        model, opt = sharded(world, first)
        for step in range(3):
            fsdp_step(model, opt, step, rank, world)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, name))
        twin, twin_opt = sharded(world, second)
        model_sd, optim_sd = get_state_dict(twin, twin_opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(path, name))
        set_state_dict(twin, twin_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for p, q in zip(model.params, twin.params, strict=True):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(local(twin_opt.state[q][key]), local(opt.state[p][key])), (name, key)


def test_checkpoints_move_between_torch_adamw_and_ours_under_fsdp2(tmp_path):
    run_ranks(2, _checkpoints_move_between_torch_adamw_and_ours, str(tmp_path))


@pytest.mark.parametrize(("name", "backend", "tol"), [("AdamW", "triton", 0.0), ("Muon", "torch", 0.0),
                                                      ("AdamMini", "auto", 1e-6), ("AdamMini", "triton", 1e-6)])
def test_tensor_parallel_and_2d_layouts_step_like_one_process(name, backend, tol):
    """Columns split (tensor parallelism's Shard(1), unevenly) and rows and columns split on a 2-D
    mesh, beside a plain FSDP matrix, at 4 ranks: AdamW elementwise (bitwise); Muon gathers each
    such matrix on every rank (bitwise on the reference path); AdamMini all-reduces its blocks'
    sums over every split mesh dim (1e-6; its FSDP matrix takes the fused kernel on ``triton``)."""
    run_ranks(4, mixed_meshes_equal_to_one_process, name, backend, tol, "tensor_parallel")


def _built_before_fully_shard(rank: int, world: int) -> None:
    model = Probe()
    opt = AdamW(model.parameters())
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    model(targets(0, rank, world)).backward()  # the new DTensor params get the grads
    try:
        opt.step()
    except RuntimeError as e:
        assert "was replaced by fully_shard (FSDP2); build the optimizer after" in str(e), e
    else:
        raise AssertionError("an optimizer over the replaced parameters stepped")
    # Where FSDP2 leaves no tag (torch 2.11), a step without any gradient under a process group warns.
    with pytest.warns(RuntimeWarning, match="found no parameter with a gradient; if fully_shard"):
        AdamW([torch.nn.Parameter(torch.zeros(3))]).step()


def test_an_optimizer_built_before_fully_shard_refuses_to_step():
    run_ranks(2, _built_before_fully_shard)
