"""RowShard's rank-major segments (ZeRO-2's buckets): what ``scatter_rows`` writes, ``gather_pairs``
reads back, and ``piece`` / ``local_rows`` agree with ``torch.chunk``, FSDP2's dim-0 split."""

from __future__ import annotations

import pytest
import torch

from kernel_factory.optimizers.shared.row_shards import RowShard

# even splits, a short last chunk, tail ranks with no rows, 1-D and 3-D parameters
SHAPES = [(8, 3), (5, 3), (1, 7), (9,), (2, 2, 3), (16, 4)]


def _bucket(shapes: list[tuple[int, ...]], world: int, rank: int) -> tuple[list[RowShard], int]:
    """Shards laid out one after another in a rank's piece, as ``GradBucket`` lays them."""
    shards, offset = [], 0
    for shape in shapes:
        s = RowShard(shape, world, rank)
        s.offset, offset = offset, offset + s.padded_numel
        shards.append(s)
    return shards, offset


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_segments_hold_each_ranks_chunk_padded_and_read_back_whole(world):
    gen = torch.Generator().manual_seed(world)
    fulls = [torch.randn(shape, generator=gen) for shape in SHAPES]
    for rank in range(world):
        shards, n = _bucket(SHAPES, world, rank)
        segments = torch.full((world, n), float("nan"))  # every slot must be written
        for s, full in zip(shards, fulls, strict=True):
            s.scatter_rows(full, segments)
        assert not segments.isnan().any()
        for s, full in zip(shards, fulls, strict=True):
            chunks = torch.chunk(full.reshape(s.rows, -1), world, dim=0)
            for r in range(world):
                slot = s.slots(segments)[r]
                mine = chunks[r] if r < len(chunks) else full.new_zeros(0, s.row_numel)
                assert torch.equal(slot[: mine.shape[0]], mine), (s.rows, r)
                assert not slot[mine.shape[0] :].any(), "padding rows must be zero"
            assert torch.equal(s.local_rows(full).reshape(-1, s.row_numel), chunks[rank] if rank < len(chunks)
                               else full.new_zeros(0, s.row_numel))  # fmt: skip
            assert torch.equal(s.piece(segments[rank]), s.local_rows(full).reshape(-1))
            back = torch.zeros_like(full)
            pairs = s.gather_pairs(segments, back)
            torch._foreach_copy_([d for d, _ in pairs], [src for _, src in pairs])
            assert torch.equal(back, full)


def test_a_non_contiguous_gradient_is_scattered_like_its_contiguous_copy():
    full = torch.randn(7, 5).t()  # [5, 7], column-major
    assert not full.is_contiguous()
    for world in (2, 3):
        (s,), n = _bucket([tuple(full.shape)], world, 0)
        ours, theirs = torch.zeros(world, n), torch.zeros(world, n)
        s.scatter_rows(full, ours)
        s.scatter_rows(full.contiguous(), theirs)
        assert torch.equal(ours, theirs)
