"""The benchmark matrix: every registered optimizer's step on single tensors and on the
134M-parameter Llama-style list, against the HBM floor and against each other.

    python -m benchmarks.bench [--optimizers a,b] [--shapes single_4096x1024,llama134m] [--dtypes fp32,bf16]
    (shape sets: small, single_4096x1024 and the models of workloads.MODELS: llama134m, qwen2_5_0_5b,
    llama3_2_1b, llama2_7b_4layers)

Floor = bytes a step must move / copy bandwidth measured in the same run (4 GiB copy). Bytes
per parameter = 2 x param bytes (read, write) + grad bytes + 2 x state bytes per parameter
(read, write), with the state counted from the optimizer's state tensors after one step:
AdamW fp32 gives 28 B, bf16 params with bf16 state 14 B; Adafactor's three passes read g twice
more and p once more (fp32: 24 B). Times are do_bench medians with L2
flushed before each call: `eager` is `opt.step()` as called (on small workloads it includes
the host's time to issue the step), `graph` the replay of a CUDA graph of one step (device
time; for the optimizers that can be captured: ours, and torch's built with capturable=True).
`copy` is a torch copy of the same bytes as our AdamW step: the practical ceiling at that
size. Muon's steps are bound by NS's matrix products: their floor is the symmetric products'
FLOPs of five NS iterations over the list's hidden matrices at the bf16 matmul rate measured in
the same run (``bench_newton_schulz.ns_floor_flops``; the elementwise work and the AdamW part
left out; a note under the table gives the share of that floor a step could reach with those
bytes moved at the copy rate after NS: ``ns_ceiling_notes``). "% of floor" and "ours faster" use
graph times where there are, else eager. Writes benchmarks/results/bench.{csv,md}; then
benchmarks/bench_newton_schulz.py (NS5 and Muon).
``--cold-start`` adds each optimizer's first step in a new process with empty kernel caches
(benchmarks/cold_start.py), on the first shape set and dtype.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

from benchmarks import bench_newton_schulz, cold_start
from benchmarks.registry import OURS, OptimizerSpec, Shape, select, state_bytes
from benchmarks.reporting import nox_command
from kernel_factory.generator.timing import capture_graph, copy_bandwidth_tbs, matmul_tflops, time_ms
from kernel_factory.optimizers import AdamW
from kernel_factory.optimizers.shared import precompile
from kernel_factory.optimizers.shared.workloads import MODELS, SHAPE_SETS, hidden_matrices

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RESULTS = Path(__file__).resolve().parent / "results"
LR, WD = 1e-3, 0.01
# Model dimensions of each shape set, for adam-mini's per-head partition.
SHAPES_OF = {"single_4096x1024": Shape(1024, 8, 8), "small": Shape(8, 1, 1),
             **{name: Shape(c["dim"], c["n_heads"], c.get("n_kv_heads", c["n_heads"])) for name, c in MODELS.items()}}
FP32_STATE = OptimizerSpec(
    "kernel_factory_adamw_fp32_state",
    lambda n, s, lr, wd: AdamW([p for _, p in n], lr=lr, weight_decay=wd, state_dtype="fp32"),
    capturable=True,
)


def named_params(shapes, dtype) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, shape in shapes:
        p = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) * 0.02).requires_grad_(True)
        p.grad = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
        out.append((name, p))
    return out


def time_graph(step) -> float | None:
    """p50 of replaying a CUDA graph of one ``step()``; None if the step cannot be captured."""
    try:
        graph = capture_graph(step)
    except Exception:  # noqa: BLE001 - not capturable: report eager only
        torch.cuda.synchronize()
        return None
    return time_ms(graph.replay)[1]


def time_copy(nbytes: int) -> float:
    src = torch.empty(nbytes // 2 // 4, device="cuda").uniform_()
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src))[1]


# steps before timing (state init, compilation): a peer's first steps in a fresh process can be far
# slower than its later ones (turboadam 0.2.0 on the H200: 260-330 ms against 8-10 ms)
WARM_STEPS = 5


def measure(spec, shapes_name, dtype, rep_ms) -> dict:
    named = named_params(SHAPE_SETS[shapes_name], dtype)
    numel = sum(p.numel() for _, p in named)
    opt = spec.build(named, SHAPES_OF[shapes_name], LR, WD)
    for _ in range(WARM_STEPS):
        opt.step()
    torch.cuda.synchronize()
    precompile.settle()  # variants the first steps did not wait for (GradScaler's) compile first
    state = state_bytes(opt) / numel
    eager = time_ms(opt.step, rep_ms=rep_ms)[1]
    graph = time_graph(opt.step) if spec.capturable else None
    del opt, named
    torch.cuda.empty_cache()
    return dict(optimizer=spec.name, numel=numel, state_bytes_per_param=state,
                bytes_per_param=(3 + spec.extra_reads) * dtype.itemsize + 2 * state, eager_ms=eager,
                graph_ms=graph)  # fmt: skip


def ns_floor_ms(shapes_name: str, tflops: float) -> float:
    """Five NS iterations' symmetric products over the hidden matrices of ``shapes_name`` at
    ``tflops`` (ms): a Muon step's floor."""
    flops = sum(bench_newton_schulz.ns_floor_flops(*s) for _, s in hidden_matrices(SHAPE_SETS[shapes_name]))
    return flops / (tflops * 1e12) * 1e3


