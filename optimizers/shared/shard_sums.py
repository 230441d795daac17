"""Sums over every rank's shard of FSDP2's sharded parameters, added in one all-reduce per shard group.

An optimizer whose step needs a sum that spans the ranks (a column statistic over all rows, a norm
over all elements) gives each such parameter a slot of fixed size in a buffer of its shard group
(``row_shard_group``) and device. A step zeroes the buffers, each rank writes its own part's sums
into its slots (a kernel, or PyTorch ops), ``all_reduce`` adds them (SUM: Gloo has no AVG), and the
slots are read back. Where the step stores every element of some slots (``written``), only the
others are zeroed (the padding is zero from allocation on: the ranks add zeros there). The slots
are the same on every rank, whatever each one holds locally (a rank with no rows of a parameter
leaves zeros): the collectives match whichever path a rank's part takes, and there is one per
shard group and device a step, not one per parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .dtensor import DTensor, local, row_shard_group


class ShardSums:
    """fp32 buffers for ``slots``: (param, size) pairs, DTensors whose dim 0 alone is split, in the
    same order on every rank. ``views[id(p)]`` is p's slot (``size`` elements, starting on a
    16-element boundary, as the kernels may load it in vectors)."""

    def __init__(self, slots: list[tuple[DTensor, int]]) -> None:
        groups: dict[tuple, tuple] = {}
        for p, size in slots:
            group = row_shard_group(p)[0]
            groups.setdefault((id(group), local(p).device), (group, []))[1].append((p, size))
        self.buffers: list[tuple[object, Tensor]] = []
        self.views: dict[int, Tensor] = {}
        self._spans: list[list[tuple[int, int, int]]] = []  # per buffer: (id of p, start, size) of each slot
        self._unwritten: list[Tensor] | None = None  # what zero_ clears: None for every buffer whole
        for (_, device), (group, members) in groups.items():
            offsets = [0]
            for _, size in members:
                offsets.append(offsets[-1] + -(-size // 16) * 16)
            buffer = torch.zeros(offsets[-1], dtype=torch.float32, device=device)
            self.buffers.append((group, buffer))
            self._spans.append([(id(p), start, size) for (p, size), start in zip(members, offsets, strict=False)])
            for (p, size), start in zip(members, offsets, strict=False):
                self.views[id(p)] = buffer[start : start + size]

    def __contains__(self, p: Tensor) -> bool:
        return id(p) in self.views

    def __getitem__(self, p: Tensor) -> Tensor:
        return self.views[id(p)]

    def written(self, ids: set[int]) -> None:
        """The slots (by ``id`` of their param) that each step stores whole before ``all_reduce``:
        ``zero_`` leaves them (the kernel that zeroes is a launch and a gap a step) and clears the rest."""
        self._unwritten = [self.views[i] for spans in self._spans for i, _, _ in spans if i not in ids]

    def zero_(self, whole: bool = False) -> None:
        """Zero the slots no step writes (``written``), or every buffer whole where ``whole`` or none
        was declared."""
        if whole or self._unwritten is None:
            for _, buffer in self.buffers:
                buffer.zero_()
        elif self._unwritten:
            torch._foreach_zero_(self._unwritten)

    def all_reduce(self, async_op: bool = False) -> list:
        """Every slot summed over its shard group: one all-reduce per group and device. With
        ``async_op`` the all-reduces are left running: ``wait`` on what it returns before reading
        a slot (on CUDA the stream waits, not the host), and launch meanwhile what needs no slot."""
        works = [dist.all_reduce(buffer, group=group, async_op=async_op) for group, buffer in self.buffers]
        return [w for w in works if w is not None]

    def slotwise(self, values: dict[int, Tensor]) -> list[Tensor]:
        """Tensors shaped as the buffers, each slot holding ``values[id(p)]`` (its size; ones in
        the padding): a divisor or a scale that one elementwise op per buffer applies to every slot."""
        out = []
        for (_, buffer), spans in zip(self.buffers, self._spans, strict=True):
            t = torch.ones_like(buffer)
            for key, start, size in spans:
                t[start : start + size] = values[key]
            out.append(t)
        return out
