"""TurboAdam on FSDP2's sharded matrices (rows split on one mesh dim, ``row_shard_group``).

A rank steps its rows: through the fused kernels where they take them (plan.py, ``split_rows``),
else the reference step on local tensors. Every state keeps a global shape that does not depend on
the world size (DISTRIBUTED.md, rule 4), so DCP reshards it: codes and per-block scales and bases
are ``[R, ...]`` DTensors split like the rows, the factored codec's row means ``[R]`` too, its
column means ``[C]`` replicated: each rank adds g² over its rows into a ``ShardSums`` slot (the
kernels' stats launch, or ``add_column_sums``), one all-reduce per shard group for all parameters
sums them, and every rank advances the same column means. Random bits follow the global element
index, so a step gives the same codes at any world size. Vectors (split inside their one row, across
blocks) and other layouts (tensor parallelism) keep exact moments and take AdamW's stepper.
"""

from __future__ import annotations

import math

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


def add_column_sums(slot: Tensor, grad: Tensor) -> None:
    """This rank's Σ g² per column of a sharded matrix's local rows (``grad``, unscaled) into ``slot``."""
    g = grad.float().reshape(grad.shape[0], math.prod(grad.shape[1:]))
    slot.copy_(g.square().sum(0))
