"""TurboAdam on FSDP2's sharded matrices (rows split on one mesh dim, ``row_shard_group``).

A rank steps its rows: through the fused kernels where they take them (plan.py, ``split_rows``),
else the reference step on local tensors. Every state keeps a global shape that does not depend on
the world size (DISTRIBUTED.md, rule 4), so DCP reshards it: codes and per-block scales and bases
are ``[R, ...]`` DTensors split like the rows, the factored codec's row means ``[R]`` too, its
column means ``[C]`` replicated: each rank adds g² over its rows (``ColumnSums``: the kernels' stats
launch or PyTorch ops), one all-reduce per shard group for all parameters sums them, and every rank
advances the same column means. Random bits follow the global element index, so a step gives the
same codes at any world size. Vectors (split inside their one row, across blocks) and other layouts
(tensor parallelism) keep exact moments and take AdamW's stepper.
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


def row_span(p: Tensor) -> tuple[int, int]:
    """(global index of the first row held here, global row count) of ``p`` as a matrix (rows =
    shape[0]; a vector is one row): a plain tensor holds rows 0..R-1; a DTensor whose rows alone are
    split holds FSDP2's ``torch.chunk`` share, ceil(R / W) rows a rank, the tail possibly short or
    empty."""
    if not isinstance(p, DTensor):
        return 0, (p.shape[0] if p.dim() >= 2 else 1)
    found = row_shard_group(p)
    if found is None or p.dim() < 2:
        raise ValueError(f"row_span: a DTensor whose rows alone are split, got placements {p.placements} "
                         f"of shape {tuple(p.shape)}")  # fmt: skip
    _, world, rank = found
    rows = p.shape[0]
    chunk = -(-rows // world)
    first = min(rank * chunk, rows)
    if local(p).shape[0] != min(first + chunk, rows) - first:
        raise RuntimeError(f"row_span: {local(p).shape[0]} local rows of {rows} on rank {rank} of {world} are not "
                           "torch.chunk's share")  # fmt: skip
    return first, rows


class ColumnSums:
    """Σ g² per column over every rank's rows, for the sharded factored matrices ``params`` (the
    same list, in the same order, on every rank): one fp32 buffer per (shard group, device), a slot
    of ``cols`` elements (16-element aligned, as the kernels load it) per matrix. A step ``zero_``s
    the buffers, each rank writes its own rows' sums into its matrices' slots (the fused stats
    launch, or ``add_local``), ``all_reduce`` adds them over each shard group, and the slots are
    read back: ``mean`` (the reference step) or in place by the columns launch."""

    def __init__(self, params: list[DTensor]) -> None:
        groups: dict[tuple, tuple] = {}
        for p in params:
            group = row_shard_group(p)[0]
            groups.setdefault((id(group), local(p).device), (group, []))[1].append(p)
        self.buffers: list[tuple[object, Tensor]] = []
        self.views: dict[int, Tensor] = {}  # id(param) -> its slot
        self.rows = {id(p): p.shape[0] for p in params}
        for (_, device), (group, ps) in groups.items():
            cols = [math.prod(p.shape[1:]) for p in ps]
            offsets = [0]
            for c in cols:
                offsets.append(offsets[-1] + -(-c // 16) * 16)
            buffer = torch.zeros(offsets[-1], dtype=torch.float32, device=device)
            self.buffers.append((group, buffer))
            for p, start, c in zip(ps, offsets, cols, strict=False):
                self.views[id(p)] = buffer[start : start + c]

    def zero_(self) -> None:
        for _, buffer in self.buffers:
            buffer.zero_()

    def add_local(self, p: DTensor, grad: Tensor) -> None:
        """This rank's Σ g² per column of ``p`` from ``grad`` (its local rows, unscaled) into its slot."""
        g = grad.float().reshape(grad.shape[0], math.prod(grad.shape[1:]))
        self.views[id(p)].copy_(g.square().sum(0))

    def all_reduce(self) -> None:
        """One all-reduce (SUM) per shard group and device over all its matrices' slots."""
        for group, buffer in self.buffers:
            dist.all_reduce(buffer, group=group)

    def mean(self, p: DTensor) -> Tensor:
        """The mean of g² over all rows of ``p``'s columns (C,), after ``all_reduce``."""
        return self.views[id(p)] / self.rows[id(p)]
