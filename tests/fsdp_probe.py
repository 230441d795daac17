"""The FSDP2 probe of the distributed tests: a model whose gradients are exact at any world size,
its steps under ``fully_shard`` and in one process, and their comparison (run on each rank).

The probe model's loss is Σ (p · target).sum(), so each parameter's gradient is its rank's
target; targets are means of samples randint(-1024, 1024) / 1024, split over the ranks, so every
sum and mean of them is exact and the averaged gradient is bitwise the same at 1, 2 and 4 ranks.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import use_gpu
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kernel_factory.optimizers import Adafactor, Adam, AdamMini, AdamW, Muon, TurboAdam
from kernel_factory.optimizers.parity import compare_tensors
from kernel_factory.optimizers.shared.dtensor import cut_locally, local, local_part

# Rows split unevenly; (1, 7) and (2, 2, 3) leave empty shards on tail ranks; a tall matrix; 1-D;
# repeated shapes make batches whose matrices have different owner ranks (Muon).
SHAPES = [(5, 3), (1, 7), (16, 4), (9,), (2, 2, 3), (5, 3), (5, 3), (16, 4)]
SAMPLES = 4  # per step, split over the ranks
OPTIMIZERS = {
    "AdamW": lambda params: AdamW(params, lr=1e-2, weight_decay=0.1),
    "Adam-amsgrad": lambda params: Adam(params, lr=1e-2, weight_decay=0.1, amsgrad=True),
}
SHARDED_MUON = lambda params: Muon(params, lr=0.02, weight_decay=0.1, adamw_lr=1e-2)  # noqa: E731
# Every tensor compressed (blocks of 32), so that the probe's small matrices keep codes.
SHARDED_TURBO_ADAM = lambda params: TurboAdam(params, lr=1e-2, weight_decay=0.1, block_size=32,  # noqa: E731
                                              min_m_compress_elements=0, min_v_compress_elements=0)  # fmt: skip
# fp32 statistics (the sharded path keeps them so) and a first moment in fp32
SHARDED_ADAFACTOR = lambda params: Adafactor(params, lr=1e-2, weight_decay=0.1, state_bits=32, beta1=0.9,  # noqa: E731
                                             momentum_dtype="fp32")  # fmt: skip
# int8 first moment: codes and block scales split like a matrix's rows; a vector keeps bf16
SHARDED_ADAFACTOR_INT8 = lambda params: Adafactor(params, lr=1e-2, weight_decay=0.1, state_bits=32,  # noqa: E731
                                                  beta1=0.9, momentum_dtype="int8")  # fmt: skip
# Names that give AdamMini every kind of block on SHAPES: rows, heads of 8 rows (split across ranks
# at 4), a whole (2, 2, 3) tensor and a (1, 7) norm (split or empty), a bias (per element).
ADAM_MINI_NAMES = ["layers.0.mlp.up_proj.weight", "layers.0.post_attention_layernorm.weight",
                   "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.bias", "layers.0.block.extra",
                   "embed_tokens.weight", "layers.0.self_attn.o_proj.weight", "layers.0.self_attn.k_proj.weight"]


def sharded_adam_mini(params, momentum_dtype: str = "fp32"):
    return AdamMini(list(zip(ADAM_MINI_NAMES, params, strict=True)), lr=1e-2, weight_decay=0.1, dim=4, n_heads=2,
                    n_kv_heads=2, head_dim=8, momentum_dtype=momentum_dtype)  # fmt: skip


class Probe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES)

    def forward(self, targets: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * t).sum() for p, t in zip(self.params, targets, strict=True))


def targets(step: int, rank: int, world: int, device: str = "cpu") -> list[torch.Tensor]:
    """Rank ``rank``'s mean of its share of the step's samples, per parameter."""
    gen = torch.Generator().manual_seed(1000 + step)
    samples = [[torch.randint(-1024, 1024, s, generator=gen) / 1024 for s in SHAPES] for _ in range(SAMPLES)]
    mine = samples[rank::world]
    return [(sum(parts) / len(mine)).to(device) for parts in zip(*mine, strict=True)]


def sharded(world: int, build, device: str = "cpu", hsdp: bool = False) -> tuple[Probe, torch.optim.Optimizer]:
    """The probe under FSDP2 on ``world`` ranks (HSDP: 2 replicas of world / 2 shards) and ``build``'s
    optimizer over its parameters."""
    model = Probe().to(device)
    shape, names = ((2, world // 2), ("replicate", "shard")) if hsdp else ((world,), None)
    fully_shard(model, mesh=init_device_mesh(device, shape, mesh_dim_names=names))
    return model, build(model.parameters())


def fsdp_step(model, opt, step: int, rank: int, world: int) -> None:
    model(targets(step, rank, world, next(model.parameters()).device.type)).backward()
    opt.step()
    opt.zero_grad()


def one_process(build, steps: int, device: str = "cpu") -> tuple[Probe, torch.optim.Optimizer]:
    """The reference: the same steps in one process on the averaged gradients."""
    model = Probe().to(device)
    opt = build(model.parameters())
    for step in range(steps):
        for p, g in zip(model.params, targets(step, 0, 1, device), strict=True):
            p.grad = g
        opt.step()
    return model, opt


def shard_of(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s dim-0 shard of ``full`` as FSDP2 cuts it: ``torch.chunk``, whose tail ranks may
    get nothing. (Compared shard by shard, the test needs no collective: ``full_tensor()`` over Gloo
    with CUDA tensors crashed torch 2.11 on one GPU.)"""
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def equal_to_one_process(rank: int, world: int, backend: str, tol: float, device: str = "cpu") -> None:
    """4 steps at ``world`` ranks against one process: bitwise where ``tol`` is 0, else normwise."""
    os.environ["KERNEL_FACTORY_BACKEND"] = backend
    if device == "cuda":
        use_gpu()
    same = torch.equal if tol == 0 else (lambda a, b: compare_tensors("p", "x", a, b, tol).passed)
    for name, build in OPTIMIZERS.items():
        model, opt = sharded(world, build, device)
        for step in range(4):
            fsdp_step(model, opt, step, rank, world)
        ref, ref_opt = one_process(build, 4, device)
        for i, (p, q) in enumerate(zip(model.params, ref.params, strict=True)):
            assert same(local(p), shard_of(q, rank, world)), (name, i)
            for key, value in ref_opt.state[q].items():
                ours = local(opt.state[p][key])
                assert same(ours, value if key == "step" else shard_of(value, rank, world)), (name, i, key)
        if rank == world - 1:  # the tail rank holds empty shards, kept in the state and stepped
            assert local(model.params[1]).numel() == 0 and float(opt.state[model.params[1]]["step"]) == 4


