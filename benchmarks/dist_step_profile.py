"""Where a sharded optimizer step's time goes, per rank: host time, GPU time, kernels and the host's
Python profile, for FSDP2 + each of our optimizers against the same optimizer over plain tensors
shaped as this rank's shards (``bench_dist.py``'s ``fsdp2+...`` and ``shard+...`` builds).

    torchrun --nproc_per_node 2 benchmarks/dist_step_profile.py --out DIR [--configs ...]

Each configuration steps repeatedly on the gradients of one backward (FSDP2) or on fixed random
gradients (shard), and reports, as medians over ``--iters`` steps:

- ``wall``: ``opt.step()`` from an idle GPU to its last kernel (CUDA events), as ``bench_dist``'s
  step column;
- ``host``: the host's time inside ``opt.step()`` (perf_counter), the GPU left to run behind;
- ``queued``: the host's time per step with ``QUEUED`` steps issued back to back behind a held
  stream, as a training loop issues them (no synchronize before each: ``host`` times a step from
  an idle host, and moved up to 2x between runs of one code on an H200 machine);
- ``gpu``: the same step with the stream held back by a sleep kernel long enough for the host to
  issue everything first, then an all-reduce that lines the ranks' streams up (CUDA events around
  the step): the GPU's own time, collectives' latency included;
- ``kernels``: kernels per step (torch.profiler), with the GPU time of the largest by name in
  ``DIR/<config>_kernels.txt``, the host's time per operator (torch.profiler's CPU activity) in
  ``DIR/<config>_ops.txt`` and its cProfile in ``DIR/<config>_host.txt`` (rank 0);
- ``DIR/<config>_timeline.txt``: one held step's kernels in time order (start from the step's
  release, duration, stream), then each stream's busy time and the first stream's idle gaps: what
  overlaps and what waits (rank 0).

Kernels compile in the caller (``KERNEL_FACTORY_PRECOMPILE=0``): background compiles of variants
a step may never launch would take the GIL from the steps being timed.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("KERNEL_FACTORY_PRECOMPILE", "0")  # before kernel_factory reads it

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from benchmarks.bench_dist import (  # noqa: E402
    OURS,
    _init,
    add_model_args,
    add_muon_stages_arg,
    build,
    model_config_of,
    use_muon_stages,
)
from benchmarks.convergence.model import ModelConfig  # noqa: E402

HOLD_CYCLES = 50_000_000  # the sleep kernel's clock cycles: ~25 ms at 2 GHz, longer than any step's host time
QUEUED = 8  # steps issued back to back for ``queued`` (Muon's 66 launches x 8 stay within the launch queue)


def hold(marker: torch.Tensor) -> None:
    """Hold this rank's stream back by a sleep long enough for the host to issue a step ahead, then
    line the ranks' streams up by an all-reduce of ``marker`` (their clocks differ)."""
    torch.cuda._sleep(HOLD_CYCLES)
    dist.all_reduce(marker)


