"""The Triton Adam-mini plan on FSDP2's local rows (``distributed.py`` has the layout of the states).

One plan takes one group's DTensor params of one (device, dtype, momentum dtype), as the
single-process plan does, and steps each param's local rows with the same kernel, in three parts:

1. ``begin``, ``take_grads`` and ``block_sums``: the begin kernel, the gradients' table, then one
   launch that writes this rank's sum of g² over its rows of every block that is not a row (a
   head, a norm, a whole tensor: kind 4 items) into the param's slot of the optimizer's
   ``ShardSums`` (``use_block_sums``);
2. ``update_free``: the update launch of the items that need no sum from other ranks (rows that
   are blocks, kind 0, form their second moments in the kernel, as in one process; plain Adam's
   are elementwise), launched while the caller's all-reduce of the slots runs;
3. once the slots are summed and divided into means, the caller updates the split blocks'
   replicated second moments with PyTorch's foreach ops (``block_moments``: each rank updates
   every block, not only its own, so the ``Replicate`` DTensor stays the same everywhere), and
   ``update_given`` launches the split blocks' rows (kind 3 items of as many rows as a per-row
   launch's, so that a head's rows run in parallel), which read them.

The optimizer runs ``block_sums`` and step 3 on a side stream on CUDA, beside ``update_free``.

FP8 momentum goes without the bf16 fallback pool (``distributed.py``): the kernel is handed a pool
of 0 slots, so a sub-block that would fall back stays FP8 and counts as an overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..shared.buckets import pointer_table
from .distributed import ShardedParam, local_state_view
from .plan import ADAM, GIVEN, ROW, SUM, AdamMiniTritonPlan

# ShardSums' slots start 16 floats apart (64 bytes), so that the kernel's alignment promise for a
# second-moment pointer (VEC launches) holds for them too; the placeholder of a param with no slot
# is as long.
SLOT_ALIGN = 16


@dataclass(frozen=True)
class LocalRows:
    """A sharded param's local rows as the plan takes them: ``kind`` ("row": every row a block,
    "adam": per element, "block": rows of blocks that may be split across ranks), a ``rows`` x
    ``cols`` matrix view, and ``runs`` ((first local row, rows, block) of each block's local part)."""

    kind: str
    rows: int
    cols: int
    runs: tuple[tuple[int, int, int], ...]
    blocks: int  # the param's blocks, whole (slots in the buffer of partial sums)

    @staticmethod
    def of(item: ShardedParam) -> LocalRows:
        t = item.local
        rows = (1 if t.numel() else 0) if item.vector else t.shape[0]
        cols = t.numel() // rows if rows else 0
        kind = "adam" if item.part.kind == "adam" else "row" if item.rows_local else "block"
        runs: list[tuple[int, int, int]] = []
        if kind == "block":
            for r, b in enumerate(item.block_ids_host):
                if runs and runs[-1][2] == b:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1, b)
                else:
                    runs.append((r, 1, b))
        return LocalRows(kind, rows, cols, tuple(runs), item.part.blocks if kind == "block" else 0)


