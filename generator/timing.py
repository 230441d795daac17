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


def alternate_medians(measures: dict[str, Callable[[], float]], rounds: int = 3) -> dict[str, float]:
    """Median over ``rounds`` of each measurement (a call returning milliseconds), the measurements
    taken in turn within each round, so that a drift of the GPU's clocks or of its neighbours
    during the run reaches them all alike."""
    times: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            times[name].append(measure())
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def copy_bandwidth_tbs(nbytes: int = 2 << 30, device: str = "cuda") -> float:
    """Measured device-to-device copy rate in TB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    _, p50, _ = time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (p50 * 1e-3) / 1e12


def matmul_tflops(n: int = 8192, device: str = "cuda") -> float:
    """Measured bf16 n x n x n matmul rate in TFLOP/s (2 n^3 FLOPs per product)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    _, p50, _ = time_ms(lambda: a @ b)
    return 2 * n**3 / (p50 * 1e-3) / 1e12


def capture_graph(fn: Callable[[], object], warmups: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one ``fn()`` on the current device, run ``warmups`` times on a side stream
    before the capture (compilation, lazy allocations), as torch's CUDA graph docs ask; the graph
    is returned unreplayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_time_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> tuple[float, float, float]:
    """``time_ms`` of replaying a CUDA graph of one ``fn()``: the device's time alone. Where fn
    issues its launches from Python (tensor descriptors, Triton's launcher: 30 µs and more), the
    GPU finishes the L2 flush before it gets them and ``time_ms`` counts the host's time too."""
    return time_ms(capture_graph(fn).replay, warmup_ms, rep_ms)


def restoring_timer(warmup_ms: float = 25, rep_ms: float = 100):
    """A tuner timer: (p20, p50, p80) ms of ``task.run()`` by ``time_ms`` (L2 flushed before
    every call), or by ``graph_time_ms`` for a task whose ``graph_replayed`` is true (its
    kernels run from CUDA graphs in use), with the in-place tensors restored before and after
    the timed runs but not between them. Restoring gigabytes before every run made the 134M
    AdamW median move by up to 13% from one call to the next on the H200, while repeats in place
    agreed within 0.1%; an optimizer step's time does not depend on the values it updates."""

    def timer(task) -> tuple[float, float, float]:
        task.restore()
        timed = graph_time_ms if getattr(task, "graph_replayed", False) else time_ms
        quantiles = timed(task.run, warmup_ms, rep_ms)
        task.restore()
        return quantiles

    return timer
