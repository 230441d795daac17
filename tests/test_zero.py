"""``DistributedAdamW`` (ZeRO-2 for unwrapped models) on Gloo ranks: bitwise the one-process
AdamW step on averaged gradients, gradient accumulation with ``no_sync``, DCP checkpoints that
move to FSDP2 (with ours or torch.optim.AdamW) and other world sizes, and what it refuses."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from fsdp_probe import Probe, shard_of, targets
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from zero_probe import (
    HYPER,
    zero_clips_like_one_process,
    zero_equal_to_one_process,
    zero_gathers_in_forward,
    zero_gathers_in_the_forward_order,
    zero_steps_the_first_gathered_bucket_between_halves,
)

from kernel_factory.optimizers import AdamW, DistributedAdamW
from kernel_factory.optimizers.adamw.distributed import _pipeline


@pytest.mark.parametrize("backend", ["triton", "torch"])  # ours under the interpreter; the reference
@pytest.mark.parametrize("world", [2, 4])
def test_distributed_adamw_is_bitwise_the_one_process_step(world, backend):
    run_ranks(world, zero_equal_to_one_process, backend)


def test_gradients_accumulated_under_no_sync_are_reduced_once_and_stepped_bitwise():
    run_ranks(2, zero_equal_to_one_process, "triton", "cpu", 3)


def test_the_single_launch_step_is_bitwise_the_one_process_step_too():
    run_ranks(2, zero_equal_to_one_process, "triton", "cpu", 1, False)


def test_distributed_adamw_clips_the_reduced_gradients_like_one_process():
    run_ranks(2, zero_clips_like_one_process)


def test_parameter_gathers_left_to_the_next_forward_give_the_same_steps():
    run_ranks(2, zero_gathers_in_forward)


def test_parameter_gathers_go_out_in_the_order_the_forward_asks_for_them():
    run_ranks(2, zero_gathers_in_the_forward_order)


def test_the_first_gathered_bucket_steps_between_the_halves_of_the_others():
    run_ranks(2, zero_steps_the_first_gathered_bucket_between_halves)


def test_the_step_pipeline_cuts_the_other_buckets_in_halves_by_elements():
    def bucket(n: int) -> SimpleNamespace:
        return SimpleNamespace(piece_numel=n)

    big, small, first = bucket(100), bucket(10), bucket(50)
    assert _pipeline([first], first) == ([], [first], [])
    assert _pipeline([big, first], first) == ([big], [first], [])  # its midpoint is in the first half
    buckets = [small, small, big, small, first]
    assert _pipeline(buckets, first) == ([small, small], [first], [big, small])
    even = [bucket(10) for _ in range(6)]
    assert _pipeline([*even, first], first) == (even[:3], [first], even[3:])


def _train(model, opt, steps, rank, world, first=0):
    for step in range(first, first + steps):
        model(targets(step, rank, world)).backward()
        opt.step()
        opt.zero_grad()


def _build(kind: str, world: int):
    """(model, optimizer): ``zero`` = unwrapped + DistributedAdamW; ``fsdp`` = FSDP2 + our AdamW;
    ``torch`` = FSDP2 + torch.optim.AdamW."""
    model = Probe()
    if kind == "zero":
        return model, DistributedAdamW(model.parameters(), **HYPER)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, (AdamW if kind == "fsdp" else torch.optim.AdamW)(model.parameters(), **HYPER)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _save(rank: int, world: int, path: str) -> None:
    os.environ["KERNEL_FACTORY_BACKEND"] = "triton"
    model, opt = _build("zero", world)
    _train(model, opt, 3, rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = _full_states(opt, model)  # collectives: every rank
    _train(model, opt, 1, rank, world, first=3)
    states = _full_states(opt, model)
    if rank == 0:
        torch.save(saved, os.path.join(path, "saved.pt"))
        torch.save(([p.detach().clone() for p in model.params], states), os.path.join(path, "next.pt"))


def _full_states(opt, model) -> list[list[torch.Tensor]]:
    return [[_full(opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")] for p in model.params]


def _load(rank: int, world: int, path: str, kind: str) -> None:
    os.environ["KERNEL_FACTORY_BACKEND"] = "triton"
    model, opt = _build(kind, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert all(float(opt.state[p]["step"]) == 3 for p in model.params)
    if kind == "torch":  # torch's arithmetic differs from ours: the loaded state itself is the check
        loaded = _full_states(opt, model)
        assert all(torch.equal(a, b) for x, y in zip(loaded, torch.load(os.path.join(path, "saved.pt")), strict=True)
                   for a, b in zip(x, y, strict=True))  # fmt: skip
        return
    _train(model, opt, 1, rank, world, first=3)
    params, states = torch.load(os.path.join(path, "next.pt"))
    for i, p in enumerate(model.params):
        assert torch.equal(_full(p.detach()), params[i]), i
        for key, expected in zip(("exp_avg", "exp_avg_sq"), states[i], strict=True):
            assert torch.equal(_full(opt.state[p][key]), expected), (i, key)


def test_a_checkpoint_of_2_ranks_resumes_at_1_and_4_and_under_fsdp2_with_ours_or_torchs_adamw(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save, path)
    for world, kind in ((1, "zero"), (4, "zero"), (4, "fsdp"), (4, "torch")):
        run_ranks(world, _load, path, kind)


def _torch_fsdp2_checkpoint_into_distributed_adamw(rank: int, world: int, path: str) -> None:
    model, opt = _build("torch", world)
    _train(model, opt, 3, rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    twin, twin_opt = _build("zero", world)
    model_sd, optim_sd = get_state_dict(twin, twin_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(twin, twin_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for p, q in zip(model.params, twin.params, strict=True):
        assert torch.equal(p.to_local(), shard_of(q.detach(), rank, world))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key].to_local(), twin_opt.state[q][key].to_local()), key


def test_an_fsdp2_torch_adamw_checkpoint_loads_into_distributed_adamw(tmp_path):
    run_ranks(2, _torch_fsdp2_checkpoint_into_distributed_adamw, str(tmp_path / "ckpt"))


def _refusals(rank: int, world: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = Probe()
    ddp = DistributedDataParallel(model)
    with pytest.raises(RuntimeError, match="under DistributedDataParallel they would be reduced twice"):
        DistributedAdamW(model.parameters())
    del ddp
    with pytest.raises(ValueError, match="parameter 0 of param group 0 is 0-d"):
        DistributedAdamW([torch.nn.Parameter(torch.zeros(()))])
    sharded, _ = _build("torch", world)
    with pytest.raises(TypeError, match="is a DTensor .* sharded models take AdamW"):
        DistributedAdamW(sharded.parameters())
    model = Probe()
    opt = DistributedAdamW(model.parameters())
    with opt.no_sync():
        with pytest.raises(RuntimeError, match="inside no_sync"):
            opt.step()
    with pytest.raises(TypeError, match=r"gather_in_forward\[1\] must be a torch.nn.Module, got Parameter"):
        DistributedAdamW(model.parameters(), gather_in_forward=[model, model.params[0]])


def test_distributed_adamw_refuses_ddp_0d_and_sharded_parameters():
    run_ranks(2, _refusals)


def test_distributed_adamw_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        DistributedAdamW([torch.nn.Parameter(torch.zeros(3))])