def muon_equal_to_one_process(rank: int, world: int, backend: str, tol: float, device: str = "cpu",
                              plan_options: tuple[str, ...] = (), hsdp: bool = False) -> None:  # fmt: skip
    """4 Muon steps at ``world`` ranks (an owner rank per matrix) against one process: params and
    momentum buffers within ``tol`` (normwise relative; 0: bitwise), and the largest update of the
    last step (telemetry, the ranks' maximum) within 1e-6 of one process's. ``plan_options``: the
    switches turned on (``set_muon_plan_options``). ``hsdp``: 2
    replicas of world / 2 shards (the all-to-alls run in each replica's shard group)."""
    set_muon_plan_options(plan_options)
    with all_to_alls_recorded() as all_to_alls:
        opt = states_equal_to_one_process(rank, world, SHARDED_MUON, backend, tol, device, hsdp)
    files = "peer_copies_on_files" in plan_options
    shards = world // 2 if hsdp else world
    # "auto": NCCL shard groups of two ranks (one host here)
    auto = "peer_copies_auto" in plan_options and dist.get_backend() == "nccl" and shards == 2
    peers = files or auto or "peer_copies" in plan_options
    if "coalesce_on_gloo" in plan_options:  # two stages, two ways, four steps; none with the peer copies
        assert STAND_IN_GROUPS[0] == 0 if peers else STAND_IN_GROUPS[0] >= 2 * 2 * 4, STAND_IN_GROUPS
    assert not (peers and all_to_alls), f"{len(all_to_alls)} all-to-alls beside the peer copies"
    assert peers or all_to_alls, "neither peer copies nor all-to-alls"
    if files:  # a flag to each peer of the shard group per stage, way and step
        from peer_pool_stand_in import POOLS

        assert POOLS[0] > 0 and POOLS[1] == (shards - 1) * 2 * 2 * 4, POOLS
    # a tensor on this rank's GPU under NCCL (it reduces no CPU tensor), on the CPU under Gloo
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    amax = torch.tensor(float(opt.telemetry.summary()["amax_update"]), device=on)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    expected = float(one_process(SHARDED_MUON, 4, device)[1].telemetry.summary()["amax_update"])
    assert expected > 0 and abs(float(amax) - expected) <= 1e-6 * expected, (float(amax), expected)


