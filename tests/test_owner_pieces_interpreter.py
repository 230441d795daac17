"""CPU tier, Triton backend: sharded Muon's owner kernels (kernel_templates/muon_owner.py.j2 and
muon.py.j2's norm_kernel, ``owner_pieces.OwnerPieces``) under TRITON_INTERPRET=1: the matrices come
out whole and bitwise, their norms the same bits at every world size and owner rank (and where the
pieces were put into the matrices in place), and O's rows go back into the pieces bitwise."""

from __future__ import annotations

import pytest
import torch

from kernel_factory.generator import interpreter_enabled
from kernel_factory.optimizers.muon.owner_pieces import OwnerPieces

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tier)")

EPS_BF16 = float(torch.tensor(1e-7).bfloat16())


class Owner:
    """Rank ``rank``'s buffers for owned matrices (owned, R, C) split by rows over ``world`` ranks
    as FSDP2 splits them, laid out as ``ShardedMuonBatch`` holds them (NaN where nothing is put)."""

    def __init__(self, owned: int, R: int, C: int, world: int, rank: int) -> None:
        self.P = P = -(-R // world)
        self.rank, self.heres = rank, [max(0, min(P, R - s * P)) for s in range(world)]
        sizes = [0 if s == rank else owned * self.heres[s] * C for s in range(world)]
        self.starts = [sum(sizes[:s]) for s in range(world)]
        self.sizes = sizes
        nan = dict(fill_value=float("nan"), dtype=torch.bfloat16)
        self.got, self.reply = torch.full((sum(sizes),), **nan), torch.full((sum(sizes),), **nan)
        self.own_in, self.own_out = (torch.full((owned, self.heres[rank], C), **nan) for _ in range(2))
        self.rows = torch.full((owned, R, C), **nan)
        self.kernels = OwnerPieces(self.got, self.reply, self.own_in, self.own_out, self.starts, self.heres,
                                   self.rows, P, rank)  # fmt: skip

    def piece(self, flat: torch.Tensor, own: torch.Tensor, s: int, shape) -> torch.Tensor:
        """Rank s's part of a flat buffer, or this rank's own part."""
        owned, _, C = shape
        if s == self.rank:
            return own
        return flat[self.starts[s] : self.starts[s] + self.sizes[s]].view(owned, self.heres[s], C)


def gathered(full: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner's rows and norms of ``full`` (owned, R, C) bf16 from its pieces."""
    owner = Owner(*full.shape, world, rank)
    for s in range(world):
        if owner.heres[s]:
            part = full[:, s * owner.P : s * owner.P + owner.heres[s]]
            owner.piece(owner.got, owner.own_in, s, full.shape).copy_(part)
    norm = torch.full((full.shape[0],), float("nan"))
    owner.kernels.gather(norm, EPS_BF16)
    return owner.rows, norm


SHAPES = [(5, 3), (16, 300), (77, 40), (1, 7)]  # uneven (5 rows over 4: 2, 2, 1, 0), ragged tiles


@pytest.mark.parametrize(("R", "C"), SHAPES)
def test_the_owner_gets_whole_matrices_and_one_norm_at_every_world_size(R, C):
    """Tiles across the ranks' row boundaries; a zero matrix takes eps."""
    gen = torch.Generator().manual_seed(R * 1000 + C)
    full = torch.randn((3, R, C), generator=gen).bfloat16()
    full[1] = 0
    rows, norm = gathered(full, 1, 0)
    assert torch.equal(rows, full)
    reference = torch.linalg.vector_norm(full, dim=(-2, -1)).float().clamp(min=EPS_BF16)
    # torch's fp32 sum runs in another order: at most the last bf16 place of the norm differs
    assert torch.allclose(norm, reference, rtol=2**-8, atol=0), (norm, reference)
    assert norm[1] == EPS_BF16
    for world in (2, 3, 4):
        for rank in range(world):
            rows_w, norm_w = gathered(full, world, rank)
            assert torch.equal(rows_w, full), (world, rank)
            assert torch.equal(norm_w, norm), (world, rank, norm_w, norm)


@pytest.mark.parametrize(("R", "C"), SHAPES)
def test_norms_of_pieces_already_in_place_are_the_gathers_bits(R, C):
    """``norms`` (the peer copies put the pieces into the rows): the same bits as ``gather``'s,
    the rows untouched."""
    gen = torch.Generator().manual_seed(R * 10 + C)
    full = torch.randn((3, R, C), generator=gen).bfloat16()
    _, expected = gathered(full, 2, 1)
    owner = Owner(*full.shape, 2, 1)
    owner.rows.copy_(full)
    norm = torch.full((full.shape[0],), float("nan"))
    owner.kernels.norms(norm, EPS_BF16)
    assert torch.equal(norm, expected), (norm, expected)
    assert torch.equal(owner.rows, full)


@pytest.mark.parametrize(("R", "C"), SHAPES)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_o_goes_back_into_the_pieces_from_any_layout(R, C, world):
    """O's rows contiguous, or a transposed view (a tall matrix's), into every rank's piece."""
    gen = torch.Generator().manual_seed(R * 100 + C + world)
    ortho = torch.randn((2, R, C), generator=gen).bfloat16()
    for rows in (ortho, ortho.mT.contiguous().mT):
        for rank in range(world):
            owner = Owner(*rows.shape, world, rank)
            owner.kernels.scatter(rows)
            for s in range(world):
                part = owner.piece(owner.reply, owner.own_out, s, rows.shape)
                assert torch.equal(part, ortho[:, s * owner.P : s * owner.P + owner.heres[s]]), (rank, s)


def test_o_of_another_shape_or_dtype_is_refused():
    owner = Owner(2, 5, 3, 2, 0)
    with pytest.raises(ValueError, match="bf16"):
        owner.kernels.scatter(torch.zeros((2, 5, 3)))
    with pytest.raises(ValueError, match=r"\(2, 5, 3\)"):
        owner.kernels.scatter(torch.zeros((2, 5, 4), dtype=torch.bfloat16))
