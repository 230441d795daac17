"""``clip_grad_norm_`` across meshes, on 4 Gloo ranks: gradients sharded on a 1-D mesh (FSDP), on
a 2-D mesh replicated on one dim and sharded on the other (HSDP), sharded on both dims of another
(FSDP + TP), and a plain tensor, in one call (torch's raises on mixed meshes), against torch's
on the full gradients in one process."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from tolerances import sum_ulps
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from kernel_factory.optimizers import clip_grad_norm_

SHAPES = [(6, 5), (3, 4), (8, 6), (5,)]


def _grads() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _params(world: int) -> list[torch.nn.Parameter]:
    """One parameter per layout, their gradients distributed from the same full values on every rank."""
    fsdp = init_device_mesh("cpu", (world,))
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    layouts = [(fsdp, [Shard(0)]), (hsdp, [Replicate(), Shard(0)]), (hsdp, [Shard(0), Shard(1)]), None]
    params = []
    for full, layout in zip(_grads(), layouts, strict=True):
        zeros = torch.zeros_like(full)
        p = torch.nn.Parameter(zeros if layout is None else distribute_tensor(zeros, *layout))
        p.grad = full.clone() if layout is None else distribute_tensor(full.clone(), *layout)
        params.append(p)
    return params


def _clips_like_torch_in_one_process(rank: int, world: int) -> None:
    with pytest.raises(Exception, match="same mesh"):  # torch's, on the DTensors alone
        torch.nn.utils.clip_grad_norm_(_params(world)[:3], 1.0)
    for norm_type in (2.0, 1.0, float("inf")):
        params = _params(world)
        total = clip_grad_norm_(params, 1.0, norm_type)
        full = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads()]
        for p, g in zip(full, _grads(), strict=True):
            p.grad = g
        expected = torch.nn.utils.clip_grad_norm_(full, 1.0, norm_type)
        rtol = sum_ulps(sum(g.numel() for g in _grads())) * torch.finfo(torch.float32).eps  # another summation order
        torch.testing.assert_close(total, expected, rtol=rtol, atol=0)
        for p, q in zip(params, full, strict=True):
            ours = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(ours, q.grad, rtol=2 * rtol, atol=0)


def test_clip_grad_norm_across_meshes_matches_torch_in_one_process():
    run_ranks(4, _clips_like_torch_in_one_process)


def test_clip_grad_norm_of_plain_tensors_is_torchs():
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    twins = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p, q, g in zip(params, twins, _grads(), strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    total = clip_grad_norm_(params, 0.5)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(twins, 0.5), rtol=1e-6, atol=0)
    assert all(torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0) for p, q in zip(params, twins, strict=True))
    params[0].grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        clip_grad_norm_(params, 0.5, error_if_nonfinite=True)
    assert float(clip_grad_norm_([torch.nn.Parameter(torch.zeros(2))], 1.0)) == 0.0
