"""Adam-mini with FP8 momentum: one second moment per Hessian block, ~1 byte of state per param.

    opt = AdamMini(model.named_parameters(), lr=3e-4, weight_decay=0.1,
                   dim=768, n_heads=12, n_kv_heads=4)
    print(format_table(opt.partition_table()))
    opt.step(); opt.telemetry.summary()

See ``partition.py`` for the blocks, ``reference.py`` for the math (adam-mini 1.1.1's) and
``fp8.py`` for the FP8 storage and its BF16 fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import Tensor

from kernel_factory.generator import backend_mode

from ..shared import precompile
from ..shared.buckets import kernel_path, warn_once
from ..shared.checks import (
    check_adam_hyperparameters,
    check_param_grad,
    check_real,
    checked_grads,
    start_step,
)
from ..shared.dtensor import DTensor, local, row_shard_group
from ..shared.eager import eager_step
from ..shared.picklable import KeepsSettings
from ..shared.shard_sums import ShardSums
from ..shared.side_stream import SideStream
from ..shared.state_device import follow_param
from ..shared.state_dict import checked_load, own_loaded_state
from ..shared.telemetry import AMAX_UPDATE, STEP_SUM, TOTAL, Telemetry
from .distributed import (
    ShardedParam,
    block_sums_span_ranks,
    reduce_block_sums,
    row_mean_sq,
    second_moment_zeros,
    sharded_adam_mini_step,
    sharded_fp8_state,
)
from .fp8 import FALLBACK_CAPACITY, SUB_BLOCKS, fp8_layout, new_fp8_state
from .partition import ModelShape, NameRules, ParamPartition, Partition, format_table, partition_param
from .plan import AdamMiniTritonPlan
from .reference import adam_mini_reference_step
from .sharded_plan import ShardedAdamMiniPlan

MOMENTUM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
TELEMETRY = {"fp8_blocks": STEP_SUM, "bf16_blocks": STEP_SUM, "fallback_total": TOTAL, "overflow_total": TOTAL,
             **AMAX_UPDATE}  # fmt: skip


def fp8_supported(device: torch.device) -> bool:
    """FP8 momentum needs a CUDA GPU with FP8 conversions (sm89 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _named_groups(named_parameters) -> list[dict]:
    """Accept (name, param) pairs or param-group dicts whose "params" are such pairs, with
    torch.optim's errors for a bare tensor, an empty list and names on some params only."""
    if isinstance(named_parameters, Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                        + torch.typename(named_parameters))  # fmt: skip
    items = list(named_parameters)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    if all(isinstance(i, dict) for i in items):
        groups = [dict(g, params=list(g["params"])) for g in items]
    else:
        groups = [{"params": items}]
    for index, g in enumerate(groups):
        named = [isinstance(pair, tuple) for pair in g["params"]]
        if any(named) and not all(named):
            raise ValueError("all optimizer params should be with/without names. Some param names are missing")
        if index > 0 and not any(named):  # the first group had names (checked below)
            raise ValueError("all optimizer param groups should be with/without names. "
                             "cannot add param group without names to the optimizer")  # fmt: skip
        for pair in g["params"]:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], Tensor)):  # fmt: skip
                raise TypeError("AdamMini takes named parameters: model.named_parameters(), or groups "
                                f"whose 'params' are (name, tensor) pairs; got {type(pair).__name__}")  # fmt: skip
    return groups


