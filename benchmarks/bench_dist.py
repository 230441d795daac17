"""The distributed layer's cost per training iteration, per rank: step time, exposed communication
and peak memory, for FSDP2 + each of our optimizers (AdamW, AdamMini with FP8 momentum, Muon,
TurboAdam, Adafactor), FSDP2 + torch's fused AdamW, FSDP2 + torch.optim.Muon (DTensor ops),
FSDP2 + our Muon with every rank gathering and orthogonalizing every matrix (``muon_gather``, the
baseline of the owner scheme), our ZeRO-2 DistributedAdamW (``zero2_ours``: gathers in the step;
``zero2_overlap``: its parameters' all-gathers left to the next forward, FSDP2's units, the layers
then the model; ``zero2_units``: the same, each module of the forward its own unit, the
embedding, the layers, the norm, the head) and DDP + torch's fused AdamW, on a
Llama-shaped model (benchmarks/convergence/model.py); each of our optimizers on
the unwrapped model (``1gpu+...``: the whole model on every rank, no communication); and, for the
per-rank step against one GPU, each of our optimizers stepping plain tensors shaped as this rank's
FSDP2 shards (``shard+...``: no communication, the step alone; Muon: the whole hidden matrices
this rank owns, matrix j of a same-shape batch on rank j mod N, and the shards of the rest).

    torchrun --nproc_per_node 8 benchmarks/bench_dist.py        # NCCL, one GPU per rank
    python benchmarks/bench_dist.py                              # one rank (correct, not telling)

Per configuration: ``iter_ms`` (forward + backward + step, median of the timed iterations; none
for ``shard+``),
``step_ms`` (``opt.step()`` alone, with its all-gather for ZeRO-2), ``exposed_comm_ms`` (time the
GPU spent in communication kernels while no compute kernel ran, from the profiler's kernel
intervals of ``--windows`` windows of ``--profiled`` back-to-back iterations and one more forward,
cut into iterations at marker kernels: the median over the iterations of the ranks' mean; by
collective in a section below the table),
``peak_gib`` (``max_memory_allocated`` over the timed iterations) and
``state_gib`` (this rank's optimizer state). At one rank the collectives are copies: the figures
show the layer's overhead, not its scaling; the multi-GPU figures need several GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import os
import socket
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from benchmarks.convergence.model import ModelConfig, TinyLlama  # noqa: E402
from kernel_factory.optimizers import Adafactor, AdamMini, AdamW, DistributedAdamW, Muon, TurboAdam  # noqa: E402
from kernel_factory.optimizers.muon.distributed import ShardedMuonBatch, ShardedMuonGroupPlan  # noqa: E402
from kernel_factory.optimizers.muon.optimizer import uses_muon  # noqa: E402
from kernel_factory.optimizers.shared import precompile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "bench_dist"
OURS = ("ours", "adam_mini", "muon", "turbo_adam", "adafactor")  # "ours": our AdamW
CONFIGS = (*(f"fsdp2+{o}" for o in OURS), "fsdp2+torch_fused", "fsdp2+torch_muon", "fsdp2+muon_gather",
           "zero2_ours", "zero2_overlap", "zero2_units", "ddp+torch_fused",
           *(f"1gpu+{o}" for o in OURS), *(f"shard+{o}" for o in OURS))  # fmt: skip
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


def our_optimizer(name: str, named: list[tuple[str, torch.Tensor]], c: ModelConfig) -> torch.optim.Optimizer:
    """Our optimizer ``name`` (one of OURS) over ``named`` parameters of a model of config ``c``."""
    params = [p for _, p in named]
    if name == "ours":
        return AdamW(params, **HYPER)
    if name == "adam_mini":
        return AdamMini(named, dim=c.dim, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, **HYPER)
    if name == "muon":
        return Muon(named, lr=0.02, weight_decay=0.1, adamw_lr=HYPER["lr"])
    if name == "turbo_adam":
        return TurboAdam(params, **HYPER)
    return Adafactor(params, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"])


class TorchMuon(torch.optim.Optimizer):
    """torch.optim.Muon on the hidden matrices (ours' split, ``uses_muon``) and torch's fused AdamW
    on the rest, stepped together: the peer of our Muon under FSDP2 (DTensor ops, no owner)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        hidden = [p for n, p in named if uses_muon(n, p)]
        self.parts = [
            torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1),
            torch.optim.AdamW([p for n, p in named if not uses_muon(n, p)], fused=True, **HYPER),
        ]
        super().__init__([p for _, p in named], {})

    def step(self, closure=None):
        for part in self.parts:
            part.step()
        if not self.state:  # the parts make their states at their first step; the same dicts after
            self.state = {p: s for part in self.parts for p, s in part.state.items()}


