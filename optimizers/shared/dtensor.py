"""DTensor parameters, as FSDP2 (``fully_shard``) and tensor parallelism hand them to an optimizer.

A param is an ``nn.Parameter`` holding a DTensor whose local shard is a view into the buffer the
framework all-gathers from: kernels update ``local(p)`` in place, never a copy, and read
``local(p.grad)``. Param-shaped states are DTensors with the param's mesh and placements
(``torch.zeros_like(p)`` makes one), so that DCP saves and reshards them; their local shards sit
beside the param's. Local shards are uneven and may be empty (a tail rank of a small param).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # a torch built without distributed support: no DTensor can reach us
    DTensor = ()


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (not a copy), or ``t``. Outside autograd it is the DTensor's own
    local tensor, the same object at every call: what ``to_local()`` returns there, less the view
    that torch 2.13 makes for a Parameter. A step takes it per parameter, often more than once:
    0.1 us against 1.5 (a grad) to 4 us (a Parameter) through ``to_local()`` (2.13, CPU)."""
    if not isinstance(t, DTensor):
        return t
    return t.to_local() if torch.is_grad_enabled() else t._local_tensor


def split_like(p: DTensor, local_t: Tensor, shape: tuple[int, ...]) -> DTensor:
    """``local_t`` (this rank's part) as a DTensor of global ``shape`` (contiguous) split as ``p``
    is: a per-row state of a param whose rows alone are split (its shape[0] is the param's)."""
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return DTensor.from_local(local_t, p.device_mesh, p.placements, run_check=False, shape=shape, stride=stride)


def row_shard_group(p: DTensor):
    """(process group, size, local rank) of the one mesh dim that splits ``p``'s dim 0 where that is
    ``p``'s only split (FSDP2; HSDP's shard dim, its replicate dim holding copies); None for any
    other layout (columns split, as tensor parallelism's Shard(1); dim 0 split on two mesh dims)."""
    split = [i for i, pl in enumerate(p.placements) if not pl.is_replicate()]
    if len(split) != 1 or type(p.placements[split[0]]) is not Shard or p.placements[split[0]].dim != 0:
        return None
    mesh, dim = p.device_mesh, split[0]
    return mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)


def split_groups(p: DTensor) -> tuple:
    """The process groups of the mesh dims that split ``p`` (those not replicated), in mesh order:
    a sum over ``p``'s elements is all-reduced over each of them in turn."""
    return tuple(p.device_mesh.get_group(i) for i, pl in enumerate(p.placements) if not pl.is_replicate())


def cut_locally(full: Tensor, mesh, placements) -> DTensor:
    """``full`` (the whole tensor, the same on every rank) as a DTensor with ``placements`` on
    ``mesh``, each rank keeping its part: no communication (Replicate to a split cuts locally)."""
    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, placements)


def local_part(full: Tensor, like: DTensor) -> Tensor:
    """This rank's part of ``full`` (the whole tensor, the same on every rank) as ``like`` holds it
    locally, for any placements (``cut_locally``)."""
    return cut_locally(full, like.device_mesh, like.placements).to_local()


def local_row_indices(p: DTensor) -> Tensor:
    """The global indices (int64, on ``p``'s local device) of the dim-0 entries ``p`` holds here: its
    rows, or for a 1-D ``p`` its elements. Splits of other dims leave every row partly here."""
    # Shard(0), and FSDP2 + TP's _StridedShard(0) (not a Shard subclass in every torch version)
    rows_only = [pl if getattr(pl, "dim", None) == 0 and not pl.is_replicate() else Replicate() for pl in p.placements]
    index = torch.arange(p.shape[0], device=p.to_local().device)
    return cut_locally(index, p.device_mesh, rows_only).to_local()
