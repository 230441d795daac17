"""``peer_copies``' layout against the all-to-all it replaces, and its refusal of CPU tensors."""

import random

import pytest
import torch

from kernel_factory.optimizers.muon.peer_copies import SymmetricPool, piece_offsets


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_piece_offsets_put_each_piece_where_the_all_to_all_does(world):
    """Every rank's send buffer (the other owners' pieces, owner by owner) moved by the offsets
    equals ``all_to_all_single``'s output (rank by rank, by the split sizes), for random counts of
    matrices and uneven rows, an empty rank among them."""
    rng = random.Random(world)
    for _ in range(20):
        n, cols = rng.randint(1, 9), rng.randint(1, 5)
        heres = [rng.randint(0, 3) for _ in range(world)]
        sizes, sent_at, got_at = piece_offsets(world, n, heres, cols)
        sends = [torch.randn(sum(sizes[s])) for s in range(world)]
        for r in range(world):
            expected = torch.cat([sends[s][sum(sizes[s][:r]) :][: sizes[s][r]] for s in range(world)])
            got = torch.full_like(expected, float("nan"))
            for s in range(world):
                got[got_at[r][s] :][: sizes[s][r]] = sends[s][sent_at[s][r] :][: sizes[s][r]]
            assert torch.equal(got, expected), (world, n, heres, r)
            assert sizes[r][r] == 0


def test_symmetric_pools_refuse_cpu_tensors_naming_the_switch():
    with pytest.raises(RuntimeError, match="peer_copies needs the shard group's matrices on CUDA"):
        SymmetricPool(8, torch.device("cpu"), None)