def shard_params(model: torch.nn.Module, name: str, world: int, rank: int) -> list[tuple[str, torch.Tensor]]:
    """Plain parameters (with random gradients) shaped as this rank's FSDP2 shards of ``model``'s
    (``torch.chunk`` on dim 0; a tail rank's may be empty); for Muon (``name``), the hidden matrices
    this rank owns whole (matrix j of a same-shape batch on rank j mod world) in place of shards."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(rank)
    out, batch_index = [], {}
    for n, p in model.named_parameters():
        if name == "muon" and uses_muon(n, p):
            j = batch_index[tuple(p.shape)] = batch_index.get(tuple(p.shape), -1) + 1
            if j % world != rank:
                continue
            shape = tuple(p.shape)
        else:
            chunks = torch.chunk(torch.empty(p.shape[0], device="meta"), world)
            shape = (chunks[rank].shape[0] if rank < len(chunks) else 0, *p.shape[1:])
        t = torch.nn.Parameter((torch.randn(shape, generator=gen, device=device) * 0.02).to(p.dtype))
        t.grad = torch.randn(shape, generator=gen, device=device).to(p.dtype)
        out.append((n, t))
    return out


def whole_head_names(named: list[tuple[str, torch.Tensor]], c: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """``named`` with each Q or K shard that cuts a head (rows not a multiple of head_dim) named as V,
    whose AdamMini blocks are rows: one process has no partial heads (FSDP2's AdamMini sums a cut
    head's squares across ranks), and per-row blocks move the same bytes. Other names unchanged."""
    head_dim = c.dim // c.n_heads
    cut = lambda n, t: t.shape[0] % head_dim and any(k in n for k in ("q_proj", "k_proj"))  # noqa: E731
    return [(n.replace("q_proj", "v_proj").replace("k_proj", "v_proj") if cut(n, t) else n, t) for n, t in named]


def build(config: str, model_config: ModelConfig, device: torch.device, world: int, rank: int = 0):
    """(module to call, optimizer) for ``config``, with bf16 parameters and fp32 optimizer math; for
    ``shard+...`` the module is None and the optimizer's params hold their gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: a billion parameters take seconds on the host
        model = TinyLlama(model_config).to(dtype=torch.bfloat16)
    wrap, _, name = config.partition("+")
    if wrap == "1gpu":
        return model, our_optimizer(name, list(model.named_parameters()), model_config)
    if wrap == "shard":
        return None, our_optimizer(name, whole_head_names(shard_params(model, name, world, rank), model_config),
                                   model_config)  # fmt: skip
    if wrap == "fsdp2":
        mesh = init_device_mesh(device.type, (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # muon_gather: our Muon with every rank gathering and orthogonalizing every matrix
        ShardedMuonGroupPlan.owner_scheme = name != "muon_gather"
        if name in OURS or name == "muon_gather":
            return model, our_optimizer(name.removesuffix("_gather"), list(model.named_parameters()), model_config)
        if name == "torch_muon":
            return model, TorchMuon(list(model.named_parameters()))
        return model, torch.optim.AdamW(model.parameters(), fused=True, **HYPER)
    if config == "zero2_ours":
        return model, DistributedAdamW(model.parameters(), **HYPER)
    if config == "zero2_overlap":  # the parameters' all-gathers finished by the next forward, layer by layer
        return model, DistributedAdamW(model.parameters(), gather_in_forward=[*model.layers, model], **HYPER)
    if config == "zero2_units":  # the same, each module of the forward's order its own unit: the first
        # layer waits for the embedding's gather only, not the output head's too (as under the model's)
        units = [model.embed_tokens, *model.layers, model.norm, model.lm_head]
        return model, DistributedAdamW(model.parameters(), gather_in_forward=units, **HYPER)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return ddp, torch.optim.AdamW(model.parameters(), fused=True, **HYPER)


COLLECTIVES = ("ReduceScatter", "AllGather", "AllReduce", "AllToAll", "SendRecv", "Broadcast", "Reduce")
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: one before each iteration of a profiled window


def collective(name: str) -> str | None:
    """The collective a kernel runs (``COLLECTIVES``, or "other" for an NCCL kernel of no known
    kind), None for a compute kernel (no 'nccl' in its name)."""
    if "nccl" not in name.lower():
        return None
    return next((c for c in COLLECTIVES if c.lower() in name.lower()), "other")


def exposed_pieces(kernels: list[tuple[str, float, float]]) -> list[tuple[float, float, str]]:
    """(start_us, end_us, collective) of the time covered by communication kernels and by no
    compute kernel, in time order; a piece where several collectives run is the earliest-started
    one's. ``kernels``: (name, start_us, end_us). One sweep over the kernels' edges."""
    edges = []
    for n, s, e in kernels:
        if e > s:
            edges += [(s, 1, n, e), (e, -1, n, s)]
    edges.sort(key=lambda x: (x[0], x[1]))  # ends before starts at one instant
    pieces, compute, comm = [], 0, {}  # comm: (start, name) of the running collective kernels -> count
    last = None
    for t, sign, name, other in edges:
        if last is not None and t > last and compute == 0 and comm:
            first = min(comm)[1]
            if pieces and pieces[-1][1] == last and pieces[-1][2] == collective(first):
                pieces[-1] = (pieces[-1][0], t, pieces[-1][2])
            else:
                pieces.append((last, t, collective(first)))
        last = t
        if collective(name) is None:
            compute += sign
        else:
            key = (t if sign > 0 else other, name)
            comm[key] = comm.get(key, 0) + sign
            if not comm[key]:
                del comm[key]
    return pieces


def exposed_ms(kernels: list[tuple[str, float, float]]) -> float:
    """Time (ms) covered by communication kernels (names with 'nccl') and by no other kernel;
    ``kernels``: (name, start_us, end_us)."""
    return sum(e - s for s, e, _ in exposed_pieces(kernels)) / 1e3


def exposed_per_iteration(kernels: list[tuple[str, float, float]]) -> list[dict[str, float]]:
    """Exposed communication (ms) by collective in each whole iteration of a profiled window: the
    spans between consecutive markers (``MARKER`` kernels, one launched before each iteration and
    one before the closing forward), the first span dropped. Its forward found no gathers of an
    earlier step in flight (the window starts synchronized); every later span holds one forward
    waiting for the previous step's gathers, one backward and one step. Exposed pieces that cross
    a marker are cut there."""
    marks = sorted(s for n, s, _ in kernels if MARKER in n)
    pieces = exposed_pieces([k for k in kernels if MARKER not in k[0]])
    out = []
    for lo, hi in zip(marks[1:], marks[2:], strict=False):
        by_kind: dict[str, float] = {}
        for s, e, kind in pieces:
            cut = min(e, hi) - max(s, lo)
            if cut > 0:
                by_kind[kind] = by_kind.get(kind, 0.0) + cut / 1e3
        out.append(by_kind)
    return out


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for s in opt.state.values() for t in s.values() if torch.is_tensor(t))  # fmt: skip


def measure_step(config: str, args, opt: torch.optim.Optimizer, device: torch.device, world: int) -> dict:
    """``opt.step()`` alone on gradients that stay in place (``shard+...``): no communication."""
    for _ in range(args.warmup):
        opt.step()
    torch.cuda.synchronize()
    precompile.settle()  # compiles the warm-up steps did not wait for end before the timed ones
    torch.cuda.reset_peak_memory_stats(device)
    steps = []
    for _ in range(args.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        steps.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    return dict(config=config, world=world, iter_ms=float("nan"), step_ms=statistics.median(steps),
                exposed_comm_ms=0.0, peak_gib=peak, state_gib=_state_bytes(opt) / 2**30)  # fmt: skip


def measure(config: str, args, model_config: ModelConfig, device: torch.device, world: int, rank: int) -> dict:
    module, opt = build(config, model_config, device, world, rank)
    if module is None:
        return measure_step(config, args, opt, device, world)
    gen = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randint(0, model_config.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device)

    def iteration() -> None:
        logits = module(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def forward() -> None:
        with torch.no_grad():
            module(x[:, :-1])

    for _ in range(args.warmup):
        iteration()
    torch.cuda.synchronize()
    precompile.settle()
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
    exposed, by_kind = profiled_exposed_ms(iteration, forward, args.profiled, args.windows)
    return dict(config=config, world=world, iter_ms=statistics.median(iters), step_ms=statistics.median(steps),
                exposed_comm_ms=exposed, peak_gib=peak,
                state_gib=_state_bytes(opt) / 2**30, exposed_by=by_kind)  # fmt: skip


def profiled_exposed_ms(iteration, forward, count: int, windows: int = 3) -> tuple[float, dict[str, float]]:
    """(median, by collective): the median over the whole iterations of ``windows`` profiled
    windows (``window_exposed``: ``count - 1`` each) of the ranks' mean exposed communication,
    and its mean per iteration over ranks and iterations by collective (ms).

    One window of one rank swung by several times between runs of the same configuration (DDP
    0.6 to 9.3 ms an iteration on the 1072M slice), and a window's mean still carries one stall: a
    rank's wait inside a collective for the slowest peer counts as exposed, and host jitter moves
    those waits from iteration to iteration and rank to rank. The mean over ranks weighs every
    rank's view of an iteration (the collectives line the ranks' iterations up); the median over
    iterations drops the ones that caught a stall."""
    mine = [it for _ in range(windows) for it in window_exposed(iteration, forward, count)]
    per_rank = gathered(mine)
    totals = [[sum(it.values()) for it in rank] for rank in per_rank]
    kinds = sorted({k for rank in per_rank for it in rank for k in it})
    samples = sum(len(rank) for rank in per_rank)
    by_kind = {k: sum(it.get(k, 0.0) for rank in per_rank for it in rank) / samples for k in kinds}
    return median_of_rank_means(totals), by_kind


def gathered(values: list[float]) -> list[list[float]]:
    """``values`` of every rank (rank-major), by an all-gather; just ``[values]`` without a group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [values]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, values)
    return out