class ShardedAdamMiniPlan(AdamMiniTritonPlan):
    """``items``' params (one group; one device, dtype and momentum dtype) and their ``states``."""

    def __init__(self, items: list[ShardedParam], states: list[dict], sub_block: int) -> None:
        self.items = items
        device = items[0].local.device
        views = [local_state_view(s, sub_block, device) for s in states]
        super().__init__([it.p for it in items], views, [LocalRows.of(it) for it in items], sub_block, 1.0)
        for state, view in zip(states, views, strict=True):
            state["step"] = view["step"]  # views of the plan's device buffer of step counts
        self._reduced = [i for i, q in enumerate(self.parts) if q.kind == "block"]
        self._no_sums = torch.zeros(SLOT_ALIGN, dtype=torch.float32, device=device)  # params with no slot
        self._sum_views: list[Tensor] = []
        self._grad_table = None  # this step's gradient table, from take_grads to the update launches

    def use_block_sums(self, views: dict[int, Tensor]) -> None:
        """Keep the split blocks' sums in ``views`` (a ``ShardSums``' slots, by ``id`` of the param:
        [blocks] fp32 each, 16-float aligned, as the kernel's vector loads of v want)."""
        self._sum_views = [views[id(self.items[i].p)] if i in self._reduced else self._no_sums
                           for i in range(len(self.parts))]  # fmt: skip
        if self.multi_tensor:
            self._sum_table = pointer_table(self._sum_views, self.device)

    def configure(self, config) -> None:
        super().configure(config)
        rows = self.config["ROWS"]
        groups: dict[tuple, list] = {}
        for i, q in enumerate(self.parts):
            if q.runs:  # the general (not whole-row) path: kind 4 takes only the first pass
                key = (-1 if self.multi_tensor else i, 16 if self.multi_tensor and self._vectorizable(i) else 1)
                groups.setdefault((*key, rows, (0, 0, 0)), []).extend((i, r0, nr, b, SUM) for r0, nr, b in q.runs)
        self._sum_launches = [(key, torch.tensor(its, dtype=torch.int32, device=self.device).view(-1, 5))
                              for key, its in sorted(groups.items())]  # fmt: skip

    def _launch_list(self, groups: dict[tuple, list]) -> list[tuple[tuple, Tensor]]:
        # the update's items apart too: those that read the split blocks' moments (kind 3) wait for the sums
        split = {given: {k: [it for it in its if (it[4] == GIVEN) == given] for k, its in groups.items()}
                 for given in (False, True)}  # fmt: skip
        self._free_launches = super()._launch_list(split[False])
        self._given_launches = super()._launch_list(split[True])
        return self._free_launches + self._given_launches  # every launch (what a background compile warms)

    def _items(self, part: LocalRows, tensor: int, rows_per_item: int) -> list[tuple[int, int, int, int, int]]:
        if part.kind == "block":  # the block's v is read, not formed: its rows split into items as rows do
            return [(tensor, r, min(rows_per_item, r0 + nr - r), b, GIVEN)
                    for r0, nr, b in part.runs for r in range(r0, r0 + nr, rows_per_item)]  # fmt: skip
        kind = ADAM if part.kind == "adam" else ROW
        return [(tensor, r, min(rows_per_item, part.rows - r), 0 if kind == ADAM else r, kind)
                for r in range(0, part.rows, rows_per_item)]  # fmt: skip

    def take_grads(self, checked_grads) -> None:
        """Upload this step's gradient table (multi-tensor) for the launches below, on the stream
        that produced the gradients. Call after ``begin``."""
        if self.multi_tensor:
            self._grad_table = self._grads.update(self.params, checked_grads)

    def block_sums(self, group: dict, checked_grads) -> None:
        """This rank's Σ g² over its rows of each split block, added into its slots (blocks it holds
        no row of stay 0; the caller zeroes the slots). Call after ``take_grads``."""
        if self._reduced:
            self.launch(self._sum_launches, group, checked_grads, self._sum_table if self.multi_tensor else None,
                        self._sum_views.__getitem__, grad_table=self._grad_table)  # fmt: skip

    def block_moments(self) -> list[Tensor]:
        """The split blocks' second moments ([blocks] fp32 each), in the order of ``block_means``."""
        return [self._tensor(i, "v") for i in self._reduced]

    def block_means(self) -> list[Tensor]:
        """The split blocks' slots, once summed over the ranks and divided into means of g²."""
        return [self._sum_views[i] for i in self._reduced]

    def update_free(self, group: dict, checked_grads) -> None:
        """The update launch of the items that read no split block's moment (after ``block_sums``)."""
        self.launch(self._free_launches, group, checked_grads, grad_table=self._grad_table)

    def update_given(self, group: dict, checked_grads) -> None:
        """The update launch of the split blocks' items (after their moments were updated)."""
        self.launch(self._given_launches, group, checked_grads, grad_table=self._grad_table)
        self._grad_table = None