def bench(specs, shape_sets, dtypes, rep_ms) -> tuple[float, float | None, list[dict]]:
    """(copy TB/s, bf16 matmul TFLOP/s where a Muon step is timed, else None, the rows)."""
    bw = copy_bandwidth_tbs(4 << 30)
    print(f"measured copy bandwidth: {bw:.3f} TB/s (read + write, 4 GiB)")
    ns_floored = {s.name for s in specs if s.ns_floor}
    tflops = matmul_tflops() if ns_floored else None
    if tflops is not None:
        print(f"measured bf16 matmul rate: {tflops:.0f} TFLOP/s (8192^3)")
    rows = []
    for shapes_name in shape_sets:
        for dname in dtypes:
            dtype = DTYPES[dname]
            race = specs + ([FP32_STATE] if dtype != torch.float32 and any(s.name == OURS for s in specs) else [])
            block = [dict(shapes=shapes_name, dtype=dname, **measure(s, shapes_name, dtype, rep_ms)) for s in race]
            ours = next((r for r in block if r["optimizer"] == OURS), None)
            if ours is not None:
                copy_ms = time_copy(int(ours["numel"] * ours["bytes_per_param"]))
                block.append(dict(block[0], optimizer="copy (same bytes as ours)", eager_ms=copy_ms, graph_ms=copy_ms,
                                  state_bytes_per_param=float("nan"), bytes_per_param=ours["bytes_per_param"]))
            for r in block:
                r["ms"] = r["graph_ms"] if r["graph_ms"] is not None else r["eager_ms"]
            # "ours faster" compares with our AdamW, or in a race without it with our first optimizer
            reference = ours or next((r for r in block if r["optimizer"].startswith("kernel_factory_")), None)
            for r in block:
                r["floor_ms"] = (ns_floor_ms(shapes_name, tflops) if r["optimizer"] in ns_floored else
                                 r["numel"] * r["bytes_per_param"] / (bw * 1e12) * 1e3)  # fmt: skip
                r["pct_of_floor"] = 100 * r["floor_ms"] / r["ms"]
                r["ours_faster"] = r["ms"] / reference["ms"] if reference is not None else float("nan")
                print(f"{shapes_name:>17} {dname} {r['optimizer']:<34} {r['ms']:9.4f} ms {r['pct_of_floor']:5.1f}% "
                      f"of floor, state {r['state_bytes_per_param']:.2f} B/param")  # fmt: skip
            rows += block
    return bw, tflops, rows


def ns_ceiling_notes(rows: list[dict], ns_floored: set[str], bw: float) -> list[str]:
    """For each row of an NS-floored optimizer (Muon): the share of its NS floor a step could reach
    with its elementwise bytes (``bytes_per_param`` x ``numel``: momentum, NS input, apply, the
    AdamW part) moved at the copy rate ``bw`` (TB/s) after NS, as its kernels run them: 100 x
    NS floor / (NS floor + bytes / bw). Bytes and products overlapping would raise it."""
    notes = []
    for r in rows:
        if r["optimizer"] in ns_floored:
            bytes_ms = r["numel"] * r["bytes_per_param"] / (bw * 1e12) * 1e3
            notes.append(f"{r['optimizer']}, {r['shapes']} {r['dtype']}: NS floor {r['floor_ms']:.3f} ms + "
                         f"{r['bytes_per_param']:.1f} B/param at the copy rate {bytes_ms:.3f} ms: at most "
                         f"{100 * r['floor_ms'] / (r['floor_ms'] + bytes_ms):.1f}% of the NS floor with the "
                         f"elementwise work after NS ({r['pct_of_floor']:.1f}% measured)")  # fmt: skip
    return notes


