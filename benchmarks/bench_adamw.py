"""AdamW step time against torch's foreach and fused AdamW, and against the HBM floor.

    python benchmarks/bench_adamw.py [--shapes single_4096x1024,llama134m] [--dtypes fp32,bf16]

Floor = bytes the step must move / copy bandwidth measured in the same run on a 4 GiB
copy. Bytes per parameter: read p, g, m, v and write p, m, v (fp32: 28 B; bf16 with bf16
state: 14 B; bf16 with fp32 state: 22 B). The `copy` row copies the same number of bytes
(half read, half written) with torch: the practical ceiling at that size, where launch and
ramp-up cost shows. Times are do_bench medians with L2 flushed before each call, twice: the
eager `opt.step()` (on small workloads this includes the host's time to issue the step) and
the replay of a CUDA graph of one step (device time alone; torch's optimizers are built with
capturable=True for this). Ratios use the graph times. Writes benchmarks/results/adamw.{csv,md}.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

from kernel_factory.generator.timing import copy_bandwidth_tbs, time_ms
from kernel_factory.optimizers import AdamW
from kernel_factory.optimizers.workloads import SHAPE_SETS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RESULTS = Path(__file__).resolve().parent / "results"
HYPER = dict(lr=1e-3, weight_decay=0.01)


def make_params(shapes, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", dtype=dtype, generator=gen) * 0.02 for _, s in shapes]
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.randn(p.shape, device="cuda", dtype=dtype, generator=gen)
    return params


def contenders(dtype):
    """(name, optimizer factory, state bytes per element) for each optimizer in the race."""
    rows = [
        ("kernel_factory", lambda ps: AdamW(ps, **HYPER), dtype.itemsize),
        ("torch_fused", lambda ps: torch.optim.AdamW(ps, fused=True, capturable=True, **HYPER), dtype.itemsize),
        ("torch_foreach", lambda ps: torch.optim.AdamW(ps, foreach=True, capturable=True, **HYPER), dtype.itemsize),
    ]
    if dtype != torch.float32:
        rows.insert(1, ("kernel_factory_fp32_state", lambda ps: AdamW(ps, state_dtype="fp32", **HYPER), 4))
    return rows


def time_graph(step) -> float:
    """p50 of replaying a CUDA graph of one ``step()`` (captured after a warm-up step)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return time_ms(graph.replay)[1]


def time_copy(nbytes: int) -> float:
    src = torch.empty(nbytes // 2 // 4, device="cuda").uniform_()
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src))[1]


def bench(shape_sets, dtypes, rep_ms):
    bw = copy_bandwidth_tbs(4 << 30)
    print(f"measured copy bandwidth: {bw:.3f} TB/s (read + write, 4 GiB)")
    rows = []
    for set_name in shape_sets:
        shapes = SHAPE_SETS[set_name]
        numel = sum(torch.Size(s).numel() for _, s in shapes)
        for dname in dtypes:
            dtype = DTYPES[dname]
            measured = []
            for name, make, state_bytes in contenders(dtype):
                params = make_params(shapes, dtype)
                opt = make(params)
                opt.step()  # state init, compile, tables
                torch.cuda.synchronize()
                eager = time_ms(opt.step, rep_ms=rep_ms)[1]
                measured.append((name, 3 * dtype.itemsize + 4 * state_bytes, eager, time_graph(opt.step)))
                del opt, params
                torch.cuda.empty_cache()
            ours_bytes = measured[0][1]
            copy_ms = time_copy(numel * ours_bytes)
            measured.append(("copy (same bytes)", ours_bytes, copy_ms, copy_ms))
            fused = next(m[3] for m in measured if m[0] == "torch_fused")
            foreach = next(m[3] for m in measured if m[0] == "torch_foreach")
            for name, per_param, eager, graph in measured:
                floor_ms = numel * per_param / (bw * 1e12) * 1e3
                rows.append(dict(shapes=set_name, dtype=dname, optimizer=name, numel=numel,
                                 bytes_per_param=per_param, eager_p50_ms=eager, graph_p50_ms=graph,
                                 floor_ms=floor_ms, pct_of_floor=100 * floor_ms / graph,
                                 speedup_vs_fused=fused / graph, speedup_vs_foreach=foreach / graph))  # fmt: skip
    return bw, rows


def write(bw, rows, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "adamw.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    header = ("| shapes | dtype | optimizer | B/param | eager ms | graph ms | floor ms | % of floor | vs fused "
              "| vs foreach |")  # fmt: skip
    lines = [
        f"AdamW step on {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
        f"{bw:.3f} TB/s measured in the same run. Command: `{command}`. torch's optimizers are built "
        "with capturable=True (needed for graph capture; it slows torch foreach). Ratios use graph times.",
        "",
        header,
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shapes']} | {r['dtype']} | {r['optimizer']} | {r['bytes_per_param']} | {r['eager_p50_ms']:.4f} | "
            f"{r['graph_p50_ms']:.4f} | "
            f"{r['floor_ms']:.4f} | {r['pct_of_floor']:.1f} | {r['speedup_vs_fused']:.2f}x | "
            f"{r['speedup_vs_foreach']:.2f}x |"
        )
    (out / "adamw.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="single_4096x1024,llama134m")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rep-ms", type=float, default=500)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_adamw: no CUDA GPU here; nothing to time (interpreter timings mean nothing)")
        return 0
    bw, rows = bench(args.shapes.split(","), args.dtypes.split(","), args.rep_ms)
    extra = " ".join(sys.argv[1:] if argv is None else argv)
    write(bw, rows, args.out, "nox -s bench" + (f" -- {extra}" if extra else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
