"""CPU tier, Triton backend: sharded Muon's owner gather (kernel_templates/muon_owner.py.j2 and
muon.py.j2's norm_kernel, ``owner_gather.OwnerGather``) under TRITON_INTERPRET=1: the matrices come
out whole and bitwise, and their norms are the same bits for every world size and owner rank."""

from __future__ import annotations

import pytest
import torch

from kernel_factory.generator import interpreter_enabled
from kernel_factory.optimizers.muon.owner_gather import OwnerGather

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tier)")

EPS_BF16 = float(torch.tensor(1e-7).bfloat16())


def gathered(full: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The owner ``rank``'s rows and norms of ``full`` (owned, R, C) bf16, split by rows over
    ``world`` ranks as FSDP2 splits them, laid out as ``ShardedMuonBatch`` receives them."""
    owned, R, C = full.shape
    P = -(-R // world)
    heres = [max(0, min(P, R - s * P)) for s in range(world)]
    sizes = [0 if s == rank else owned * heres[s] * C for s in range(world)]
    starts = [sum(sizes[:s]) for s in range(world)]
    got = torch.full((sum(sizes),), float("nan"), dtype=torch.bfloat16)
    own = full[:, rank * P : rank * P + heres[rank]].clone()
    for s in range(world):
        if s != rank and heres[s]:
            got[starts[s] : starts[s] + sizes[s]] = full[:, s * P : s * P + heres[s]].reshape(-1)
    rows = torch.full_like(full, float("nan"))
    norm = torch.full((owned,), float("nan"))
    OwnerGather(got, own, starts, heres, rows, P, rank)(norm, EPS_BF16)
    return rows, norm


@pytest.mark.parametrize(("R", "C"), [(5, 3), (16, 300), (77, 40), (1, 7)])
def test_the_owner_gets_whole_matrices_and_one_norm_at_every_world_size(R, C):
    """Uneven splits (5 rows over 4: 2, 2, 1, 0), a row over 4 ranks, tiles that cross the ranks'
    row boundaries and ragged column tiles; a zero matrix takes eps."""
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