class AdamMini(KeepsSettings, torch.optim.Optimizer):
    """Adam-mini (arXiv:2406.16793) with fp32, bf16 or FP8 (E4M3, per-sub-block scales) momentum.

    Args:
        named_parameters: ``model.named_parameters()``, or param groups (dicts) whose
            ``params`` are (name, tensor) pairs; fp32/bf16/fp16 tensors.
        lr, betas, eps, weight_decay: as adam-mini 1.1.1 (decoupled decay; parameters named
            norm/ln/bias do not decay).
        dim, n_heads, n_kv_heads (GQA; default n_heads), head_dim (default dim // n_heads):
            the attention geometry the Q/K per-head blocks follow.
        momentum_dtype: "fp8" (default; bf16 with one warning on CPU and GPUs before sm89),
            "bf16" or "fp32".
        name_rules: ``NameRules`` (adam-mini 1.1.1's name lists by default), extendable.
        qkv_split: rows of Q, K, V in a fused QKV weight (default from the geometry).
        sub_block: FP8 scale granularity, 128 or 256 elements inside a row.
        fallback_capacity: fraction of FP8 sub-blocks that may fall back to bf16 per step.
        verbose: print the partition table.
        model_sharding: adam-mini's flag, accepted so that its calls switch by import; ignored with
            one warning (FSDP2's parameters are found by their type).

    State per parameter: ``step`` (0-d fp32), ``exp_avg`` (the parameter's shape, momentum
    dtype; FP8 adds ``exp_avg_scale``, ``exp_avg_pool``, ``exp_avg_pool_used``) and
    ``exp_avg_sq`` (fp32, one value per block; per element for plain-Adam biases).
    """

    backend: str | None = None  # "torch" pins the reference path
    _settings = ("model_shape", "momentum_dtype", "sub_block", "fallback_capacity", "name_rules", "qkv_split",
                 "partition", "_group_parts")  # pickled (KeepsSettings)

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Tensor]] | Iterable[dict],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        dim: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        momentum_dtype: str = "fp8",
        name_rules: NameRules | None = None,
        qkv_split: tuple[int, int, int] | None = None,
        sub_block: int = 128,
        fallback_capacity: float = FALLBACK_CAPACITY,
        verbose: bool = False,
        model_sharding: bool | None = None,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        if model_sharding is not None:  # adam-mini's flag (deprecated there since 1.0.2: always on)
            if not isinstance(model_sharding, bool):
                raise TypeError(f"model_sharding must be None or a bool, got {model_sharding!r}")
            warn_once("AdamMini: model_sharding is accepted for adam-mini's calls and ignored: FSDP2's sharded "
                      "parameters are found by their type (DTensor)")  # fmt: skip
        if momentum_dtype not in MOMENTUM_DTYPES:
            raise ValueError(f"momentum_dtype must be one of {sorted(MOMENTUM_DTYPES)}, got {momentum_dtype!r}")
        if sub_block not in SUB_BLOCKS:
            raise ValueError(f"sub_block must be one of {SUB_BLOCKS}, got {sub_block!r}")
        check_real(fallback_capacity=fallback_capacity)
        if not 0.0 < fallback_capacity <= 1.0:
            raise ValueError(f"fallback_capacity must be in (0, 1], got {fallback_capacity!r}")
        self.model_shape = ModelShape(dim, n_heads, n_kv_heads, head_dim)
        self.momentum_dtype, self.sub_block, self.fallback_capacity = momentum_dtype, sub_block, fallback_capacity
        self.name_rules, self.qkv_split = name_rules or NameRules(), qkv_split
        self.partition = Partition()  # each param's blocks, in the order the groups were added
        self._group_parts: list[list[ParamPartition]] = []  # the same, one list per param group
        self._new_caches()
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._planning = True  # the constructor's groups plan in add_param_group, before torch's
        super().__init__(_named_groups(precompile.begin(named_parameters)), defaults)  # add_param_group each
        self._planning = False
        # plans built now, kernels compiling in the background (FSDP2's params plan at the step);
        # those built in add_param_group are found cached
        precompile.plan_ahead(self, self._plan_ahead)
        unmatched = self.partition.unmatched()
        if unmatched:
            warn_once(f"AdamMini: no name rule matched {unmatched}; each is one block (extend name_rules "
                      "to change that)")  # fmt: skip
        if verbose:
            print(format_table(self.partition_table()))

    def add_param_group(self, param_group: dict) -> None:
        """torch's, for named parameters: ``param_group["params"]`` are (name, tensor) pairs, as the
        constructor takes them. The new params' blocks follow the optimizer's model shape and name
        rules (``partition.py``); those that take no weight decay (norms, biases) go to a second
        group with weight_decay 0, as the constructor splits its groups. Their state is created at
        once (DCP reads it before any step)."""
        (group,) = _named_groups([param_group])
        pairs = group.pop("params")
        parts = [partition_param(name, p, self.model_shape, self.name_rules, self.qkv_split) for name, p in pairs]
        for (_, p), part in zip(pairs, parts, strict=True):
            self._parts[id(p)] = part
        for wanted, extra in ((True, {}), (False, {"weight_decay": 0.0})):
            chosen = [(pair, part) for pair, part in zip(pairs, parts, strict=True) if part.weight_decay == wanted]
            if chosen:
                sub_group = dict(group, params=[pair for pair, _ in chosen], **extra)
                if getattr(self, "_planning", False):  # the constructor's: its kernels compile while torch's
                    # first add_param_group imports torch._dynamo (precompile.plan_group); a group torch
                    # then refuses fails the constructor, plan and all
                    precompile.plan_group(self, self._plan_ahead, len(self.param_groups), sub_group,
                                          [p for _, p in sub_group["params"]])  # fmt: skip
                super().add_param_group(sub_group)
                self._group_parts.append([part for _, part in chosen])
                g = self.param_groups[-1]
                check_adam_hyperparameters(g["lr"], g["betas"], g["eps"], g["weight_decay"])
        self.partition.params.extend(parts)
        for (_, p), part in zip(pairs, parts, strict=True):
            if p.requires_grad and not p.is_meta:  # state up front: DCP fakes a step on an optimizer without any
                self._init_state(p, part)

    def _plan_ahead(self, index: int, group: dict, params: list[Tensor]) -> None:
        """Group ``index``'s plans for ``params`` (precompile.plan_ahead; FSDP2's sharded params plan
        at the step)."""
        self._group_plan(index, [p for p in params if not isinstance(p, DTensor)])

    def _new_caches(self) -> None:
        """Each param's blocks by the param, and what the step builds and keeps: plans, telemetry,
        the sharded step's buffers and stream (KeepsSettings: after unpickling too)."""
        groups = zip(getattr(self, "param_groups", []), self._group_parts, strict=True)
        self._parts: dict[int, ParamPartition] = {id(p): part for g, parts in groups
                                                  for p, part in zip(g["params"], parts, strict=True)}  # fmt: skip
        self.telemetry = Telemetry(TELEMETRY)
        self._plans: dict[int, tuple] = {}  # group index -> its plans (and a sharded key: the sharded ones)
        self._sharded: dict[int, ShardedParam] = {}
        # (the plans they serve, the slots, each buffer's elements per block: ShardSums.slotwise)
        self._block_slots: tuple[list | None, ShardSums | None, list[Tensor]] = (None, None, [])
        self._side = SideStream()  # the split blocks' chain of the sharded step (CUDA)

    def partition_table(self) -> list[tuple]:
        """Rows (name, shape, kind, blocks, momentum dtype), one per parameter."""
        rows = []
        for g in self.param_groups:
            for p in g["params"]:
                part = self._parts[id(p)]
                kind = part.kind if part.matched else "whole (unmatched)"
                rows.append((part.name, part.shape, kind, part.blocks, self._momentum_name(p)))
        return rows

    def _momentum_name(self, p: Tensor) -> str:
        """The momentum dtype ``p`` gets: FP8 needs the kernels' sm89+ GPU, except on a matrix
        whose rows FSDP2 splits, which PyTorch ops step on any device; other sharded params (a
        vector split inside its one row, a matrix with split columns: FP8 sub-blocks would cross
        the split) keep bf16."""
        if self.momentum_dtype != "fp8":
            return self.momentum_dtype
        if isinstance(p, DTensor):
            return "fp8" if p.dim() >= 2 and row_shard_group(p) is not None else "bf16"
        return "fp8" if fp8_supported(p.device) else "bf16"

    def _init_state(self, p: Tensor, part: ParamPartition) -> dict:
        state = self.state[p]
        if "step" in state:
            if isinstance(p, DTensor) or state["step"].device == p.device:
                return state
            # made before the model moved (state follows its param: shared/state_device.py)
            if state["step"].item() > 0:  # stepped: moved as it is (bf16 momentum made on the CPU stays bf16)
                follow_param(p, state)
                return state
            state.clear()  # never stepped: made anew, with the momentum dtype of the new device
        momentum = self._momentum_name(p)
        if momentum != self.momentum_dtype and not isinstance(p, DTensor):
            warn_once(f"AdamMini: FP8 momentum needs a CUDA GPU of sm89 or later; {p.device} tensors keep "
                      "bf16 momentum")  # fmt: skip
        # a sharded param's step runs on the host (distributed.py reads it), as torch.optim's does
        state["step"] = torch.zeros((), dtype=torch.float32, device="cpu" if isinstance(p, DTensor) else p.device)
        if momentum == "fp8" and isinstance(p, DTensor):  # codes like the param, scales [R, per row]
            state.update(sharded_fp8_state(p, part, self.sub_block))
        elif momentum == "fp8":
            state.update(new_fp8_state(p.shape, part.rows, part.cols, p.device, self.sub_block,
                                       self.fallback_capacity))  # fmt: skip
        else:
            state["exp_avg"] = torch.zeros_like(p, dtype=MOMENTUM_DTYPES[momentum],
                                                memory_format=torch.contiguous_format)  # fmt: skip
        if isinstance(p, DTensor):  # like the param, split like its rows, or replicated (distributed.py)
            state["exp_avg_sq"] = second_moment_zeros(p, part)
            return state
        sq_shape = p.shape if part.kind == "adam" else (part.blocks,)
        state["exp_avg_sq"] = torch.zeros(sq_shape, dtype=torch.float32, device=p.device)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader, then every state tensor back in its saved dtype (torch casts floating
        state to the parameter dtype, which would turn FP8 momentum and fp32 scales into bf16)."""
        with checked_load(self):
            super().load_state_dict(state_dict)
            own_loaded_state(self, state_dict, lambda p, key, saved: True)
            for p, state in self.state.items():  # a sharded param's step stays on the host (_init_state)
                if isinstance(p, DTensor) and "step" in state:
                    state["step"] = state["step"].cpu()
        self._plans = {}  # the plans' pointer tables point at the replaced tensors (and their step views)

    def _path(self, p: Tensor) -> str:
        """"triton" or "reference" for this parameter (KERNEL_FACTORY_BACKEND or ``backend``)."""
        return "triton" if kernel_path(p, self.backend or backend_mode()) in ("cuda", "interpreter") else "reference"

    def _cached_plans(self, slot, params: list[Tensor], build) -> tuple[list, list]:
        """``build(params)``'s (plans, reference params), kept under ``slot`` of ``self._plans`` and
        rebuilt when the set of params with grads changes."""
        key = tuple(map(id, params))
        cached = self._plans.get(slot)
        if cached is None or cached[0] != key:
            cached = self._plans[slot] = (key, *build(params))
        return cached[1], cached[2]

    def _group_plan(self, index: int, params: list[Tensor]) -> tuple[list, list[Tensor]]:
        """(Triton plans, reference params) of one group's params with grads, built once per set."""
        return self._cached_plans(index, params, self._build_group_plan)

    def _build_group_plan(self, params: list[Tensor]) -> tuple[list, list[Tensor]]:
        buckets: dict[tuple, list[Tensor]] = {}
        reference = []
        for p in params:
            state = self._init_state(p, self._parts[id(p)])
            if self._path(p) == "reference":
                reference.append(p)
            else:
                buckets.setdefault((p.device, p.dtype, state["exp_avg"].dtype), []).append(p)
        plans = [AdamMiniTritonPlan(ps, [self.state[p] for p in ps], [self._parts[id(p)] for p in ps],
                                    self.sub_block, self.fallback_capacity) for ps in buckets.values()]  # fmt: skip
        for plan in plans:  # running totals kept by the plan's kernels (int64 tel_count[2:4])
            if plan.fp8:
                self.telemetry.watch("fallback_total", lambda c=plan.tel_count: c[2], owner=plan)
                self.telemetry.watch("overflow_total", lambda c=plan.tel_count: c[3], owner=plan)
        return plans, reference

    @eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One Adam-mini update of every parameter that has a grad. Returns ``closure()``'s loss."""
        loss = start_step(self, closure)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        with self.telemetry.step(first.device if first is not None else None):
            self._step_sharded([[p for p in g["params"] if p.grad is not None and isinstance(p, DTensor)]
                                for g in self.param_groups])  # fmt: skip
            for index, group in enumerate(self.param_groups):
                params = [p for p in group["params"] if p.grad is not None and not isinstance(p, DTensor)]
                if not params:
                    continue
                plans, reference = self._group_plan(index, params)
                for plan in plans:
                    plan.run(group, partial(checked_grads, plan.params))
                    self._watch_plan(plan)
                beta1, beta2 = (float(b) for b in group["betas"])
                for i, p in enumerate(reference):
                    check_param_grad(i, p, p.grad)
                    part = self._parts[id(p)]
                    out = adam_mini_reference_step(p, p.grad, self.state[p], part, lr=float(group["lr"]),
                                                   beta1=beta1, beta2=beta2, eps=group["eps"],
                                                   weight_decay=group["weight_decay"])  # fmt: skip
                    fp8 = self.state[p]["exp_avg"].dtype == torch.float8_e4m3fn
                    sub_blocks = part.rows * fp8_layout(part.rows, part.cols, self.sub_block, 1.0)[0]
                    self._record_counts(sub_blocks, out["bf16_blocks"], out["overflow"], out["amax_update"], fp8)
        return loss

    def _step_sharded(self, by_group: list[list[DTensor]]) -> None:
        """FSDP2's parameters (``by_group``: each group's with grads): every rank's sums of g² over
        its part of the split blocks into the slots of one ``ShardSums`` (``_block_sums``), their
        all-reduce (one per shard group, all groups at once), the split blocks' moments and their
        rows' launch, on a side stream on CUDA, while the current stream's kernels update the rows
        that need no sum from other ranks; where the kernels do not run, PyTorch ops
        (``distributed.py``). Layouts that split columns too (tensor parallelism) all-reduce their
        sums apart (``reduce_block_sums``)."""
        staged = []
        for index, (group, ps) in enumerate(zip(self.param_groups, by_group, strict=True)):
            if ps:
                plans, reference = self._sharded_group_plan(index, ps)
                staged.append((group, plans, reference, checked_grads([item.p for item in reference])))
        slots = self._block_sums([plan for _, plans, _, _ in staged for plan in plans])
        for group, plans, _, _ in staged:
            for plan in plans:
                plan.begin(group)
                plan.take_grads(partial(checked_grads, plan.params))
        devices = {plan.device for _, plans, _, _ in staged for plan in plans}
        device = devices.pop() if len(devices) == 1 and slots is not None else None
        side = self._side.fork(device) if device is not None else None
        with SideStream.on(side):
            if slots is not None:
                slots.zero_()
            for group, plans, reference, grads in staged:
                for plan in plans:
                    plan.block_sums(group, partial(checked_grads, plan.params))
                for item, g in zip(reference, grads, strict=True):
                    if slots is not None and item.p in slots:
                        item.partial_sq_sums(g, out=slots[item.p])
            works = slots.all_reduce(async_op=True) if slots is not None else []
        split_cols = [(item, item.partial_sq_sums(g)) for _, _, reference, grads in staged
                      for item, g in zip(reference, grads, strict=True)
                      if not (slots is not None and item.p in slots) and not item.rows_local
                      and item.part.kind != "adam"]  # fmt: skip
        means = reduce_block_sums(split_cols) if split_cols else {}
        for group, plans, _, _ in staged:
            for plan in plans:
                plan.update_free(group, partial(checked_grads, plan.params))
        with SideStream.on(side):
            for w in works:
                w.wait()
            if slots is not None:
                for (_, buffer), numel in zip(slots.buffers, self._block_slots[2], strict=True):
                    buffer.div_(numel)  # sums -> means of g² over each block's elements
            # v = beta2 v + (1 - beta2) mean, as the kernel's kind 1 forms it: one pair of foreach ops
            # for all groups of one beta2 (their moments and means in the same order)
            by_beta2: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
            for group, plans, _, _ in staged:
                moments, means_of = by_beta2.setdefault(float(group["betas"][1]), ([], []))
                moments += [v for plan in plans for v in plan.block_moments()]
                means_of += [m for plan in plans for m in plan.block_means()]
            for beta2, (moments, means_of) in by_beta2.items():
                if moments:
                    torch._foreach_mul_(moments, beta2)
                    torch._foreach_add_(moments, means_of, alpha=1.0 - beta2)
            for group, plans, _, _ in staged:
                for plan in plans:
                    plan.update_given(group, partial(checked_grads, plan.params))
                    self._watch_plan(plan)
        SideStream.join(side, device)
        for group, _, reference, grads in staged:
            if reference:
                self._step_sharded_reference(group, reference, grads, slots, means)

    def _step_sharded_reference(self, group: dict, reference: list[ShardedParam], grads: list[Tensor],
                                slots: ShardSums | None, means: dict[int, Tensor]) -> None:  # fmt: skip
        """The PyTorch-ops step of one group's sharded params the kernels do not take, with the split
        blocks' means of g² (in ``slots`` for split rows, in ``means`` for split columns)."""
        beta1, beta2 = (float(b) for b in group["betas"])
        item_means = [row_mean_sq(item, g) if item.rows_local
                      else slots[item.p] if slots is not None and item.p in slots else means.get(id(item))
                      for item, g in zip(reference, grads, strict=True)]  # fmt: skip
        amax, overflow = sharded_adam_mini_step(
            reference, grads, [self.state[item.p] for item in reference], item_means, lr=float(group["lr"]),
            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
        )  # fmt: skip
        self.telemetry.add("amax_update", amax)
        if overflow is not None:
            self.telemetry.add("overflow_total", overflow)

    def _block_sums(self, plans: list[ShardedAdamMiniPlan]) -> ShardSums | None:
        """The sums of g² over the split blocks of every param of the optimizer whose rows alone are
        split and whose blocks are not rows (a slot of its blocks each, the same on every rank
        whatever it holds locally), made when the plans change; the kernels add into them."""
        served = self._block_slots[0]
        if served is None or len(served) != len(plans) or any(a is not b for a, b in zip(served, plans, strict=False)):
            split = [p for group in self.param_groups for p in group["params"]
                     if isinstance(p, DTensor) and p.requires_grad and id(p) in self._parts
                     and block_sums_span_ranks(p, self._parts[id(p)])]  # fmt: skip
            slots = ShardSums([(p, self._parts[id(p)].blocks) for p in split]) if split else None
            numel = []
            if slots is not None:
                numel = slots.slotwise({id(p): self._parts[id(p)].block_numel().to(local(p).device) for p in split})
                for plan in plans:
                    plan.use_block_sums(slots.views)
            self._block_slots = (plans, slots, numel)
        return self._block_slots[1]

    def _sharded_group_plan(self, index: int, params: list[DTensor]) -> tuple[list, list[ShardedParam]]:
        """(kernel plans, params for PyTorch ops) of one group's DTensor params with grads, built
        once per set of params: the kernels take what they take in one process (``_path``), FP8
        momentum only on GPUs with FP8 (``fp8_supported``)."""
        return self._cached_plans(("sharded", index), params, self._build_sharded_plan)

    def _build_sharded_plan(self, params: list[DTensor]) -> tuple[list, list[ShardedParam]]:
        buckets: dict[tuple, list[ShardedParam]] = {}
        reference = []
        for p in params:
            state = self._init_state(p, self._parts[id(p)])
            item = self._sharded.get(id(p))
            if item is None or item.p is not p:
                item = self._sharded[id(p)] = ShardedParam(p, self._parts[id(p)], self.sub_block)
            fp8 = state["exp_avg"].dtype == torch.float8_e4m3fn
            kernels = self._path(local(p)) == "triton" and (not fp8 or fp8_supported(local(p).device))
            if kernels and item.rows_split:  # split columns (tensor parallelism) take PyTorch ops
                buckets.setdefault((local(p).device, p.dtype, state["exp_avg"].dtype), []).append(item)
            else:
                reference.append(item)
        plans = [ShardedAdamMiniPlan(items, [self.state[it.p] for it in items], self.sub_block)
                 for items in buckets.values()]  # fmt: skip
        for plan in plans:
            if plan.fp8:  # no pool: only overflows (int64 tel_count[3], a running total)
                self.telemetry.watch("overflow_total", lambda c=plan.tel_count: c[3], owner=plan)
        return plans, reference

    def _watch_plan(self, plan: AdamMiniTritonPlan) -> None:
        """This step's counters, kept by the plan's kernels, read by the telemetry when asked
        (the running totals are watched once, in _group_plan)."""
        t = self.telemetry
        t.watch("amax_update", plan.step_amax)
        if plan.fp8:
            t.watch("bf16_blocks", lambda: plan.tel_count[0])
            t.watch("fp8_blocks", lambda: plan.sub_blocks - plan.tel_count[0])

    def _record_counts(self, sub_blocks: int, bf16: Tensor, overflow: Tensor, amax: Tensor, fp8: bool) -> None:
        t = self.telemetry
        t.add("amax_update", amax)
        if fp8:
            t.add("bf16_blocks", bf16)
            t.add("fp8_blocks", sub_blocks - bf16)
            t.add("fallback_total", bf16)
            t.add("overflow_total", overflow)


class ReferenceAdamMini(AdamMini):
    """AdamMini pinned to the pure-PyTorch reference (the parity oracle)."""

    backend = "torch"
