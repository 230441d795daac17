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
    OPTIMIZERS,
    SHARDED_ADAFACTOR,
    SHARDED_ADAFACTOR_INT8,
    SHARDED_MUON,
    SHARDED_TURBO_ADAM,
    Probe,
    adafactor_equal_to_one_process,
    adafactor_int8_equal_to_one_process,
    adam_mini_equal_to_one_process,
    equal_to_one_process,
    fsdp_step,
    hsdp_equal_to_one_process,
    mixed_meshes_equal_to_one_process,
    muon_equal_to_one_process,
    sharded,
    sharded_adam_mini,
    targets,
    turbo_adam_equal_to_one_process,
)
from tolerances import drift_tol
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kernel_factory.optimizers import Adafactor, AdamW
from kernel_factory.optimizers.parity import compare_tensors
from kernel_factory.optimizers.shared.dtensor import local


@pytest.mark.parametrize("backend", ["triton", "torch"])  # ours under the interpreter; the reference
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_step_is_bitwise_the_one_process_step(world, backend):
    run_ranks(world, equal_to_one_process, backend, 0.0)


def test_fsdp2_step_on_torchs_fused_cpu_kernel_is_within_an_ulp_per_step():
    run_ranks(2, equal_to_one_process, "auto", drift_tol(4))


@pytest.mark.parametrize(("world", "backend", "tol"), [(2, "torch", 0.0), (4, "torch", 0.0), (2, "auto", drift_tol(4))])
def test_muon_under_fsdp2_equals_the_one_process_step(world, backend, tol):
    """Muon with an owner rank per matrix, NS on torch's matmuls: bitwise the one-process step on the
    reference path; on ``auto`` the non-matrix params take torch's fused CPU AdamW (an ulp a step)."""
    run_ranks(world, muon_equal_to_one_process, backend, tol)


# The optimizers a checkpoint is tested with, on a path whose arithmetic does not depend on an
# element's position (module docstring): AdamW's kernel under the interpreter; Muon's reference.
# AdamMini (FP8 and bf16 momentum: its dtype must survive the load, FP8's scales reshard) sums its
# blocks' g² in an order that depends on the world size: held to 1e-6 after the resumed step. FP8 and
# bf16 take PyTorch ops on CPU; fp32 momentum takes the fused kernel under the interpreter. Adafactor's
# column sums, row-statistic mean and RMS sums are added across the ranks: 1e-6 too.
CHECKPOINTED = {"AdamW": (OPTIMIZERS["AdamW"], "triton", 0.0), "Muon": (SHARDED_MUON, "torch", 0.0),
                "AdamMini-fp8": (lambda ps: sharded_adam_mini(ps, "fp8"), "auto", 1e-6),
                "AdamMini-bf16": (lambda ps: sharded_adam_mini(ps, "bf16"), "auto", 1e-6),
                "AdamMini-fp32": (lambda ps: sharded_adam_mini(ps, "fp32"), "triton", 1e-6),
                "TurboAdam": (SHARDED_TURBO_ADAM, "auto", 1e-6),
                "Adafactor": (SHARDED_ADAFACTOR, "auto", 1e-6),
                "Adafactor-int8": (SHARDED_ADAFACTOR_INT8, "auto", 1e-6)}  # fmt: skip


@pytest.mark.parametrize("backend", ["auto", "triton"])  # PyTorch ops on CPU; the fused kernel (interpreter)
@pytest.mark.parametrize("world", [2, 4])
def test_adam_mini_under_fsdp2_is_within_1e6_of_the_one_process_step(world, backend):
    """Every block kind, heads split across ranks at 4; fp32 momentum. Only the order of the block
    sums of g² differs from one process (a partial sum per rank, then the all-reduce)."""
    run_ranks(world, adam_mini_equal_to_one_process, backend, 1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_turbo_adam_under_fsdp2_is_within_1e6_of_the_one_process_step(world):
    """Codes, block scales and row means split like the rows, column means all-reduced; the random
    bits follow the global element. Only the column sums' order differs from one process."""
    run_ranks(world, turbo_adam_equal_to_one_process, 1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_adafactor_int8_momentum_under_fsdp2_follows_the_one_process_step(world):
    """int8 first-moment codes and their per-row block scales split like the rows: a rank codes its
    own rows' blocks, no collective; params within 1e-5 (a moved code is 1/127 of its block)."""
    run_ranks(world, adafactor_int8_equal_to_one_process, 1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_adafactor_under_fsdp2_is_within_1e6_of_the_one_process_step(world):
    """torch.optim.Adafactor fails under FSDP2; ours adds the split matrices' column sums of g², the
    mean of their row statistics and the sums of p² and u² across the ranks (two all-reduces a
    step): only those sums' order differs from one process."""
    run_ranks(world, adafactor_equal_to_one_process, 1e-6)


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


def _save(rank: int, world: int, path: str, name: str) -> None:
    build, os.environ["KERNEL_FACTORY_BACKEND"], _ = CHECKPOINTED[name]
    model, opt = sharded(world, build)
    for step in range(3):
        fsdp_step(model, opt, step, rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    fsdp_step(model, opt, 3, rank, world)
    full = [p.full_tensor() for p in model.params]
    if rank == 0:
        torch.save(full, os.path.join(path, "after_next_step.pt"))


def _load_and_step(rank: int, world: int, path: str, name: str) -> None:
    build, os.environ["KERNEL_FACTORY_BACKEND"], tol = CHECKPOINTED[name]
    model, opt = sharded(world, build)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert all(float(s["step"]) == 3 for s in opt.state.values() if "step" in s)
    if name.startswith("AdamMini"):  # FP8 on matrices; bf16 on the vectors, split inside their one row
        expected = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}[name[-4:].lstrip("-")]
        assert {s["exp_avg"].dtype for p, s in opt.state.items() if p.dim() >= 2} == {expected}
    if name in ("TurboAdam", "Adafactor-int8"):  # codes and bf16 scales kept (torch's loader casts to fp32)
        assert {(s["exp_avg_codes"].dtype, s["exp_avg_scale"].dtype) for p, s in opt.state.items()
                if p.dim() >= 2} == {(torch.uint8 if name == "TurboAdam" else torch.int8, torch.bfloat16)}  # fmt: skip
    fsdp_step(model, opt, 3, rank, world)
    full = [p.full_tensor() for p in model.params]
    expected = torch.load(os.path.join(path, "after_next_step.pt"))
    same = torch.equal if tol == 0 else (lambda a, b: compare_tensors("p", "x", a, b, tol).passed)
    assert all(same(a, b) for a, b in zip(full, expected, strict=True))


@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_a_dcp_checkpoint_of_2_ranks_resumes_identically_at_1_and_4(tmp_path, name):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save, path, name)
    for world in (1, 4):
        run_ranks(world, _load_and_step, path, name)


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