def _events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def timed_steps(opt: torch.optim.Optimizer, iters: int) -> dict[str, float]:
    """Medians of the step's wall, host and GPU time (ms) over ``iters`` steps each, and of the host's
    time per step over ``max(3, iters // QUEUED)`` rounds of ``QUEUED`` queued steps."""
    wall, host, gpu = [], [], []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = _events()
        start.record()
        t0 = time.perf_counter()
        opt.step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        wall.append(start.elapsed_time(end))
    marker = torch.zeros(1, device=torch.cuda.current_device())
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = _events()
        hold(marker)
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    queued = []
    for _ in range(max(3, iters // QUEUED)):
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(4 * HOLD_CYCLES)  # longer than QUEUED steps' host time
        t0 = time.perf_counter()
        for _ in range(QUEUED):
            opt.step()
        queued.append((time.perf_counter() - t0) * 1e3 / QUEUED)
        torch.cuda.synchronize()
    return {"wall": statistics.median(wall), "host": statistics.median(host), "gpu": statistics.median(gpu),
            "queued": statistics.median(queued)}  # fmt: skip


def kernel_table(opt: torch.optim.Optimizer, steps: int) -> tuple[float, str]:
    """(kernels per step, a table of GPU time per kernel name per step) over ``steps`` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals.setdefault(e.name, []).append(e.device_time_total)
    count = sum(len(v) for v in totals.values()) / steps
    lines = [f"{'us/step':>9} {'n/step':>6}  kernel"]
    for name, times in sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:25]:
        lines.append(f"{sum(times) / steps:9.1f} {len(times) / steps:6.1f}  {name[:110]}")
    return count, "\n".join(lines)


def held_step_timeline(opt: torch.optim.Optimizer, steps: int = 3) -> str:
    """The kernels of the last of ``steps`` held steps (as ``timed_steps``' gpu column), as
    ``format_timeline`` lays them out."""
    from torch.profiler import ProfilerActivity, profile

    marker = torch.zeros(1, device=torch.cuda.current_device())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dist.barrier()
            hold(marker)
            opt.step()
            torch.cuda.synchronize()
    events = [(e.name, e.time_range.start, e.time_range.end - e.time_range.start,
               getattr(e, "device_resource_id", None)) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
    return format_timeline(events)


def format_timeline(events: list[tuple[str, float, float, object]], gap_us: float = 5.0) -> str:
    """``events`` (name, start us, duration us, stream) of held steps: the last step's (after the
    last sleep kernel, from the end of the all-reduce that releases it), one line each, then the
    busy time per stream and the gaps over ``gap_us`` on the stream of the step's first kernel."""
    events = sorted(events, key=lambda e: e[1])
    holds = [i for i, e in enumerate(events) if "sleep" in e[0].lower() or "spin" in e[0].lower()]
    if not holds:
        return "no held step found\n"
    after = events[holds[-1] + 1 :]
    release = next((i for i, e in enumerate(after) if "AllReduce" in e[0]), None)
    if release is None:
        return "no releasing all-reduce found\n"
    t0 = after[release][1] + after[release][2]
    step = after[release + 1 :]
    lines = [f"{'start':>8} {'us':>7} {'stream':>6}  kernel"]
    lines += [f"{start - t0:8.1f} {dur:7.1f} {stream!s:>6}  {name[:90]}" for name, start, dur, stream in step]
    end = max((start + dur for _, start, dur, _ in step), default=t0)
    lines += ["", f"step: {end - t0:.1f} us from its release to its last kernel's end"]
    busy: dict[object, float] = {}
    for _, _, dur, stream in step:
        busy[stream] = busy.get(stream, 0.0) + dur
    lines += [f"stream {stream}: busy {us:.1f} us" for stream, us in busy.items()]
    if step:
        main = step[0][3]
        cursor, gaps = t0, []
        for name, start, dur, stream in step:
            if stream != main:
                continue
            if start - cursor > gap_us:
                gaps.append((cursor - t0, start - cursor, name))
            cursor = max(cursor, start + dur)
        lines += [f"stream {main} idle {g:.1f} us from {at:.1f}, before {name[:60]}" for at, g, name in gaps]
    return "\n".join(lines) + "\n"


def op_table(opt: torch.optim.Optimizer, steps: int) -> str:
    """The host's time per operator over ``steps`` steps (torch.profiler, CPU activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def host_profile(opt: torch.optim.Optimizer, steps: int) -> str:
    """cProfile of ``steps`` steps: the 30 functions with the most own time, then by cumulative time."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        opt.step()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def collective_costs(device: torch.device, iters: int = 50) -> str:
    """Host time per call (median) and GPU time per call (10 back to back, streams held and lined
    up as in ``timed_steps``) of an all-reduce of a few KiB, issued as the optimizers issue theirs."""
    t = torch.zeros(1024, device=device)
    rows = []
    for label, call in (("all_reduce", lambda: dist.all_reduce(t)),
                        ("all_reduce async + wait", lambda: dist.all_reduce(t, async_op=True).wait())):  # fmt: skip
        host, gpu = [], []
        for _ in range(iters):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            host.append((time.perf_counter() - t0) * 1e6)
        for _ in range(5):
            torch.cuda.synchronize()
            start, end = _events()
            hold(t)
            start.record()
            for _ in range(10):
                call()
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end) * 100)
        rows.append(f"| {label} | {statistics.median(host):.1f} | {statistics.median(gpu):.1f} |")
    return "\n".join(["| 4 KiB fp32 | host us | GPU us |", "|---|---:|---:|", *rows])


def run(config: str, args, model_config: ModelConfig, device: torch.device, world: int, rank: int) -> dict:
    module, opt = build(config, model_config, device, world, rank)
    if module is not None:  # FSDP2: one backward leaves the gradients every step reuses
        gen = torch.Generator(device="cpu").manual_seed(rank)
        x = torch.randint(0, model_config.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)
        logits = module(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
    for _ in range(args.warmup):
        opt.step()
    row = {"config": config, **timed_steps(opt, args.iters)}
    row["kernels"], kernels = kernel_table(opt, 5)
    ops = op_table(opt, 5)
    host = host_profile(opt, args.iters)
    timeline = held_step_timeline(opt)
    if rank == 0:
        (args.out / f"{config}_timeline.txt").write_text(timeline)
        (args.out / f"{config}_ops.txt").write_text(ops + "\n")
        (args.out / f"{config}_kernels.txt").write_text(kernels + "\n")
        (args.out / f"{config}_host.txt").write_text(host)
    del module, opt
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--configs", default=",".join(f"{w}+{o}" for o in OURS for w in ("fsdp2", "shard")))
    ap.add_argument("--out", type=Path, required=True)
    add_muon_stages_arg(ap)
    args = ap.parse_args(argv)
    use_muon_stages(ap, args)
    rank, world, device, _ = _init()
    model_config = model_config_of(args)
    args.out.mkdir(parents=True, exist_ok=True)
    collectives = collective_costs(device)
    rows = [run(c, args, model_config, device, world, rank) for c in args.configs.split(",")]
    if rank == 0:
        lines = [f"{world} rank(s), {torch.cuda.get_device_name(device)}, ms per step (medians of {args.iters})",
                 "", "| config | wall | host | gpu | kernels | queued |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {r['config']} | {r['wall']:.3f} | {r['host']:.3f} | {r['gpu']:.3f} | {r['kernels']:.0f} "
                  f"| {r['queued']:.3f} |" for r in rows]  # fmt: skip
        lines += ["", collectives]
        (args.out / "step_profile.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
