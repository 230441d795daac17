"""Train the small Llama-style model with each registered optimizer on the same data, seed and
schedule; record losses, step times, peak memory and optimizer state bytes per parameter.

    python -m benchmarks.convergence [--size cpu|gpu] [--optimizers a,b,...] [--steps N]
        [--lr PEAK] [--seed N] [--data PATH] [--out DIR]

Each optimizer's run is saved as it finishes (<out>/convergence_<tag>/<name>.json, with its
run config); <out>/convergence_<tag>.csv (every step), .md (summary) and .png (loss curves)
are then written from every saved run of the same config and corpus, so a long comparison
can be split over several invocations (``--optimizers``). The tag is the size, plus the peak
learning rate when ``--lr`` changes it from the size's (``gpu_lr0.0012``), plus the seed when
``--seed`` changes it (``cpu_seed1``): runs of an lr sweep, or of another seed, keep tables of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.registry import OURS, REGISTRY, Shape, select, state_bytes
from benchmarks.reporting import nox_command

from .data import DEFAULT_CORPUS, CharCorpus, get_batch
from .model import ModelConfig, TinyLlama

RESULTS = Path(__file__).resolve().parents[1] / "results"


@dataclass(frozen=True)
class RunConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    block_size: int
    batch_size: int
    steps: int
    lr: float
    weight_decay: float = 0.1
    warmup_fraction: float = 0.05
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 0


SIZES = {
    # ~0.3M parameters: a few seconds per optimizer on 2 CPU cores.
    "cpu": RunConfig(dim=96, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=256, block_size=64,
                     batch_size=16, steps=300, lr=3e-3),
    # 41M parameters (25-100M) in bf16 autocast. 1000 steps x 8 x 256 chars is about two passes
    # over tinyshakespeare's 1M-character training split: at 64 x 256 the model overfits
    # (measured: train loss 0.23, validation 2.8), which says nothing about the optimizers.
    "gpu": RunConfig(dim=640, n_layers=9, n_heads=10, n_kv_heads=5, ffn_dim=1728, block_size=256,
                     batch_size=8, steps=1000, lr=6e-4, eval_every=100),
}  # fmt: skip


def lr_factor(step: int, rc: RunConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    warmup = max(1, int(rc.warmup_fraction * rc.steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, rc.steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, data, rc: RunConfig, device: str, autocast) -> float:
    gen = torch.Generator().manual_seed(rc.seed + 1)  # the same validation windows every time
    losses = []
    for _ in range(rc.eval_batches):
        x, y = get_batch(data, rc.batch_size, rc.block_size, gen)
        with autocast():
            logits = model(x.to(device))
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten()).item())
    return sum(losses) / len(losses)


def train_one(spec, corpus: CharCorpus, rc: RunConfig, device: str, progress: bool = True) -> dict:
    """Train a fresh model (seeded: same init and batches for every optimizer) with ``spec``."""
    torch.manual_seed(rc.seed)
    mc = ModelConfig(corpus.vocab_size, rc.dim, rc.n_layers, rc.n_heads, rc.n_kv_heads, rc.ffn_dim, rc.block_size)
    model = TinyLlama(mc).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = spec.build(list(model.named_parameters()), Shape(rc.dim, rc.n_heads, rc.n_kv_heads), rc.lr, rc.weight_decay)
    for group in opt.param_groups:
        group["base_lr"] = group["lr"] if not torch.is_tensor(group["lr"]) else float(group["lr"])
    cuda = device == "cuda"
    # bf16 autocast on the GPU (fp32 master weights: what the optimizers update); fp32 on CPU.
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(rc.seed)
    rows, step_ms, opt_ms = [], [], []
    bar = _progress(rc.steps, spec.name) if progress else None
    for step in range(rc.steps):
        factor = lr_factor(step, rc)
        lr = rc.lr * factor
        for group in opt.param_groups:
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(group["base_lr"] * factor)
            else:
                group["lr"] = group["base_lr"] * factor
        x, y = get_batch(corpus.train, rc.batch_size, rc.block_size, gen)
        t0 = _now(cuda)
        with autocast():
            logits = model(x.to(device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
        loss.backward()
        t1 = _now(cuda)
        opt.step()
        t2 = _now(cuda)
        opt.zero_grad(set_to_none=True)
        last = step + 1 == rc.steps
        val = evaluate(model, corpus.val, rc, device, autocast) if (step + 1) % rc.eval_every == 0 or last else None
        train_loss = loss.item()
        step_ms.append(t2 - t0)
        opt_ms.append(t2 - t1)
        rows.append(dict(optimizer=spec.name, step=step + 1, train_loss=train_loss, val_loss=val, lr=lr))
        if bar is not None:
            bar.set_postfix(loss=f"{train_loss:.3f}", refresh=False)
            bar.update()
    if bar is not None:
        bar.close()
    skip = min(10, rc.steps // 10)  # compile and allocation steps are not the steady state
    return dict(
        optimizer=spec.name, params=n_params, rows=rows,
        final_train=statistics.mean(r["train_loss"] for r in rows[-rc.eval_every:]),
        final_val=next(r["val_loss"] for r in reversed(rows) if r["val_loss"] is not None),
        step_ms=statistics.median(step_ms[skip:]), opt_ms=statistics.median(opt_ms[skip:]),
        peak_mb=torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan"),
        state_bytes_per_param=state_bytes(opt) / n_params,
    )  # fmt: skip


def _now(cuda: bool) -> float:
    """Milliseconds, after the device finished what was queued (so the split is real)."""
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() * 1e3


def _progress(total: int, name: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"{name:<22}", leave=False, mininterval=1.0, file=sys.stderr)


def loss_agreement(results: list[dict], a: str, b: str) -> float:
    """Largest relative difference between two optimizers' train losses over all steps."""
    la = {r["step"]: r["train_loss"] for x in results if x["optimizer"] == a for r in x["rows"]}
    lb = {r["step"]: r["train_loss"] for x in results if x["optimizer"] == b for r in x["rows"]}
    return max(abs(la[s] - lb[s]) / abs(lb[s]) for s in la)