def add_cold_start(rows: list[dict], specs, shapes_name: str, dname: str) -> None:
    """Each registered optimizer's first step in a new process with empty kernel caches
    (``cold_start.measure``, seconds), on its row of ``shapes_name`` x ``dname``."""
    for spec in specs:
        first = cold_start.first_step_cold(spec.name, shapes_name, dname)
        for r in rows:
            if (r["shapes"], r["dtype"], r["optimizer"]) == (shapes_name, dname, spec.name):
                r["first_step_cold_s"] = first


def write(bw, rows, notes, out: Path, command: str, tflops: float | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = ["shapes", "dtype", "optimizer", "numel", "state_bytes_per_param", "bytes_per_param", "eager_ms",
              "graph_ms", "ms", "floor_ms", "pct_of_floor", "ours_faster", "first_step_cold_s"]  # fmt: skip
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)
    fmt = lambda v, spec: "n/a" if v is None or v != v else format(v, spec)  # noqa: E731 (NaN != NaN)
    times = lambda v: "n/a" if v != v else f"{v:.2f}x"  # noqa: E731
    rate = "" if tflops is None else f", bf16 matmul {tflops:.0f} TFLOP/s (the Muon rows' floor: NS's FLOPs)"
    lines = [f"Optimizer step on {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
             f"{bw:.3f} TB/s{rate} measured in the same run. Command: `{command}`", "",
             "| shapes | dtype | optimizer | state B/param | moved B/param | eager ms | graph ms | floor ms | "
             "% of floor | ours faster | first step, empty caches (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['shapes']} | {r['dtype']} | {r['optimizer']} | {fmt(r['state_bytes_per_param'], '.2f')} | "
                     f"{r['bytes_per_param']:.1f} | {r['eager_ms']:.4f} | {fmt(r['graph_ms'], '.4f')} | "
                     f"{r['floor_ms']:.4f} | {r['pct_of_floor']:.1f} | {times(r['ours_faster'])} | "
                     f"{fmt(r.get('first_step_cold_s'), '.2f')} |")  # fmt: skip
    lines += [""] + [f"- {n}" for n in notes]
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizers", default=None, help="comma-separated registry names (default: all available)")
    ap.add_argument("--shapes", default="single_4096x1024,llama134m")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rep-ms", type=float, default=300)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--ns-sizes", default="1024,4096,8192",
                    help="NS5 matrices for benchmarks/bench_newton_schulz.py: n, mxn or @model (its hidden "
                         "matrices with both sides >= 2048), comma-separated (empty: skip it)")  # fmt: skip
    ap.add_argument("--cold-start", action="store_true",
                    help="also time each optimizer's first step in a new process with empty kernel caches "
                         "(benchmarks/cold_start.py), on the first shape set and dtype")  # fmt: skip
    args = ap.parse_args(argv)
    unknown = set(args.shapes.split(",")) - set(SHAPES_OF)
    if unknown:
        ap.error(f"unknown shape set(s) {sorted(unknown)}; known: {', '.join(SHAPES_OF)}")
    try:
        ns_shapes = bench_newton_schulz.parse_ns_sizes(args.ns_sizes)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        print("bench: no CUDA GPU here; nothing to time (the interpreter's timings mean nothing)")
        return 0
    specs, notes = select(args.optimizers.split(",") if args.optimizers else None, "cuda")
    for note in notes:
        print(note)
    if specs:
        bw, tflops, rows = bench(specs, args.shapes.split(","), args.dtypes.split(","), args.rep_ms)
        if args.cold_start:
            add_cold_start(rows, specs, args.shapes.split(",")[0], args.dtypes.split(",")[0])
        notes += ns_ceiling_notes(rows, {s.name for s in specs if s.ns_floor}, bw)
        write(bw, rows, notes, args.out, nox_command("bench", argv), tflops)
    if ns_shapes:
        bench_newton_schulz.run(ns_shapes, args.out, nox_command("bench", argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
