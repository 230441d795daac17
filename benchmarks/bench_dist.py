"""The distributed layer's cost per training iteration, per rank: step time, exposed communication
and peak memory, for FSDP2 + each of our optimizers (AdamW, AdamMini with FP8 momentum, Muon),
FSDP2 + torch's fused AdamW, our ZeRO-2 DistributedAdamW and DDP + torch's fused AdamW, on a
Llama-shaped model (benchmarks/convergence/model.py); and, for the per-rank step against one GPU,
each of our optimizers on the unwrapped model (``1gpu+...``: the whole model on every rank, no
communication; at N ranks compare with the FSDP2 step over 1/N of it).

    torchrun --nproc_per_node 8 benchmarks/bench_dist.py        # NCCL, one GPU per rank
    python benchmarks/bench_dist.py                              # one rank (correct, not telling)

Per configuration: ``iter_ms`` (forward + backward + step, median of the timed iterations),
``step_ms`` (``opt.step()`` alone, with its all-gather for ZeRO-2), ``exposed_comm_ms`` (time the
GPU spent in communication kernels while no compute kernel ran, from the profiler's kernel
intervals of one iteration), ``peak_gib`` (``max_memory_allocated`` over the timed iterations) and
``state_gib`` (this rank's optimizer state). At one rank the collectives are copies: the figures
show the layer's overhead, not its scaling; the multi-GPU figures need several GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from benchmarks.convergence.model import ModelConfig, TinyLlama  # noqa: E402
from kernel_factory.optimizers import AdamMini, AdamW, DistributedAdamW, Muon  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_dist"
CONFIGS = ("fsdp2+ours", "fsdp2+adam_mini", "fsdp2+muon", "fsdp2+torch_fused", "zero2_ours", "ddp+torch_fused",
           "1gpu+ours", "1gpu+adam_mini", "1gpu+muon")
HYPER = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _init() -> tuple[int, int, torch.device, str]:
    """(rank, world, device, launcher): NCCL over torchrun's ranks, or one rank of a plain run."""
    launcher = "torchrun --nproc_per_node {world}" if "RANK" in os.environ else "python"
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain `python` run: one rank
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0",
                                  WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
        dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device, launcher


def build(config: str, model_config: ModelConfig, device: torch.device, world: int):
    """(module to call, optimizer) for ``config``, with bf16 parameters and fp32 optimizer math."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = TinyLlama(model_config).to(device=device, dtype=torch.bfloat16)
    c = model_config
    ours = {"ours": lambda: AdamW(model.parameters(), **HYPER),
            "adam_mini": lambda: AdamMini(model.named_parameters(), dim=c.dim, n_heads=c.n_heads,
                                          n_kv_heads=c.n_kv_heads, **HYPER),
            "muon": lambda: Muon(model.named_parameters(), lr=0.02, weight_decay=0.1, adamw_lr=HYPER["lr"]),
            }  # fmt: skip
    wrap, _, name = config.partition("+")
    if wrap == "1gpu":
        return model, ours[name]()
    if wrap == "fsdp2":
        mesh = init_device_mesh("cuda", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if name in ours:
            return model, ours[name]()
        return model, torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    if config == "zero2_ours":
        return model, DistributedAdamW(model.parameters(), **HYPER)
    ddp = DistributedDataParallel(model, device_ids=[device.index])
    return ddp, torch.optim.AdamW(model.parameters(), fused=True, **HYPER)


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [tuple(i) for i in out]


def exposed_ms(kernels: list[tuple[str, float, float]]) -> float:
    """Time (ms) covered by communication kernels (names with 'nccl') and by no other kernel;
    ``kernels``: (name, start_us, end_us)."""
    comm = _merged([(s, e) for n, s, e in kernels if "nccl" in n.lower()])
    compute = _merged([(s, e) for n, s, e in kernels if "nccl" not in n.lower()])
    exposed = 0.0
    for start, end in comm:
        covered = sum(max(0.0, min(end, ce) - max(start, cs)) for cs, ce in compute)
        exposed += (end - start) - covered
    return exposed / 1e3


def measure(config: str, args, model_config: ModelConfig, device: torch.device, world: int, rank: int) -> dict:
    module, opt = build(config, model_config, device, world)
    gen = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randint(0, model_config.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)

    def iteration() -> None:
        logits = module(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        iteration()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    iters, steps = [], []
    for _ in range(args.iters):
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        logits = module(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
        mid.record()
        opt.step()
        end.record()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        iters.append(start.elapsed_time(end))
        steps.append(mid.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        iteration()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]  # fmt: skip
    state = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
                for s in opt.state.values() for t in s.values() if torch.is_tensor(t))  # fmt: skip
    return dict(config=config, world=world, iter_ms=statistics.median(iters), step_ms=statistics.median(steps),
                exposed_comm_ms=exposed_ms(kernels), peak_gib=peak, state_gib=state / 2**30)  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rank, world, device, launcher = _init()
    model_config = ModelConfig(vocab_size=32000, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                               n_kv_heads=max(1, args.dim // 256), ffn_dim=args.dim * 8 // 3 // 64 * 64,
                               max_seq_len=args.seq)  # fmt: skip
    rows = []
    for config in args.configs.split(","):
        rows.append(measure(config, args, model_config, device, world, rank))
        torch.cuda.empty_cache()  # the next configuration's peak starts from its own model
    if rank == 0:
        params = sum(p.numel() for p in TinyLlama(model_config).parameters()) / 1e6
        lines = [f"{params:.0f}M parameters (bf16), batch {args.batch} x {args.seq} tokens per rank, "
                 f"{world} rank(s), {torch.cuda.get_device_name(device)}", "",
                 "| config | iter ms | step ms | exposed comm ms | peak GiB/rank | state GiB/rank |",
                 "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in rows:
            lines.append(f"| {r['config']} | {r['iter_ms']:.2f} | {r['step_ms']:.2f} | {r['exposed_comm_ms']:.2f} | "
                         f"{r['peak_gib']:.2f} | {r['state_gib']:.3f} |")  # fmt: skip
        command = f"{launcher.format(world=world)} benchmarks/bench_dist.py {' '.join(argv or sys.argv[1:])}"
        lines += ["", f"Command: {command.strip()}"]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"bench_dist_w{world}.md").write_text("\n".join(lines) + "\n")
        with (args.out / f"bench_dist_w{world}.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print("\n".join(lines))
    with contextlib.suppress(Exception):
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
