"""FSDP2's dim-0 layout of one parameter over ``world`` ranks, and the rank-major segments that a
reduce-scatter or an all-gather of many parameters at once exchanges.

FSDP2 cuts a parameter of R rows like ``torch.chunk(p, world, dim=0)``: ``ceil(R / world)`` rows
per rank, the last non-empty chunk shorter, tail ranks empty. Collectives need equal pieces, so a
bucket of parameters travels as ``segments[world, n]``: rank r's piece holds, for each parameter
in turn, its chunk r padded to ``ceil(R / world)`` rows.
"""

from __future__ import annotations

import math

from torch import Tensor


class RowShard:
    """Where one parameter of ``shape`` (ndim >= 1) sits in the layout, seen from ``rank``.

    ``rows``, ``row_numel``: the parameter as an [R, C] matrix; ``per_rank``: ceil(R / world), its
    padded rows in every rank's piece; ``start``, ``end``: this rank's rows (``start == end`` for an
    empty shard); ``offset``: where its rows begin in a rank's piece of its bucket (set by the
    bucket).
    """

    def __init__(self, shape: tuple[int, ...], world: int, rank: int) -> None:
        self.rows, self.row_numel = shape[0], math.prod(shape[1:])
        self.world = world
        self.per_rank = -(-self.rows // world)
        self.start = min(rank * self.per_rank, self.rows)
        self.end = min(self.start + self.per_rank, self.rows)
        self.offset = 0
        # the chunks: `whole` full ones, then one of `rest` rows where R is not a multiple of
        # per_rank; `even`: R = world * per_rank (no padding). Fixed, so the gradient hooks, which
        # run once per parameter per backward on the host, do no arithmetic for them.
        self.whole, self.rest = divmod(self.rows, self.per_rank) if self.per_rank else (0, 0)
        self.even = self.whole == world

    @property
    def padded_numel(self) -> int:
        """Elements this parameter takes in each rank's piece."""
        return self.per_rank * self.row_numel

    def local_rows(self, full: Tensor) -> Tensor:
        """This rank's rows of ``full`` (a view: dim-0 slices of a contiguous tensor stay contiguous)."""
        return full[self.start : self.end]

    def slots(self, segments: Tensor) -> Tensor:
        """This parameter's slots in every rank's piece: a [world, per_rank, C] view of ``segments``
        ([world, n], rows contiguous; one strided view rather than a slice and a view)."""
        return segments.as_strided((self.world, self.per_rank, self.row_numel), (segments.stride(0), self.row_numel, 1),
                                   segments.storage_offset() + self.offset)  # fmt: skip

    def _chunks(self, full: Tensor) -> Tensor:
        """``full``'s first ``whole * per_rank`` rows as [whole, per_rank, C]."""
        return full.view(-1)[: self.whole * self.padded_numel].view(self.whole, self.per_rank, self.row_numel)

    def scatter_rows(self, full: Tensor, segments: Tensor) -> None:
        """Write ``full`` ([R, ...]) into its slots of ``segments`` ([world, n]), padding rows zeroed."""
        slots, full = self.slots(segments), full.contiguous()
        if self.even:
            slots.copy_(full.view(self.world, self.per_rank, self.row_numel))
            return
        whole, rest = self.whole, self.rest
        slots[:whole].copy_(self._chunks(full))
        if rest:
            slots[whole, :rest].copy_(full.view(self.rows, self.row_numel)[whole * self.per_rank :])
            slots[whole, rest:].zero_()
        slots[whole + (1 if rest else 0) :].zero_()

    def gather_pairs(self, segments: Tensor, full: Tensor) -> list[tuple[Tensor, Tensor]]:
        """(destination, source) views that read ``full`` ([R, ...], contiguous) back from its slots of
        ``segments`` ([world, n]): the caller copies many parameters' pairs in one foreach launch."""
        slots = self.slots(segments)
        if self.even:
            return [(full.view(self.world, self.per_rank, self.row_numel), slots)]
        pairs = [(self._chunks(full), slots[: self.whole])]
        if self.rest:
            tail = full.view(self.rows, self.row_numel)[self.whole * self.per_rank :]
            pairs.append((tail, slots[self.whole, : self.rest]))
        return pairs

    def piece(self, reduced: Tensor) -> Tensor:
        """This rank's rows within this rank's piece ``reduced`` ([n]), as [end - start, ...]."""
        return reduced[self.offset : self.offset + (self.end - self.start) * self.row_numel]