def median_of_rank_means(per_rank: list[list[float]]) -> float:
    """``per_rank[r][i]``: rank r's figure of iteration i; the median over iterations of the ranks' mean."""
    means = [sum(column) / len(column) for column in zip(*per_rank, strict=True)]
    return statistics.median(means)


def window_exposed(iteration, forward, count: int) -> list[dict[str, float]]:
    """``exposed_per_iteration`` over one profiled window of ``count`` back-to-back iterations
    closed by one more ``forward`` (no backward), the ranks lined up inside the profiler first:
    ``count - 1`` whole iterations.

    The closing forward is where a training loop's next forward would be: ZeRO-2 with
    ``gather_in_forward`` leaves each step's all-gathers to it. An iteration's span runs from the
    marker before its forward to the next one, so it holds the wait for the previous step's
    gathers and the tail of its own step's, one step's worth.

    Starting the profiler can take each rank a different time (CUPTI's setup, the longest in a
    process's first window), so a barrier before it does not line the ranks up: the window's first
    collective would count the wait for the slowest peer. A marker all-reduce and a synchronize
    inside the window line them up, and only the kernels after it are counted (``after_marker``).
    Without the iteration markers in the trace (none found where ``count + 1`` were launched)
    the window counts as one iteration of its mean."""
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dist.all_reduce(torch.zeros(1, device=torch.cuda.current_device()))
        torch.cuda.synchronize()
        for _ in range(count):
            torch.cuda._sleep(1)
            iteration()
        torch.cuda._sleep(1)
        forward()
        torch.cuda.synchronize()
    kernels = after_marker([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                            if e.device_type == torch.autograd.DeviceType.CUDA])  # fmt: skip
    if sum(MARKER in n for n, _, _ in kernels) != count + 1:
        print(f"bench_dist: {count + 1} iteration markers expected in the trace; the window's mean instead")
        return [{"all": exposed_ms(kernels) / count}]
    return exposed_per_iteration(kernels)


