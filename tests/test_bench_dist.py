"""The multi-GPU benchmark's one-GPU baseline (``shard+...``): plain tensors shaped as one rank's
FSDP2 shards, or for Muon the hidden matrices a rank owns (CPU: shapes and ownership only)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

from benchmarks.bench_dist import (
    after_marker,
    collective,
    exposed_ms,
    exposed_per_iteration,
    gathered,
    median_of_rank_means,
    shard_params,
)
from benchmarks.convergence.model import ModelConfig, TinyLlama
from kernel_factory.optimizers.muon.optimizer import uses_muon

CONFIG = ModelConfig(vocab_size=64, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=16)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_ranks_shards_cover_the_model_once(world):
    model = TinyLlama(CONFIG)
    for name, p in model.named_parameters():
        parts = [dict(shard_params(model, "ours", world, r))[name] for r in range(world)]
        assert [t.shape[0] for t in parts] == [c.shape[0] for c in torch.chunk(p.detach(), world)] + \
            [0] * (world - len(torch.chunk(p.detach(), world)))  # fmt: skip
        assert all(t.shape[1:] == p.shape[1:] and t.grad is not None and t.grad.shape == t.shape for t in parts)


@pytest.mark.parametrize("world", [2, 3])
def test_muon_ranks_own_each_hidden_matrix_once_round_robin_by_shape(world):
    model = TinyLlama(CONFIG)
    owned = [dict(shard_params(model, "muon", world, r)) for r in range(world)]
    seen: dict[tuple, int] = {}
    for name, p in model.named_parameters():
        if uses_muon(name, p):
            j = seen[tuple(p.shape)] = seen.get(tuple(p.shape), -1) + 1
            assert [name in o for o in owned] == [r == j % world for r in range(world)], name
            assert owned[j % world][name].shape == p.shape
        else:
            assert sum(o[name].shape[0] for o in owned) == p.shape[0], name


# K and V hold 3 heads of 16 rows: 2 ranks split a head (as the 134M model's 3 KV heads of 64 rows)
SPLIT_HEADS = ModelConfig(vocab_size=64, dim=96, n_layers=2, n_heads=6, n_kv_heads=3, ffn_dim=128, max_seq_len=16)


def every_config_steps(rank: int, world: int) -> None:
    """Each configuration of the benchmark built at ``world`` Gloo ranks on CPU and stepped twice."""
    from benchmarks.bench_dist import CONFIGS, build

    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(rank)
    for config in CONFIGS:
        module, opt = build(config, SPLIT_HEADS, device, world, rank)
        for _ in range(2):
            if module is not None:
                x = torch.randint(0, SPLIT_HEADS.vocab_size, (2, 9), generator=gen)
                logits = module(x[:, :-1]).float()
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
            opt.step()
            if module is not None:
                opt.zero_grad(set_to_none=True)
        params = [p for group in opt.param_groups for p in group["params"]]
        assert all(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all() for p in params), config


def test_every_configuration_builds_and_steps_at_two_ranks():
    """The benchmark's configurations (FSDP2, ZeRO-2, DDP, one GPU, shard) on 2 Gloo ranks: what a
    multi-GPU run would take, caught on CPU first."""
    run_ranks(2, every_config_steps)


def test_exposed_communication_counts_only_what_follows_the_window_marker():
    # (name, start us, end us): a rank waiting 400 us in the marker for a peer's profiler to start,
    # then an all-reduce half hidden by a matmul and a 100 us all-gather with nothing beside it
    kernels = [("fill", 0.0, 5.0), ("ncclDevKernel_AllReduce", 10.0, 410.0), ("gemm", 420.0, 520.0),
               ("ncclDevKernel_AllReduce_Sum", 470.0, 570.0), ("ncclDevKernel_AllGather", 600.0, 700.0)]  # fmt: skip
    assert exposed_ms(after_marker(kernels)) == pytest.approx((50.0 + 100.0) / 1e3)
    assert exposed_ms(kernels) == pytest.approx((400.0 + 50.0 + 100.0) / 1e3)  # the wait, without the marker
    no_comm = [("gemm", 0.0, 10.0)]
    assert after_marker(no_comm) == no_comm


def _gathers_every_ranks_windows(rank: int, world: int) -> None:
    assert gathered([float(rank), 10.0 + rank]) == [[float(r), 10.0 + r] for r in range(world)]


def test_the_exposed_figure_is_the_median_over_iterations_of_the_ranks_mean():
    run_ranks(2, _gathers_every_ranks_windows)
    assert gathered([1.0, 2.0]) == [[1.0, 2.0]]  # no process group: this process's own
    # 2 ranks x 3 iterations: the ranks' means 2, 9 (a stall on rank 1) and 3; their median 3
    assert median_of_rank_means([[1.0, 2.0, 2.0], [3.0, 16.0, 4.0]]) == pytest.approx(3.0)
    assert median_of_rank_means([[5.0]]) == pytest.approx(5.0)


def test_exposed_communication_is_cut_into_iterations_at_the_markers_and_named_by_collective():
    # markers at 0, 100, 200, 300 (the last before the closing forward): spans [100, 200), [200, 300)
    # count; the first span [0, 100) does not (no earlier step's gathers were in flight in it)
    kernels = [("spin_kernel", 0.0, 1.0), ("ncclDevKernel_ReduceScatter_Sum_bf16", 50.0, 80.0),
               ("spin_kernel", 100.0, 101.0), ("gemm", 101.0, 150.0),
               ("ncclDevKernel_AllGather_RING_LL", 140.0, 230.0),  # 10 us under the gemm, cut at 200
               ("spin_kernel", 200.0, 201.0), ("gemm", 230.0, 260.0),
               ("ncclDevKernel_ReduceScatter_Sum_bf16", 250.0, 280.0),  # 10 us under the gemm
               ("ncclDevKernel_AllReduce_Sum_f32", 270.0, 290.0),  # overlaps the reduce-scatter: its own 10
               ("spin_kernel", 300.0, 301.0), ("ncclDevKernel_AllGather_RING_LL", 310.0, 340.0)]  # fmt: skip
    spans = exposed_per_iteration(kernels)
    assert len(spans) == 2
    assert spans[0] == pytest.approx({"AllGather": 0.050})
    assert spans[1] == pytest.approx({"AllGather": 0.030, "ReduceScatter": 0.020, "AllReduce": 0.010})
    # counted whole, the marker at 200 is a compute kernel covering 1 us of the gather
    assert exposed_ms(kernels) == pytest.approx((30 + 80 - 1 + 20 + 10 + 30) / 1e3)
    assert collective("gemm") is None and collective("ncclKernel_Unknown") == "other"


def test_the_timeline_keeps_the_last_held_step_from_its_release_with_idle_gaps():
    from benchmarks.dist_step_profile import format_timeline

    events = [("spin_kernel", 0, 100, 7), ("ncclDevKernel_AllReduce", 100, 5, 20), ("a", 106, 10, 7),
              ("spin_kernel", 200, 100, 7), ("ncclDevKernel_AllReduce", 300, 10, 20),
              ("update", 311, 20, 7), ("ncclDevKernel_SendRecv", 315, 40, 20), ("apply", 370, 10, 7)]  # fmt: skip
    text = format_timeline(events)
    rows = [line.split() for line in text.splitlines()[1:4]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("1.0", "20.0", "7", "update"),
                                                         ("5.0", "40.0", "20", "ncclDevKernel_SendRecv"),
                                                         ("60.0", "10.0", "7", "apply")]  # fmt: skip
    assert "step: 70.0 us" in text and "stream 7: busy 30.0 us" in text
    assert "stream 7 idle 39.0 us from 21.0, before apply" in text  # 331 -> 370: waiting on the SendRecv
    assert format_timeline([("k", 0, 1, 7)]) == "no held step found\n"