def set_muon_plan_options(names: tuple[str, ...]) -> None:
    """Turn on ``ShardedMuonGroupPlan``'s switches ``names`` (and ``ShardedMuonBatch``'s
    ``owner_kernels`` and ``peer_copies``) in this rank's process, the others off.
    ``peer_copies_on_files``: ``peer_copies`` on CPU ranks, the pools shared files
    (``peer_pool_stand_in.FilePool``); ``peer_copies_auto``: ``peer_copies = "auto"``;
    ``replies_scattered``, ``pieces_gathered``: ``direct_replies``, ``direct_pieces`` off (on
    unless named).
    ``coalesce_on_gloo``: ``coalesce`` with Gloo's batches taken for NCCL ones and a stand-in for
    the coalescing manager, which Gloo lacks (``_coalesce_stand_in``), so that the grouped path's
    order of calls and its shared work run on the CPU."""
    from kernel_factory.optimizers.muon import distributed as muon_dist

    for name in ("pair_stages", "light_last", "coalesce"):
        setattr(muon_dist.ShardedMuonGroupPlan, name, name in names)
    muon_dist.ShardedMuonBatch.owner_kernels = "owner_kernels" in names
    muon_dist.ShardedMuonBatch.peer_copies = "peer_copies" in names or "peer_copies_on_files" in names
    muon_dist.ShardedMuonBatch.direct_replies = "replies_scattered" not in names
    muon_dist.ShardedMuonBatch.direct_pieces = "pieces_gathered" not in names
    if "peer_copies_auto" in names:
        muon_dist.ShardedMuonBatch.peer_copies = "auto"
    if "peer_copies_on_files" in names:
        from peer_pool_stand_in import FilePool

        muon_dist.peer_copy.POOL = FilePool
    if "coalesce_on_gloo" in names:
        muon_dist.ShardedMuonGroupPlan.coalesce = True
        init = muon_dist.ShardedMuonBatch.__init__

        def init_as_nccl(self, *args, **kwargs) -> None:
            init(self, *args, **kwargs)
            self.nccl = True

        muon_dist.ShardedMuonBatch.__init__ = init_as_nccl
        muon_dist._coalescing_manager = _coalesce_stand_in


STAND_IN_GROUPS = [0]  # groups the stand-in took in this process


class _StandInWorks:
    """What the coalescing manager yields: the works of the calls made inside, waited together."""

    def __init__(self) -> None:
        self.works: list = []

    def wait(self) -> None:
        for work in self.works:
            work.wait()


@contextlib.contextmanager
def _coalesce_stand_in(group, device, async_ops: bool):
    """The coalescing manager's contract on Gloo: the all-to-alls issued inside run one by one, and
    the yielded object's ``wait`` waits for all of them (NCCL's group gives one work for all)."""
    assert async_ops and device is not None
    STAND_IN_GROUPS[0] += 1
    issued = _StandInWorks()
    real = dist.all_to_all_single

    def recorded(*args, **kwargs):
        work = real(*args, **kwargs)
        issued.works.append(work)
        return None  # inside NCCL's group no call's own work is waited

    dist.all_to_all_single = recorded
    try:
        yield issued
    finally:
        dist.all_to_all_single = real
    assert issued.works, "nothing was issued inside the coalescing manager"