def after_marker(kernels: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """The kernels that start after the first communication kernel (the window's marker all-reduce)
    has ended; all of them where there is none (one rank: NCCL may launch nothing)."""
    marks = [e for n, s, e in sorted(kernels, key=lambda k: k[1]) if "nccl" in n.lower()]
    return kernels if not marks else [k for k in kernels if k[1] >= marks[0]]


def write_tables(
    args, model_config: ModelConfig, world: int, device: torch.device, rows: list[dict], failed: list[str], command: str
) -> None:
    """``bench_dist_w{world}.md`` and ``.csv`` under ``args.out``: the measured rows, then the
    configurations that failed (rank 0's errors) and the command."""
    with torch.device("meta"):
        params = sum(p.numel() for p in TinyLlama(model_config).parameters()) / 1e6
    lines = [f"{params:.0f}M parameters (bf16), batch {args.batch} x {args.seq} tokens per rank, "
             f"{world} rank(s), {torch.cuda.get_device_name(device)}", "",
             "| config | iter ms | step ms | exposed comm ms | peak GiB/rank | state GiB/rank |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        iter_ms = "n/a" if r["iter_ms"] != r["iter_ms"] else f"{r['iter_ms']:.2f}"  # NaN: the step alone
        lines.append(f"| {r['config']} | {iter_ms} | {r['step_ms']:.2f} | {r['exposed_comm_ms']:.2f} | "
                     f"{r['peak_gib']:.2f} | {r['state_gib']:.3f} |")  # fmt: skip
    split = [r for r in rows if r.get("exposed_by")]
    if split:
        lines += ["", "Exposed communication by collective, ms an iteration (mean over ranks and iterations):", ""]
        lines += [f"- {r['config']}: {_kinds(r['exposed_by'])}" for r in split]
    if failed:
        lines += ["", "Failed (rank 0's errors):", *(f"- {f}" for f in failed)]
    lines += ["", f"Command: {command}"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"bench_dist_w{world}.md").write_text("\n".join(lines) + "\n")
    with (args.out / f"bench_dist_w{world}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["config", "world", "iter_ms", "step_ms", "exposed_comm_ms",
                                               "peak_gib", "state_gib", "exposed_by"])  # fmt: skip
        writer.writeheader()
        writer.writerows({**r, "exposed_by": _kinds(r.get("exposed_by", {}))} for r in rows)


def _kinds(by_kind: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in by_kind.items()) or "none"


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model's and batch's arguments (the 123M model by default)."""
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=None, help="default dim / 64")
    ap.add_argument("--kv-heads", type=int, default=None, help="default max(1, dim / 256)")
    ap.add_argument("--ffn", type=int, default=None, help="default 8/3 dim, a multiple of 64 (Llama-2-7B: 11008)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)


# sharded Muon's on/off switches: (flag after --muon-, the class that holds it, help); the
# attribute is the flag with underscores
MUON_SWITCHES = (
    ("pair-stages", ShardedMuonGroupPlan, "cut sharded Muon's stages in pairs of batches (distributed.paired_stages)"),
    ("light-last", ShardedMuonGroupPlan, "with --muon-pair-stages: of the fewest-launch cuts, the lightest last stage"),
    ("coalesce", ShardedMuonGroupPlan, "a stage's all-to-alls each way as one NCCL group (ShardedMuonGroupPlan)"),
    ("owner-kernels", ShardedMuonBatch, "the owner's pieces and norms by the kernels (muon/owner_pieces.py)"),
    ("peer-copies", ShardedMuonBatch, "the exchanges as copies into the peers' symmetric buffers (peer_copies.py)"),
    ("direct-replies", ShardedMuonBatch, "with the peer copies: O's rows to the ranks straight from NS's output"),
    ("direct-pieces", ShardedMuonBatch, "with the peer copies: the pieces straight into the owner's matrices"),
)


def add_muon_stages_arg(ap: argparse.ArgumentParser) -> None:
    """``--muon-stages`` and the ``MUON_SWITCHES`` as ``--muon-<flag>`` / ``--no-muon-<flag>``
    (``use_muon_stages`` applies them)."""
    ap.add_argument("--muon-stages", type=int, default=ShardedMuonGroupPlan.stages,
                    help="sharded Muon's NS runs whose all-to-alls overlap each other's NS (1: none)")  # fmt: skip
    for flag, owner, text in MUON_SWITCHES:
        ap.add_argument(f"--muon-{flag}", action=argparse.BooleanOptionalAction,
                        default=getattr(owner, flag.replace("-", "_")), help=text)  # fmt: skip


def use_muon_stages(ap: argparse.ArgumentParser, args) -> None:
    """Sharded Muon's stages and switches from ``add_muon_stages_arg``'s options."""
    if args.muon_stages < 1:
        ap.error("--muon-stages must be at least 1")
    ShardedMuonGroupPlan.stages = args.muon_stages
    for flag, owner, _ in MUON_SWITCHES:
        name = flag.replace("-", "_")
        setattr(owner, name, getattr(args, f"muon_{name}"))


def model_config_of(args) -> ModelConfig:
    """The Llama-shaped model ``add_model_args``' arguments describe (vocabulary 32000)."""
    heads = args.heads or args.dim // 64
    return ModelConfig(vocab_size=32000, dim=args.dim, n_layers=args.layers, n_heads=heads,
                       n_kv_heads=args.kv_heads or max(1, args.dim // 256),
                       ffn_dim=args.ffn or args.dim * 8 // 3 // 64 * 64, max_seq_len=args.seq)  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profiled", type=int, default=5,
                    help="iterations in each profiled window of exposed_comm_ms (the first of each not counted)")
    ap.add_argument("--windows", type=int, default=3,
                    help="profiled windows (exposed_comm_ms: the median of their iterations)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    add_muon_stages_arg(ap)
    ap.add_argument("--zero2-step", choices=("pipelined", "single"), default="pipelined",
                    help="DistributedAdamW's step: the first-gathered bucket stepped between the halves of the "
                         "rest, or one launch after every reduce-scatter")  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    use_muon_stages(ap, args)
    if args.profiled < 2 or args.windows < 1:
        ap.error("--profiled must be at least 2 (a window's first iteration is not counted) and --windows at least 1")
    DistributedAdamW.pipelined_step = args.zero2_step == "pipelined"
    rank, world, device, launcher = _init()
    model_config = model_config_of(args)
    rows, failed = [], []
    for config in args.configs.split(","):
        try:
            rows.append(measure(config, args, model_config, device, world, rank))
        except Exception as e:  # noqa: BLE001 - reported in the table; the other configurations still run
            traceback.print_exc()
            failed.append(f"{config}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        # the next configuration starts from its own model: the last one's (held in reference
        # cycles by hooks) freed, not left to slow the allocator and raise the peaks after it
        gc.collect()
        torch.cuda.empty_cache()
        if rank == 0:  # after each configuration: a run cut short keeps what it measured
            command = f"{launcher.format(world=world)} benchmarks/bench_dist.py {' '.join(argv or sys.argv[1:])}"
            write_tables(args, model_config, world, device, rows, failed, command.strip())
    if rank == 0:
        print((args.out / f"bench_dist_w{world}.md").read_text())
    with contextlib.suppress(Exception):
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