def write_results(results: list[dict], notes: list[str], out: Path, tag: str, header: str, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"convergence_{tag}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["optimizer", "step", "train_loss", "val_loss", "lr"])
        w.writeheader()
        for r in results:
            w.writerows(r["rows"])
    lines = [header, "", "| optimizer | final train loss | final val loss | step ms | optimizer step ms | "
             "peak MiB | state B/param |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        lines.append(f"| {r['optimizer']} | {r['final_train']:.4f} | {r['final_val']:.4f} | {r['step_ms']:.2f} | "
                     f"{r['opt_ms']:.3f} | {r['peak_mb']:.0f} | {r['state_bytes_per_param']:.2f} |")  # fmt: skip
    lines += [""] + [f"- {n}" for n in notes]
    (out / f"convergence_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(results, out / f"convergence_{tag}.png", title)


def _plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = ["-", "--", ":", "-."]  # curves that coincide (ours and torch's AdamW) stay visible
    for i, r in enumerate(results):
        style = dict(ls=styles[i % len(styles)], label=r["optimizer"], lw=1.4)
        steps = [x["step"] for x in r["rows"]]
        loss = torch.tensor([x["train_loss"] for x in r["rows"]])
        window = max(1, len(loss) // 50)  # moving average for readability
        smooth = torch.nn.functional.avg_pool1d(loss[None, None], window, 1).flatten()
        ax_t.plot(steps[window - 1 :], smooth.tolist(), **style)
        vals = [(x["step"], x["val_loss"]) for x in r["rows"] if x["val_loss"] is not None]
        ax_v.plot(*zip(*vals, strict=True), marker="o", ms=3, **style)
    for ax, name in ((ax_t, "train loss (moving average)"), (ax_v, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    ax_v.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_run(result: dict, rc: RunConfig, corpus_name: str, out: Path, tag: str, command: str) -> None:
    """Keep one optimizer's finished run, with the command that made it (the table may merge
    runs from several invocations)."""
    runs = out / f"convergence_{tag}"
    runs.mkdir(parents=True, exist_ok=True)
    record = dict(result, run_config=asdict(rc), corpus=corpus_name, command=command)
    (runs / f"{result['optimizer']}.json").write_text(json.dumps(record) + "\n")


def load_runs(rc: RunConfig, corpus_name: str, out: Path, tag: str, order: list[str]) -> list[dict]:
    """Every saved run made with this exact run config and corpus, in registry order."""
    runs = []
    for path in sorted((out / f"convergence_{tag}").glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("run_config") == asdict(rc) and record.get("corpus") == corpus_name:
            runs.append(record)
    return sorted(runs, key=lambda r: order.index(r["optimizer"]) if r["optimizer"] in order else len(order))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: gpu with CUDA, else cpu")
    ap.add_argument("--optimizers", default=None, help="comma-separated registry names (default: all available)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the size's)")
    ap.add_argument("--seed", type=int, default=None,
                    help="init and batch seed (default: the size's, 0); another seed's runs keep a table of their own")
    ap.add_argument("--data", type=Path, default=DEFAULT_CORPUS, help="any UTF-8 text file")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = args.size or ("gpu" if device == "cuda" else "cpu")
    rc = SIZES[size] if args.steps is None else replace(SIZES[size], steps=args.steps)
    if args.lr is not None and args.lr <= 0:
        ap.error(f"--lr must be positive, got {args.lr}")
    tag = size if args.lr in (None, rc.lr) else f"{size}_lr{args.lr:g}"
    tag += "" if args.seed in (None, rc.seed) else f"_seed{args.seed}"
    rc = rc if args.lr is None else replace(rc, lr=args.lr)
    rc = rc if args.seed is None else replace(rc, seed=args.seed)
    specs, notes = select(args.optimizers.split(",") if args.optimizers else None, device)
    for note in notes:
        print(note)
    corpus = CharCorpus.from_file(args.data, rc.block_size)
    for spec in specs:
        t0 = time.perf_counter()
        result = train_one(spec, corpus, rc, device, progress=not args.no_progress)
        save_run(result, rc, args.data.name, args.out, tag, nox_command("convergence", argv))
        print(f"{spec.name}: final val loss {result['final_val']:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    results = load_runs(rc, args.data.name, args.out, tag, list(REGISTRY))
    names = [r["optimizer"] for r in results]
    for peer in ("torch_adamw_fused", "torch_adamw_foreach"):
        if OURS in names and peer in names:
            notes.append(f"{OURS} vs {peer}: largest relative train-loss difference over all steps "
                         f"{loss_agreement(results, OURS, peer):.2e}")  # fmt: skip
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    commands = list(dict.fromkeys(r.get("command", "(not recorded)") for r in results))
    header = (f"Convergence ({size} size, {results[0]['params'] / 1e6:.2f}M parameters, {rc.steps} steps, "
              f"batch {rc.batch_size}x{rc.block_size} chars of {args.data.name}, 90/10 split, seed {rc.seed}, "
              f"peak lr {rc.lr}, warm-up + cosine) on {where}, torch {torch.__version__}. "
              f"Commands: {'; '.join(f'`{c}`' for c in commands)}")  # fmt: skip
    title = (f"{results[0]['params'] / 1e6:.1f}M-parameter char model, {rc.steps} steps on {args.data.name} "
             f"({where})")  # fmt: skip
    write_results(results, notes, args.out, tag, header, title)
    return 0
