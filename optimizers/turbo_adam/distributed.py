"""TurboAdam on FSDP2's sharded matrices (rows split on one mesh dim, ``row_shard_group``).

A rank steps its rows with the reference step on local tensors. Every state keeps a global shape
that does not depend on the world size (DISTRIBUTED.md, rule 4), so DCP reshards it: codes and
per-block scales and bases are ``[R, ...]`` DTensors split like the rows, the factored codec's row
means ``[R]`` too, its column means ``[C]`` replicated: each rank adds g² over its rows, one
all-reduce per shard group for all parameters sums them (``column_sq_means``), and every rank
advances the same EMA. Random bits follow the global element index, so a step gives the same codes
at any world size. Vectors (split inside their one row, across blocks) and other layouts (tensor
parallelism) keep exact moments and take AdamW's stepper.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from ..shared.dtensor import local, row_shard_group


def compressible(p: Tensor) -> bool:
    """Whether ``p`` may keep compressed moments: a plain tensor, or a DTensor matrix whose rows alone
    are split (on one mesh dim)."""
    return not isinstance(p, DTensor) or (p.dim() >= 2 and row_shard_group(p) is not None)


def shard_state(p: DTensor, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (zero tensors of ``p``'s local rows) as DTensors: column means replicated, the rest
    split like the rows, each of its global shape."""
    rows = p.shape[0]
    out = {"step": state["step"]}
    for key, t in state.items():
        if key == "step":
            continue
        if key == "exp_avg_sq_col":
            out[key] = DTensor.from_local(t, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
            continue
        shape = (rows, *t.shape[1:])
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        out[key] = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)
    return out


def local_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The state's local tensors (the objects the DTensors hold: updates in place reach them)."""
    return {key: local(t) for key, t in state.items()}


def column_sq_means(params: list[DTensor]) -> dict[int, Tensor]:
    """The mean of g² over all rows of each sharded matrix's column (C,), by ``id`` of the param:
    local sums over this rank's rows, one all-reduce per shard group for all of them."""
    pending: dict[int, list[DTensor]] = {}
    for p in params:
        pending.setdefault(id(row_shard_group(p)[0]), []).append(p)
    out = {}
    for ps in pending.values():
        sums = [local(p.grad).float().reshape(local(p).shape[0], math.prod(p.shape[1:])).square().sum(0) for p in ps]
        flat = torch.cat(sums)
        dist.all_reduce(flat, group=row_shard_group(ps[0])[0])
        for p, chunk in zip(ps, flat.split([s.numel() for s in sums]), strict=True):
            out[id(p)] = chunk / p.shape[0]
    return out
