"""The few collectives the distributed optimizers issue, under one name across torch versions.

torch 2.13 renamed ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to ``reduce_scatter_single``
/ ``all_gather_single`` and deprecated the old names; torch 2.11 has only the old ones. Reductions
are SUM (the caller divides): Gloo has no ``AVG`` or ``PREMUL_SUM``.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def reduce_scatter_sum(out: Tensor, inp: Tensor, group, async_op: bool = True):
    """``out`` ([n]) = this rank's n-element slice of the sum over ranks of ``inp`` ([world * n])."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(out: Tensor, inp: Tensor, group, async_op: bool = True):
    """``out`` ([world * n]) = every rank's ``inp`` ([n]), in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)
