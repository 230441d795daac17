"""Timing helpers for benchmarks and the tuner: medians with cold L2, and the copy ceiling."""

from __future__ import annotations

from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> tuple[float, float, float]:
    """(p20, p50, p80) milliseconds of ``fn()`` on the current CUDA stream, timed with CUDA
    events by ``triton.testing.do_bench``, which flushes L2 before every call."""
    from triton.testing import do_bench

    q = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
    return float(q[0]), float(q[1]), float(q[2])


def copy_bandwidth_tbs(nbytes: int = 2 << 30, device: str = "cuda") -> float:
    """Measured device-to-device copy rate in TB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    _, p50, _ = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (p50 * 1e-3) / 1e12


def restoring_timer(reps: int = 30, flush_bytes: int = 256 << 20):
    """A tuner timer: p20/p50/p80 ms of ``task.run()`` over ``reps`` runs, each after
    ``task.restore()`` (in-place updates undone) and an L2 flush, neither of them timed."""

    def timer(task) -> tuple[float, float, float]:
        flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device="cuda")
        times = []
        for _ in range(reps):
            task.restore()
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            task.run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        q = torch.tensor(times).quantile(torch.tensor([0.2, 0.5, 0.8])).tolist()
        return q[0], q[1], q[2]

    return timer
