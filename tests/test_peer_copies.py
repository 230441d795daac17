"""``peer_copies``' layout against the all-to-all it replaces, its refusal of CPU tensors, the
switch's decision (``takes_peer_copies``) and the pitched copy of blocks of rows (``copy_blocks``)."""

import random

import pytest
import torch

from kernel_factory.optimizers.muon import peer_copies
from kernel_factory.optimizers.muon.peer_copies import SymmetricPool, copy_blocks, piece_offsets, takes_peer_copies


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


GPU, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize(("setting", "world", "nccl", "device", "reach", "expected"), [
    ("auto", 2, True, GPU, True, True), ("auto", 2, True, GPU, False, False),  # GPUs that reach each other
    ("auto", 4, True, GPU, True, False), ("auto", 2, False, GPU, True, False),  # two NCCL ranks only
    ("auto", 2, False, CPU, True, False), ("auto", 1, True, GPU, True, False),
    (True, 4, True, GPU, True, True), (True, 2, False, CPU, False, True),  # CPU: the stand-in's pools
    (True, 1, True, GPU, True, False), (False, 2, True, GPU, True, False),
])  # fmt: skip
def test_the_switch_takes_peer_copies_where_it_should(monkeypatch, setting, world, nccl, device, reach, expected):
    asked = []
    monkeypatch.setattr(peer_copies, "direct_peers", lambda group, dev: asked.append(dev) or reach)
    assert takes_peer_copies(setting, world, nccl, device, None) is expected
    # the collective question is asked only where the answer hangs on it
    asks = setting is True or (setting == "auto" and world == 2 and nccl)
    assert asked == ([device] if device.type == "cuda" and world > 1 and asks else [])


def test_forced_peer_copies_between_gpus_that_cannot_reach_each_other_and_bad_values_are_named(monkeypatch):
    monkeypatch.setattr(peer_copies, "direct_peers", lambda group, dev: False)
    with pytest.raises(RuntimeError, match="peer_copies = True needs the shard group's GPUs on one host"):
        takes_peer_copies(True, 2, True, GPU, None)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="ShardedMuonBatch.peer_copies must be True, False or 'auto'"):
            takes_peer_copies(bad, 1, True, GPU, None)


def _blocks_case(device: str, batch: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [2, 2 + rows) of ``batch`` (R, cols) matrices (R = rows + 5) bf16, and a contiguous
    destination (batch, rows, cols) of NaN with its expected value."""
    gen = torch.Generator().manual_seed(batch * 100 + rows * 10 + cols)
    whole = torch.randn((batch, rows + 5, cols), generator=gen).to(device, torch.bfloat16)
    src = whole[:, 2 : 2 + rows]
    dst = torch.full((batch, rows, cols), float("nan"), dtype=torch.bfloat16, device=device)
    return dst, src, src.clone()


@pytest.mark.parametrize(("batch", "rows", "cols"), [(3, 4, 7), (1, 1, 5), (2, 3, 1)])
def test_copy_blocks_moves_each_matrixs_rows(batch, rows, cols):
    dst, src, expected = _blocks_case("cpu", batch, rows, cols)
    copy_blocks(dst, src)
    assert torch.equal(dst, expected)


def test_copy_blocks_names_what_is_wrong():
    dst, src, _ = _blocks_case("cpu", 2, 3, 4)
    with pytest.raises(ValueError, match="must be \\(B, rows, C\\) of one shape and dtype"):
        copy_blocks(dst[:, :2], src)
    with pytest.raises(ValueError, match="must be \\(B, rows, C\\) of one shape and dtype"):
        copy_blocks(dst.float(), src)
    with pytest.raises(ValueError, match="src's blocks must be contiguous rows"):
        copy_blocks(dst, src.mT.contiguous().mT)  # each row a column apart


def test_the_pitched_copy_is_found_where_torch_loaded_a_cuda_runtime(monkeypatch):
    """A CUDA build of torch maps its runtime, whose pitched copy ``copy_blocks`` calls; a build
    without one (this CPU wheel, or a runtime linked statically) gets None: copies block by block."""
    monkeypatch.setattr(peer_copies, "_CUDART", [])
    assert (peer_copies._memcpy_2d() is None) == (torch.version.cuda is None)


@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "rows", "cols"), [(3, 4, 7), (1, 1, 5), (5, 384, 768)])
def test_copy_blocks_on_a_gpu_is_one_pitched_copy_of_the_same_values(batch, rows, cols):
    """On CUDA (``cudaMemcpy2DAsync`` on the current stream, a side stream here): the same bits as
    torch's copy, and the destination's other rows untouched (a strided destination too)."""
    dst, src, expected = _blocks_case("cuda", batch, rows, cols)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        copy_blocks(dst, src)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(dst, expected)
    wide = torch.zeros((batch, rows + 3, cols), dtype=torch.bfloat16, device="cuda")
    copy_blocks(wide[:, 1 : 1 + rows], src)
    assert torch.equal(wide[:, 1 : 1 + rows], expected)
    assert not wide[:, :1].any() and not wide[:, 1 + rows :].any()