@contextlib.contextmanager
def all_to_alls_recorded():
    """Inside, every ``dist.all_to_all_single`` call runs and is listed as (input splits, output
    splits, input elements) in the list yielded."""
    calls: list[tuple[list[int], list[int], int]] = []
    real = dist.all_to_all_single

    def recorded(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        calls.append((list(input_split_sizes or []), list(output_split_sizes or []), input.numel()))
        return real(output, input, output_split_sizes, input_split_sizes, **kwargs)

    dist.all_to_all_single = recorded
    try:
        yield calls
    finally:
        dist.all_to_all_single = real


def muon_all_to_alls_skip_this_rank(rank: int, world: int) -> None:
    """A sharded Muon step's all-to-alls (the torch path on Gloo, one call per batch and way) move
    no element to or from the rank that issues them: a rank's pieces of its own matrices stay on
    it. Its updates still equal one process's (``muon_equal_to_one_process`` checks the bits)."""
    os.environ["KERNEL_FACTORY_BACKEND"] = "torch"
    set_muon_plan_options(())
    model, opt = sharded(world, SHARDED_MUON)
    with all_to_alls_recorded() as calls:
        fsdp_step(model, opt, 0, rank, world)
    assert calls, "no all-to-all was issued"
    for sent, got, numel in calls:
        assert sent[rank] == 0 and got[rank] == 0 and sum(sent) == numel, (rank, sent, got)
    assert sum(numel for _, _, numel in calls) > 0


def peer_copies_switch_checks(rank: int, world: int) -> None:
    """``peer_copies``' switch: ``direct_peers`` (with CUDA's peer-access answer stood in for) says
    True for ranks on this machine on devices of their own that reach each other, and False on
    every rank where the host names differ, where two ranks name one device, or where one rank's
    device cannot reach another's (each case a fresh group); ``"auto"`` takes the all-to-alls on
    Gloo (it asks for NCCL); a value other than True, False or "auto" is a ValueError that names
    the switch."""
    from kernel_factory.optimizers.muon import distributed as muon_dist
    from kernel_factory.optimizers.muon import peer_copies

    os.environ["KERNEL_FACTORY_BACKEND"] = "torch"
    asked, access = [], [True]
    peer_copies.torch.cuda.can_device_access_peer = lambda a, b: asked.append((a, b)) or access[0]
    own = torch.device("cuda", rank)
    assert peer_copies.direct_peers(dist.group.WORLD, own)
    assert sorted(asked) == [(rank, r) for r in range(world) if r != rank], asked
    real = peer_copies.socket.gethostname
    peer_copies.socket.gethostname = lambda: f"host{rank}"
    try:
        assert not peer_copies.direct_peers(dist.new_group(list(range(world))), own)
    finally:
        peer_copies.socket.gethostname = real
    assert not peer_copies.direct_peers(dist.new_group(list(range(world))), torch.device("cuda", 0))
    access[0] = rank != world - 1  # one rank's device reaches none of the others'
    assert not peer_copies.direct_peers(dist.new_group(list(range(world))), own)
    set_muon_plan_options(())
    muon_dist.ShardedMuonBatch.peer_copies = "auto"
    model, opt = sharded(world, SHARDED_MUON)
    with all_to_alls_recorded() as calls:
        fsdp_step(model, opt, 0, rank, world)
    batches = [b for plan in opt._plans.values() for b in getattr(plan, "batches", [])]
    assert calls and batches and all(b._peer_copies is None for b in batches), (len(calls), len(batches))
    muon_dist.ShardedMuonBatch.peer_copies = "yes"
    model, opt = sharded(world, SHARDED_MUON)
    try:
        fsdp_step(model, opt, 0, rank, world)
    except ValueError as e:
        assert "ShardedMuonBatch.peer_copies must be True, False or 'auto'" in str(e), e
    else:
        raise AssertionError("peer_copies='yes' was taken")
    finally:
        muon_dist.ShardedMuonBatch.peer_copies = False


def muon_kernels_equal_to_one_process(rank: int, world: int, tol: float, device: str = "cpu",
                                      plan_options: tuple[str, ...] = ()) -> None:  # fmt: skip
    """As ``muon_equal_to_one_process`` on the fused kernels (CUDA; the interpreter on CPU) on both
    sides: each rank's rows of every sharded matrix it holds rows of take the momentum and update
    kernels (``sharded_rows``); the owner's norm and NS run on another path than one process's, so
    within ``tol``."""
    from kernel_factory.optimizers.muon.distributed import ShardedMuonBatch, ShardedMuonGroupPlan

    set_muon_plan_options(plan_options)

    opt = states_equal_to_one_process(rank, world, SHARDED_MUON, "auto" if device == "cuda" else "triton", tol,
                                      device)  # fmt: skip
    batches = [b for plan in opt._plans.values() if isinstance(plan, ShardedMuonGroupPlan) for b in plan.batches
               if isinstance(b, ShardedMuonBatch)]  # fmt: skip
    assert batches and all(b.kernels is not None for b in batches if b.local_params[0].numel())
    if "owner_kernels" in plan_options:
        assert all(b.pieces is not None for b in batches if b.owned)


def turbo_adam_equal_to_one_process(rank: int, world: int, tol: float, device: str = "cpu",
                                    backend: str = "auto") -> None:  # fmt: skip
    """4 TurboAdam steps at ``world`` ranks against one process, matrices only (a sharded vector keeps
    exact moments where one process compresses them): params and every state within ``tol``. Where
    ``backend`` takes the fused kernels (CUDA; the interpreter under ``triton``) both take them, the
    sharded matrices with rows held here in their split-rows launches; else both the reference."""
    opt = states_equal_to_one_process(rank, world, SHARDED_TURBO_ADAM, backend, tol, device,
                                      compared=lambda q: q.dim() >= 2)  # fmt: skip
    took_split_launches(opt, device, backend, lambda p: p.dim() >= 2)


def adafactor_equal_to_one_process(rank: int, world: int, tol: float, device: str = "cpu",
                                   backend: str = "auto", kernels_only: bool = False) -> None:  # fmt: skip
    """4 Adafactor steps at ``world`` ranks against one process: params and every state within
    ``tol`` (row statistics split like the rows, column statistics of split matrices replicated).
    Where ``backend`` takes the fused kernels (CUDA; the interpreter under ``triton``), the sharded
    matrices and vectors held here take the split launches, one process its launches; the (2, 2, 3)
    tensor takes PyTorch ops on both sides, whose step sizes round otherwise (host floats in one
    process, device tensors sharded): ``kernels_only`` leaves it out."""
    compared = (lambda q: q.dim() <= 2) if kernels_only else (lambda q: True)
    opt = states_equal_to_one_process(rank, world, SHARDED_ADAFACTOR, backend, tol, device, compared=compared)
    took_split_launches(opt, device, backend, lambda p: p.dim() <= 2)


def adafactor_int8_equal_to_one_process(rank: int, world: int, tol: float, device: str = "cpu",
                                        backend: str = "auto") -> None:  # fmt: skip
    """As ``adafactor_equal_to_one_process`` with an int8 first moment, matrices compared (a sharded
    vector keeps bf16 where one process has codes); codes within ``state_tol`` normwise, as an ulp
    of the sums may move a rounding to the next code."""
    opt = states_equal_to_one_process(rank, world, SHARDED_ADAFACTOR_INT8, backend, tol, device, state_tol=1e-2,
                                      compared=lambda q: q.dim() >= 2)  # fmt: skip
    took_split_launches(opt, device, backend, lambda p: p.dim() == 2)


def took_split_launches(opt, device: str, backend: str, expected) -> None:
    """On a fused path, every sharded param held here where ``expected(p)`` stepped in a split launch."""
    if device == "cuda" or backend == "triton":
        split = {id(p) for plan in opt._plans.values() for launch in plan.launches if launch.split
                 for p in launch.sources}  # fmt: skip
        held = [p for p in opt.state if expected(p) and local(p).numel()]
        assert held and all(id(p) in split for p in held), (len(held), len(split))


def steps_without_host_sync(rank: int, world: int, name: str) -> None:
    """Adafactor (32-bit statistics, int8 first moment), TurboAdam or AdamMini (FP8; its split blocks
    on a side stream) on FSDP2's shards steps with the CUDA sync debug mode raising: step counts,
    statistics and column sums stay on the GPU (NCCL: one rank per GPU, or one rank, whose
    all-reduces need no host either)."""
    use_gpu()
    builds = {"Adafactor": SHARDED_ADAFACTOR_INT8, "TurboAdam": SHARDED_TURBO_ADAM,
              "AdamMini": lambda ps: sharded_adam_mini(ps, "fp8")}  # fmt: skip
    model, opt = sharded(world, builds[name], "cuda")
    fsdp_step(model, opt, 0, rank, world)  # the first step builds the states and the plan
    for step in range(1, 3):
        model(targets(step, rank, world, "cuda")).backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        opt.step()
        torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
    assert all(float(s["step"]) == 3 for s in opt.state.values())


def adam_mini_equal_to_one_process(rank: int, world: int, backend: str, tol: float, device: str = "cpu",
                                   momentum_dtype: str = "fp32", state_tol: float | None = None) -> None:  # fmt: skip
    """4 AdamMini steps at ``world`` ranks against one process, within ``tol`` (states within
    ``state_tol``); the blocks' second moments are replicated, compared whole. With FP8 momentum
    only the matrices are compared: sharded vectors keep bf16 momentum where one process has FP8."""
    matrices = (lambda q: q.dim() >= 2) if momentum_dtype == "fp8" else (lambda q: True)
    opt = states_equal_to_one_process(rank, world, lambda ps: sharded_adam_mini(ps, momentum_dtype), backend, tol,
                                      device, state_tol=state_tol, compared=matrices)  # fmt: skip
    if device == "cuda" or backend == "triton":  # every param took the fused kernel (sharded_plan.py)
        stepped = [p for key, (_, plans, _) in opt._plans.items() if isinstance(key, tuple) for plan in plans
                   for p in plan.params]  # fmt: skip
        assert len(stepped) == len(SHAPES), len(stepped)


def states_equal_to_one_process(rank: int, world: int, build, backend: str, tol: float, device: str = "cpu",
                                hsdp: bool = False, state_tol: float | None = None,
                                compared=lambda q: True) -> torch.optim.Optimizer:  # fmt: skip
    """4 steps of ``build``'s optimizer at ``world`` ranks against one process (returns the sharded
    optimizer): params within
    ``tol`` and every state the sharded optimizer keeps within ``state_tol`` (default ``tol``;
    normwise relative, 0: bitwise), for the one-process params ``q`` where ``compared(q)``;
    replicated states compared whole. HSDP: each replica's shards are compared (rank r holds
    shard r mod world / 2)."""
    os.environ["KERNEL_FACTORY_BACKEND"] = backend
    if device == "cuda":
        use_gpu()
    def close(t: float):
        return torch.equal if t == 0 else (lambda a, b: compare_tensors("p", "x", a.float(), b.float(), t).passed)

    same, same_state = close(tol), close(tol if state_tol is None else state_tol)
    model, opt = sharded(world, build, device, hsdp)
    shards = world // 2 if hsdp else world
    rank_in_shards = rank % shards
    for step in range(4):
        fsdp_step(model, opt, step, rank, world)
    ref, ref_opt = one_process(build, 4, device)
    for i, (p, q) in enumerate(zip(model.params, ref.params, strict=True)):
        if not compared(q):
            continue
        assert same(local(p), shard_of(q, rank_in_shards, shards)), i
        for key, value in ref_opt.state[q].items():
            if key not in opt.state[p]:  # one process's FP8 fallback pool, which sharded params go without
                continue
            ours = opt.state[p][key]
            whole = key == "step" or all(pl.is_replicate() for pl in ours.placements)
            assert same_state(local(ours), value if whole else shard_of(value, rank_in_shards, shards)), (i, key)
    return opt


def hsdp_equal_to_one_process(rank: int, world: int) -> None:
    """AdamW (bitwise, our kernel under the interpreter), Muon (bitwise, the reference path),
    AdamMini and Adafactor (1e-6) on HSDP's (Replicate, Shard(0)) parameters against one process."""
    states_equal_to_one_process(rank, world, OPTIMIZERS["AdamW"], "triton", 0.0, hsdp=True)
    states_equal_to_one_process(rank, world, SHARDED_MUON, "torch", 0.0, hsdp=True)
    states_equal_to_one_process(rank, world, sharded_adam_mini, "auto", 1e-6, hsdp=True)
    states_equal_to_one_process(rank, world, SHARDED_ADAFACTOR, "auto", 1e-6, hsdp=True)


# Params on two meshes in one optimizer: a 1-D FSDP mesh of all ranks and a 2 x (world / 2) HSDP
# mesh; the last has a non-contiguous local shard (a transposed view), as a custom layout may.
MIXED = [("layers.0.mlp.up_proj.weight", (8, 6), "fsdp"), ("layers.0.mlp.down_proj.weight", (8, 6), "hsdp"),
         ("layers.0.mlp.down_proj.bias", (5,), "fsdp"), ("layers.0.mlp.gate_proj.weight", (6, 4), "fsdp_t")]
# Tensor parallelism: columns split over all ranks (Shard(1), uneven: 10 over 4), and FSDP + TP on
# a 2 x (world / 2) mesh: rows over the first dim, columns over the second, or rows over both as
# FSDP2 shards a column-parallel weight (_StridedShard: each rank holds rows far apart); Q and K
# heads of 4 rows; a vector split over the TP mesh; a plain FSDP matrix beside them.
TENSOR_PARALLEL = [("layers.0.self_attn.q_proj.weight", (16, 8), "tp"),
                   ("layers.0.mlp.up_proj.weight", (10, 8), "fsdp_tp"),
                   ("layers.0.mlp.down_proj.weight", (8, 10), "tp"),
                   ("layers.0.self_attn.k_proj.weight", (8, 8), "fsdp_tp"),
                   ("layers.0.input_layernorm.weight", (8,), "tp"),
                   ("layers.0.mlp.gate_proj.weight", (8, 8), "fsdp"),
                   ("layers.1.self_attn.k_proj.weight", (16, 6), "fsdp_tp_strided"),
                   ("layers.1.self_attn.v_proj.weight", (8, 6), "fsdp_tp_strided")]  # fmt: skip
LAYOUTS = {"mixed": MIXED, "tensor_parallel": TENSOR_PARALLEL}


def _mixed_params(world: int, layouts: list, device: str = "cpu"):
    """(DTensor params on the meshes of ``layouts`` (MIXED, TENSOR_PARALLEL), their full values);
    the 2-D meshes are 2 x (world / 2), or 1 x 1 at one rank. Params and grads are cut locally, with
    no collective (Gloo with CUDA tensors crashed torch 2.11's collectives on one GPU)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    fsdp = init_device_mesh(device, (world,))
    two = min(2, world)
    hsdp = init_device_mesh(device, (two, world // two), mesh_dim_names=("replicate", "shard"))
    two_d = init_device_mesh(device, (two, world // two), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(7)
    params, fulls = [], []
    for _, shape, layout in layouts:
        full = torch.randn(shape, generator=gen).to(device)
        if layout == "hsdp":
            p = cut_locally(full, hsdp, [Replicate(), Shard(0)])
        elif layout == "fsdp":
            p = cut_locally(full, fsdp, [Shard(0)])
        elif layout == "tp":
            p = cut_locally(full, fsdp, [Shard(full.dim() - 1)])
        elif layout == "fsdp_tp":
            p = cut_locally(full, two_d, [Shard(0), Shard(1)])
        elif layout == "fsdp_tp_strided":
            p = cut_locally(full, two_d, [_StridedShard(0, split_factor=world // two), Shard(0)])
        else:  # this rank's rows, stored transposed
            rows = shard_of(full, fsdp.get_local_rank(), world)
            local_t = rows.t().contiguous().t()
            p = DTensor.from_local(local_t, fsdp, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
        params.append(torch.nn.Parameter(p))
        fulls.append(full)
    return params, fulls


def mixed_meshes_equal_to_one_process(rank: int, world: int, name: str, backend: str, tol: float,
                                      layouts: str = "mixed", device: str = "cpu") -> None:  # fmt: skip
    """3 steps of one optimizer over params on the meshes of ``LAYOUTS[layouts]`` against one process."""
    os.environ["KERNEL_FACTORY_BACKEND"] = backend
    if device == "cuda":
        use_gpu()
    builds = {"AdamW": lambda named: AdamW([p for _, p in named], lr=1e-2, weight_decay=0.1),
              "Muon": lambda named: Muon(named, lr=0.02, weight_decay=0.1, adamw_lr=1e-2),
              "AdamMini": lambda named: AdamMini(named, lr=1e-2, weight_decay=0.1, dim=8, n_heads=2,
                                                 momentum_dtype="fp32")}  # fmt: skip
    layout = LAYOUTS[layouts]
    params, fulls = _mixed_params(world, layout, device)
    ref = [torch.nn.Parameter(f.clone()) for f in fulls]
    opt = builds[name]([(n, p) for (n, _, _), p in zip(layout, params, strict=True)])
    ref_opt = builds[name]([(n, p) for (n, _, _), p in zip(layout, ref, strict=True)])
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        for p, q in zip(params, ref, strict=True):
            g = (torch.randint(-1024, 1024, q.shape, generator=gen) / 1024).to(device)
            q.grad = g
            p.grad = cut_locally(g, p.device_mesh, p.placements)
        opt.step()
        ref_opt.step()
    same = torch.equal if tol == 0 else (lambda a, b: compare_tensors("p", "x", a, b, tol).passed)
    for (n, _, _), p, q in zip(layout, params, ref, strict=True):
        assert same(local(p), local_part(q.detach(), p)), (name, n)


def sharded_muon_state(rank: int, world: int, path: str, device: str = "cuda",
                       plan_options: tuple[str, ...] = ()) -> None:  # fmt: skip
    """4 steps of Muon under FSDP2 at ``world`` ranks; rank 0 saves the full params to ``path``
    (gathered through a file per rank: ``full_tensor()`` over Gloo with CUDA tensors crashes).
    ``plan_options``: as ``muon_equal_to_one_process``'s."""
    os.environ["KERNEL_FACTORY_BACKEND"] = "auto"
    use_gpu()
    set_muon_plan_options(plan_options)
    model, opt = sharded(world, SHARDED_MUON, device)
    for step in range(4):
        fsdp_step(model, opt, step, rank, world)
    torch.save([local(p).cpu() for p in model.params], f"{path}.{world}.{rank}")


# The optimizers a checkpoint is tested with, on a path whose arithmetic does not depend on an
# element's position (test_fsdp2.py's docstring): AdamW's kernel under the interpreter; Muon's reference.
# AdamMini (FP8 and bf16 momentum: its dtype must survive the load, FP8's scales reshard) sums its
# blocks' g² in an order that depends on the world size: held to 1e-6 after the resumed step. FP8 and
# bf16 take PyTorch ops on CPU; fp32 momentum takes the fused kernel under the interpreter. Adafactor's
# column sums, row-statistic mean and RMS sums are added across the ranks: 1e-6 too.
CHECKPOINTED = {"AdamW": (OPTIMIZERS["AdamW"], "triton", 0.0), "Muon": (SHARDED_MUON, "torch", 0.0),
                "AdamMini-fp8": (lambda ps: sharded_adam_mini(ps, "fp8"), "auto", 1e-6),
                "AdamMini-bf16": (lambda ps: sharded_adam_mini(ps, "bf16"), "auto", 1e-6),
                "AdamMini-fp32": (lambda ps: sharded_adam_mini(ps, "fp32"), "triton", 1e-6),
                "TurboAdam": (SHARDED_TURBO_ADAM, "auto", 1e-6),
                "Adafactor": (SHARDED_ADAFACTOR, "auto", 1e-6),
                "Adafactor-int8": (SHARDED_ADAFACTOR_INT8, "auto", 1e-6)}  # fmt: skip


def save_checkpoint(rank: int, world: int, path: str, name: str, device: str = "cpu") -> None:
    """3 steps of ``CHECKPOINTED[name]`` at ``world`` ranks, a DCP checkpoint of model and optimizer
    at ``path``, then one more step, whose full params rank 0 keeps beside the checkpoint."""
    build, os.environ["KERNEL_FACTORY_BACKEND"], _ = CHECKPOINTED[name]
    if device == "cuda":
        use_gpu()
    model, opt = sharded(world, build, device)
    for step in range(3):
        fsdp_step(model, opt, step, rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    fsdp_step(model, opt, 3, rank, world)
    full = [p.full_tensor().cpu() for p in model.params]
    if rank == 0:
        torch.save(full, os.path.join(path, "after_next_step.pt"))


def load_checkpoint_and_step(rank: int, world: int, path: str, name: str, device: str = "cpu",
                             tol: float | None = None) -> None:  # fmt: skip
    """``save_checkpoint``'s checkpoint loaded at ``world`` ranks (any), one step: the params within
    ``tol`` (default ``CHECKPOINTED[name]``'s) of the saving run's next step, states in their own
    dtypes."""
    build, os.environ["KERNEL_FACTORY_BACKEND"], default_tol = CHECKPOINTED[name]
    tol = default_tol if tol is None else tol
    if device == "cuda":
        use_gpu()
    model, opt = sharded(world, build, device)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert all(float(s["step"]) == 3 for s in opt.state.values() if "step" in s)
    if name.startswith("AdamMini"):  # FP8 on matrices; bf16 on the vectors, split inside their one row
        expected = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}[name[-4:].lstrip("-")]
        assert {s["exp_avg"].dtype for p, s in opt.state.items() if p.dim() >= 2} == {expected}
    if name.startswith("TurboAdam") or name == "Adafactor-int8":  # codes and bf16 scales kept (torch's
        codes = torch.int8 if name == "Adafactor-int8" else torch.uint8  # loader casts them to fp32)
        assert {(s["exp_avg_codes"].dtype, s["exp_avg_scale"].dtype) for p, s in opt.state.items()
                if p.dim() >= 2} == {(codes, torch.bfloat16)}  # fmt: skip
    fsdp_step(model, opt, 3, rank, world)
    full = [p.full_tensor().cpu() for p in model.params]
    expected = torch.load(os.path.join(path, "after_next_step.pt"))
    same = torch.equal if tol == 0 else (lambda a, b: compare_tensors("p", "x", a, b, tol).passed)
    assert all(same(a, b) for a, b in zip(full, expected, strict=True))
