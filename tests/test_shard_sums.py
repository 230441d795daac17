"""``ShardSums`` on 2 Gloo ranks: slots of sharded parameters in one buffer per shard group, summed
over the ranks by one all-reduce, at once or left running; ``slotwise`` values per slot."""

from __future__ import annotations

import torch
from distributed import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from kernel_factory.optimizers.shared.shard_sums import ShardSums

SIZES = [5, 20, 16]  # slots of three sharded params (not multiples of 16: padding between them)


def _slots_sum_over_ranks(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    params = [distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]) for _ in SIZES]
    sums = ShardSums(list(zip(params, SIZES, strict=True)))
    ((_, buffer),) = sums.buffers  # one shard group, one device: one buffer
    for p, size in zip(params, SIZES, strict=True):
        view = sums[p]
        assert p in sums and view.numel() == size
        assert (view.storage_offset() - buffer.storage_offset()) % 16 == 0  # the kernels' vector loads
    divisors = sums.slotwise({id(p): torch.full((size,), float(i + 2)) for i, (p, size) in
                              enumerate(zip(params, SIZES, strict=True))})[0]  # fmt: skip
    expected_divisor = torch.ones_like(buffer)
    for i, p in enumerate(params):
        start = sums[p].storage_offset() - buffer.storage_offset()
        expected_divisor[start : start + SIZES[i]] = i + 2
    assert torch.equal(divisors, expected_divisor)
    for async_op in (False, True):
        sums.zero_()
        for i, p in enumerate(params):
            sums[p].add_(torch.arange(SIZES[i], dtype=torch.float32) * (rank + 1) + i)
        works = sums.all_reduce(async_op=async_op)
        assert len(works) == (1 if async_op else 0)
        for w in works:
            w.wait()
        total = sum(r + 1 for r in range(world))
        for i, p in enumerate(params):
            want = torch.arange(SIZES[i], dtype=torch.float32) * total + i * world
            assert torch.equal(sums[p], want), (async_op, i)
        padding = torch.ones_like(buffer, dtype=torch.bool)
        for p in params:
            start = sums[p].storage_offset() - buffer.storage_offset()
            padding[start : start + sums[p].numel()] = False
        assert not buffer[padding].any()  # zeros on every rank: the padding stays zero


def test_slots_are_aligned_and_summed_over_the_ranks_at_once_or_left_running():
    run_ranks(2, _slots_sum_over_ranks)


def _zero_clears_the_slots_no_step_writes(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    params = [distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)]) for _ in SIZES]
    sums = ShardSums(list(zip(params, SIZES, strict=True)))
    ((_, buffer),) = sums.buffers
    buffer.fill_(float(rank + 1))  # last step's sums everywhere, padding included
    sums.written({id(params[0]), id(params[2])})
    sums.zero_()  # clears the one slot no step writes; leaves the written ones as they were
    assert torch.equal(sums[params[1]], torch.zeros(SIZES[1]))
    assert all(torch.equal(sums[p], torch.full((n,), float(rank + 1))) for p, n in zip(params[::2], SIZES[::2],
                                                                                      strict=True))  # fmt: skip
    sums.zero_(whole=True)
    assert not buffer.any()


def test_zero_clears_only_the_slots_no_step_writes_unless_asked_for_every_buffer():
    run_ranks(2, _zero_clears_the_slots_no_step_writes)
