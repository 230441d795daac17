"""TurboAdam: AdamW whose moments are stored compressed (codecs.py), a drop-in for turboadam's class.

    opt = TurboAdam(model.parameters(), lr=3e-4, weight_decay=0.1)   # ~0.77 B of state per param

On CUDA the fused kernels (plan.py) step every tensor of a group, compressed ones and those under
the size thresholds (exact fp32 moments, bitwise our AdamW), and FSDP2's sharded matrices on their
local rows (distributed.py); with both codecs off it is our AdamW's stepper. The CPU and what the
kernels do not take step through the PyTorch reference (reference.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from kernel_factory.generator import backend_mode

from ..shared import precompile
from ..shared.buckets import warn_once
from ..shared.checks import (
    check_adam_hyperparameters,
    check_implementation_flags,
    check_non_negative_int,
    check_param_grad,
    start_step,
)
from ..shared.dtensor import DTensor, local, local_row_indices
from ..shared.eager import eager_step
from ..shared.picklable import KeepsSettings
from ..shared.shard_sums import ShardSums
from ..shared.state_device import follow_param
from ..shared.state_dict import checked_load, own_loaded_state, saved_params, shape_mismatch
from ..shared.steppers import group_state_init, group_stepper
from ..shared.telemetry import AMAX_UPDATE, SKIPPED_STEPS, STEP_SUM, TOTAL, Telemetry
from . import codecs
from .distributed import add_column_sums, compressible, local_state, shard_state
from .plan import TurboGroupPlan
from .reference import Layout, convert_state, decoded_moments, init_state, layout_of_state, matrix_view, turbo_adam_step

V_BITS = (2, 4, 8)  # 2: factored base + 2-bit codes on matrices (4-bit codes on vectors); 4, 8: per element
# torch AdamW's group keys, so that DCP's strict loads and checkpoints from torch.optim.AdamW work
V_CLIPPED = "v_clipped"  # elements whose fresh v fell outside the factored codes' range (fused path)
TELEMETRY = {**AMAX_UPDATE, SKIPPED_STEPS: TOTAL, V_CLIPPED: STEP_SUM}
# group options that change how tensors are kept (a change rebuilds the group's launch plan)
_STRUCTURAL = ("block_size", "v_bits", "compress_m", "compress_v", "min_m_compress_elements",
               "min_v_compress_elements")  # fmt: skip
_ADAMW_KEYS = dict(amsgrad=False, maximize=False, foreach=None, fused=None, differentiable=False,
                   decoupled_weight_decay=True)  # fmt: skip


class TurboAdam(KeepsSettings, torch.optim.Optimizer):
    """AdamW with compressed moments (decoupled weight decay).

    Args:
        params: tensors or param-group dicts; fp32, bf16 or fp16.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled decay; default 0, as turboadam).
        block_size: elements per block within a row (per-block scales and grid bases): 32 to 4096,
            a multiple of 32.
        v_bits: 2 (default: matrices keep Adafactor's row and column means and a 2-bit code per
            element; vectors 4-bit codes), 4 or 8 (per-element log codes).
        compress_m, compress_v: False keeps that moment exact (fp32), e.g. a v-only mode.
        capturable: accepted (torch's meaning); the fused CUDA step is capturable whatever its value
            (no host sync), the reference path (the CPU, what the kernels do not take) is not.
        amsgrad, maximize, foreach, fused, differentiable (keyword only): torch.optim.AdamW's flags,
            so that its calls switch by import: foreach and fused are accepted and checked (the step
            is always fused); amsgrad, maximize and differentiable must be False (ValueError).
        min_m_compress_elements, min_v_compress_elements: smaller tensors keep exact fp32 moments.
        m_block_size, m_step_factor: turboadam's first-moment codec options, accepted so that its
            users switch by import; ignored with one warning (this codec has no counterpart).
        rounding_seed: the stochastic rounding's random stream (a counter hash of it, the step
            and the element).

    State per parameter: ``step``; the first moment as ``exp_avg`` (fp32) or ``exp_avg_codes``
    (uint8, two 4-bit codes of exp_avg / sqrt(exp_avg_sq as decoded) a byte, rows x 64 per 128
    columns) with ``exp_avg_scale`` (bf16, one per block); the second moment as ``exp_avg_sq``
    (fp32) or ``exp_avg_sq_codes`` (uint8) with
    ``exp_avg_sq_row`` / ``exp_avg_sq_col`` (fp32 row and column means, factored) or
    ``exp_avg_sq_base`` (int16 per block, per-element codes). ``decoded_state(p)`` gives the moments
    as torch AdamW keeps them, ``adamw_state_dict()`` a state dict torch.optim.AdamW loads, and
    ``load_state_dict`` takes torch AdamW's too (encoding its moments). ``GradScaler`` hands the
    step ``grad_scale`` / ``found_inf``: grads are unscaled, and a step with an inf is skipped.
    """

    _step_supports_amp_scaling = True
    backend: str | None = None  # None: KERNEL_FACTORY_BACKEND decides; subclasses may pin it (as AdamW)
    _settings = ("seed",)  # pickled (KeepsSettings)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        block_size: int = 128,
        v_bits: int = 2,
        compress_m: bool = True,
        compress_v: bool = True,
        capturable: bool = False,
        min_m_compress_elements: int = 4096,
        min_v_compress_elements: int = 4096,
        m_block_size: int | None = None,
        m_step_factor: float | None = None,
        rounding_seed: int = 0x12345678,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        differentiable: bool = False,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        check_implementation_flags(foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable)
        unsupported = (("amsgrad", amsgrad, "use AdamW(amsgrad=True)"),
                       ("maximize", maximize, "negate the loss, or use AdamW(maximize=True)"))
        for name, value, instead in unsupported:
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
            if value:
                raise ValueError(f"{name}=True is not supported by TurboAdam; {instead}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or not 32 <= block_size <= 4096 \
                or block_size % 32:  # fmt: skip
            raise ValueError(f"block_size must be a multiple of 32 in [32, 4096], got {block_size!r}")
        if v_bits not in V_BITS:
            raise ValueError(f"v_bits must be one of {V_BITS}, got {v_bits!r}")
        for name, value in (("compress_m", compress_m), ("compress_v", compress_v), ("capturable", capturable)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        check_non_negative_int(min_m_compress_elements=min_m_compress_elements,
                               min_v_compress_elements=min_v_compress_elements, rounding_seed=rounding_seed)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size, v_bits=v_bits,
                        compress_m=compress_m, compress_v=compress_v, capturable=capturable,
                        min_m_compress_elements=min_m_compress_elements,
                        min_v_compress_elements=min_v_compress_elements, m_codec=codecs.M_CODEC,
                        **{**_ADAMW_KEYS, "foreach": foreach, "fused": fused})  # fmt: skip
        for name, value in (("m_block_size", m_block_size), ("m_step_factor", m_step_factor)):
            if value is not None:  # turboadam's first-moment codec options: ours has no counterpart
                warn_once(f"TurboAdam: {name} configures turboadam's first-moment codec, which this one does not "
                          f"use; {name}={value!r} is ignored (block_size sets the scales' blocks)")  # fmt: skip
        self.seed = rounding_seed
        self._new_caches()  # (the constructor's groups plan in add_param_group)
        self._constructing = True
        super().__init__(precompile.begin(params), defaults)
        self._constructing = False
        # plans built now, kernels compiling in the background; those built in add_param_group are
        # found cached
        precompile.plan_ahead(self, self._plan_ahead)

    def _new_caches(self) -> None:
        """What the step builds and keeps (KeepsSettings: after unpickling too)."""
        self._exact_plans: dict[int, object] = {}
        self._plans: dict[int, TurboGroupPlan] = {}
        self._columns: tuple[list, ShardSums | None] = ([], None)  # (the plans it serves, its buffers)
        self.telemetry = Telemetry(TELEMETRY)

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if getattr(self, "_constructing", False) and isinstance(params, (Tensor, list, tuple)):
            # Its kernels compile while torch's first add_param_group imports torch._dynamo
            # (precompile.plan_group): the group as torch will hold it, the defaults filled in (the
            # plan makes the params' state, found there once torch has added the group); a group
            # torch then refuses fails the constructor, plan and all. (An iterator is left to torch.)
            params = [params] if isinstance(params, Tensor) else [e[1] if isinstance(e, tuple) else e for e in params]
            planned = {**self.defaults, **param_group, "params": params}
            precompile.plan_group(self, self._plan_ahead, len(self.param_groups), planned, params)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_adam_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for p in group["params"]:
            if p.requires_grad and not p.is_meta and not p.is_complex():
                self._init_state(p, group)

    def layout(self, p: Tensor, group: dict) -> Layout:
        """How ``p``'s moments are kept in ``group`` (thresholds, flags, v_bits, the shape)."""
        n = p.numel()
        if not compressible(p):  # a sharded vector, a tensor-parallel layout: exact moments (distributed.py)
            return Layout(False, None, group["block_size"])
        compress_v = group["compress_v"] and n >= group["min_v_compress_elements"]
        codec = None
        if compress_v:
            factored = codecs.FACTORED if p.dim() >= 2 else codecs.LOG4  # a vector has no columns to factor
            codec = {2: factored, 4: codecs.LOG4, 8: codecs.LOG8}[group["v_bits"]]
        return Layout(group["compress_m"] and n >= group["min_m_compress_elements"], codec, group["block_size"])

    def _init_state(self, p: Tensor, group: dict) -> None:
        layout = self.layout(p, group)
        if self.state[p]:
            if not isinstance(p, DTensor):  # made before the model moved: AdamW's step count stays on the host
                follow_param(p, self.state[p], host=("step",) if layout.exact else ())
            return
        if layout.exact:  # AdamW's own state: exact fp32 moments, as AdamW(state_dtype="fp32") keeps them
            group_state_init("adamw")({**group, "params": [p], "state_dtype": "fp32"}, self.state)
        elif isinstance(p, DTensor):
            self.state[p].update(shard_state(p, init_state(local(p), layout)))
        else:
            self.state[p].update(init_state(p, layout))

    def decoded_state(self, p: Tensor) -> dict[str, Tensor]:
        """``p``'s state as torch.optim.AdamW keeps it: ``step``, ``exp_avg``, ``exp_avg_sq`` (fp32,
        the parameter's shape), decoded from the codes."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        state, layout = self.state[p], self.layout(p, group)
        mine = local(p)
        m, v = decoded_moments(local_state(state), matrix_view(mine).shape, layout)
        m, v = m.view_as(mine), v.view_as(mine)
        if isinstance(p, DTensor):  # like the param, as torch AdamW keeps its moments under FSDP2
            m, v = (DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride()) for t in (m, v))  # fmt: skip
        return {"step": state["step"].clone(), "exp_avg": m, "exp_avg_sq": v}

    def adamw_state_dict(self) -> dict:
        """``state_dict()`` with every parameter's moments decoded into torch.optim.AdamW's keys
        (``decoded_state``), for torch's AdamW (or ours) to load."""
        out = self.state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        out["state"] = {i: self.decoded_state(params[i]) if isinstance(i, int) else s for i, s in out["state"].items()}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader, then every state tensor back in its saved dtype (torch casts floating
        states to the parameter dtype: bf16 scales and fp32 moments of a bf16 param would change);
        a state kept otherwise than this optimizer keeps it (torch AdamW's moments, other
        thresholds or ``v_bits``, the earlier first-moment codec) is converted."""
        with checked_load(self):
            super().load_state_dict(state_dict)
            own_loaded_state(self, state_dict, lambda p, key, saved: True)
            self._check_loaded_shapes()
            self._decode_earlier_m_codes(state_dict)
            for index, group in enumerate(self.param_groups):
                for key, value in self.defaults.items():  # torch AdamW's groups lack the codec options
                    group.setdefault(key, value)
                for i, p in enumerate(group["params"]):
                    state = self.state.get(p)
                    if not state:
                        continue
                    target = self.layout(p, group)
                    cols = math.prod(p.shape[1:]) if p.dim() >= 2 else p.numel()
                    loaded = layout_of_state(state, cols, target.block)
                    if loaded != target or (target.exact and state["exp_avg"].dtype != torch.float32):
                        if isinstance(p, DTensor):
                            raise RuntimeError(f"TurboAdam: parameter {i} of param group {index} is sharded and its "
                                               f"loaded state is kept as {loaded}, not as {target}: load a sharded "
                                               "state saved with the same options")  # fmt: skip
                        self.state[p] = convert_state(p, state, target, self._param_seed(index, i))
        self._exact_plans, self._plans = {}, {}

    def _check_loaded_shapes(self) -> None:
        """ValueError where a loaded state tensor's shape is not the one its layout (read from its
        keys) keeps for its parameter: a state dict of another model, whose conversion to this
        optimizer's layout would read its codes against the wrong rows and columns."""
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                state = self.state.get(p)
                if not state:
                    continue
                like = torch.empty(p.shape, dtype=p.dtype, device="meta")  # a DTensor's global shape
                block = group.get("block_size", self.defaults["block_size"])
                keeps = init_state(like, layout_of_state(state, matrix_view(like).shape[1], block))
                for key, value in state.items():
                    if isinstance(value, Tensor) and key in keeps and value.shape != keeps[key].shape:
                        raise shape_mismatch(key, pi, gi, p, value, tuple(keeps[key].shape))

    def _decode_earlier_m_codes(self, state_dict: dict) -> None:
        """The first moments of groups saved without ``m_codec`` (the earlier codec: m itself per
        block) decoded to fp32 ``exp_avg``, which ``load_state_dict`` then re-encodes."""
        owner = saved_params(state_dict, self.param_groups)
        for saved, group in zip(state_dict["param_groups"], self.param_groups, strict=True):
            if "m_codec" in saved:
                continue
            for key in saved["params"]:
                p = owner[key]
                state = self.state.get(p, {})
                if "exp_avg_codes" not in state:
                    continue
                if isinstance(p, DTensor):
                    raise RuntimeError("TurboAdam: this sharded state dict was saved with the earlier first-moment "
                                       "codec; load it unsharded once and save it again")  # fmt: skip
                m = codecs.decode_m_unscaled(state.pop("exp_avg_codes"), state.pop("exp_avg_scale"),
                                             matrix_view(p).shape[1], group["block_size"])  # fmt: skip
                state["exp_avg"] = m.reshape(p.shape)

    @eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One TurboAdam update of every parameter with a grad. Returns ``closure()``'s loss."""
        loss = start_step(self, closure)
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        plans = [self._group_plan(index, group) for index, group in enumerate(self.param_groups)]
        # Only the reference path reads found_inf on the host (one sync); the kernels read it on the device.
        on_host = found_inf is not None and any(plan.reference for plan, _ in plans)
        skip = on_host and bool(found_inf.item())
        columns = self._column_sums([plan for plan, _ in plans])
        pending = []  # sharded factored matrices: column sums of g² over every rank's rows, in flight
        if columns is not None:
            pending = self._sum_columns(columns, plans, grad_scale, found_inf, skip)
        with self.telemetry.step(self.param_groups[0]["params"][0].device, found_inf) as telemetry:
            for index, (group, (plan, params)) in enumerate(zip(self.param_groups, plans, strict=True)):
                self._step_group(index, group, plan, params, grad_scale, found_inf, skip, columns, telemetry,
                                 pending)  # fmt: skip
        return loss

    def _column_sums(self, plans: list[TurboGroupPlan]) -> ShardSums | None:
        """The column sums of g² of every sharded factored matrix of the optimizer (a slot of its
        columns each, the same on every rank whatever it holds locally), made when the plans change;
        the fused launches keep their sums in them."""
        served = self._columns[0]
        if len(served) != len(plans) or any(a is not b for a, b in zip(served, plans, strict=False)):
            sharded = [p for group in self.param_groups for p in group["params"]
                       if isinstance(p, DTensor) and p.requires_grad
                       and self.layout(p, group).v_codec == codecs.FACTORED]  # fmt: skip
            columns = ShardSums([(p, math.prod(p.shape[1:])) for p in sharded]) if sharded else None
            for plan in plans:
                for launch in plan.launches:
                    if launch.split and columns is not None:
                        launch.use_column_sums(columns.views)
            self._columns = (plans, columns)
        return self._columns[1]

    def _sum_columns(self, columns: ShardSums, plans: list, grad_scale: Tensor | None, found_inf: Tensor | None,
                     skip: bool) -> list:  # fmt: skip
        """Each rank's sums of g² per column of its rows of the sharded factored matrices (the fused
        stats launches, PyTorch ops on the reference path), added over each shard group: one
        all-reduce per group, on every rank, even where a step is skipped, left running (the
        returned works: wait before reading the sums)."""
        columns.zero_()
        for (plan, params), group in zip(plans, self.param_groups, strict=True):
            for launch in plan.launches:
                launch.run_stats(group["lr"], group["betas"], group["eps"], group["weight_decay"], grad_scale,
                                 found_inf)  # fmt: skip
            for i in plan.reference:
                p = params[i]
                if p in columns and not skip and local(p).numel():
                    check_param_grad(i, local(p), local(p.grad))
                    grad = local(p.grad).float()
                    add_column_sums(columns[p], grad if grad_scale is None else grad / grad_scale.to(grad.device))
        return columns.all_reduce(async_op=True)

    def _group_plan(self, index: int, group: dict) -> tuple[TurboGroupPlan, list[Tensor]]:
        """The cached plan of param group ``index`` and the params with grads it was built for."""
        params = [p for p in group["params"] if p.grad is not None]
        plan = self._plans.get(index)
        if plan is None or plan.key != self._plan_key(group, params):
            # checked when the plan is built: afterwards the fused launches check a grad when its
            # address changes, the reference path every step (no per-step cost per parameter on
            # the fused path)
            for i, p in enumerate(params):
                check_param_grad(i, local(p), local(p.grad))
            plan = self._build_plan(index, group, params)
        return plan, params

    @staticmethod
    def _plan_key(group: dict, params: list[Tensor]) -> tuple:
        return (tuple(map(id, params)), *(group[k] for k in _STRUCTURAL))

    def _plan_ahead(self, index: int, group: dict, params: list[Tensor]) -> None:
        """Group ``index``'s plan for ``params`` unless it is built already (precompile.plan_ahead)."""
        plan = self._plans.get(index)
        if plan is None or plan.key != self._plan_key(group, params):
            self._build_plan(index, group, params)

    def _build_plan(self, index: int, group: dict, params: list[Tensor]) -> TurboGroupPlan:
        """Param group ``index``'s plan for ``params`` (those with grads), their state created."""
        for p in params:
            self._init_state(p, group)
        position = {id(p): i for i, p in enumerate(group["params"])}
        seeds = [self._param_seed(index, position[id(p)]) for p in params]
        plan = self._plans[index] = TurboGroupPlan(self._plan_key(group, params), params, self.state,
                                                   [self.layout(p, group) for p in params], seeds,
                                                   self.backend or backend_mode())  # fmt: skip
        return plan

    def _step_group(self, index: int, group: dict, plan: TurboGroupPlan, params: list[Tensor],
                    grad_scale: Tensor | None, found_inf: Tensor | None, skip: bool, columns: ShardSums | None,
                    telemetry: Telemetry, pending: list) -> None:  # fmt: skip
        """One param group: exact params through AdamW's stepper (while ``pending``, the column sums'
        all-reduces, run), fused launches, the rest through the reference."""
        if plan.exact:  # AdamW's fused step, exact fp32 moments
            stepper = group_stepper("adamw")(self._exact_plans, index, plan.exact, self.state,
                                             {**group, "state_dtype": "fp32"})  # fmt: skip
            stepper.run({**group, "state_dtype": "fp32"}, grad_scale, found_inf)
            telemetry.watch("amax_update", stepper.update_amax)
        while pending:  # the column sums are read from here on
            pending.pop().wait()
        for launch in plan.launches:
            launch.run(group["lr"], group["betas"], group["eps"], group["weight_decay"], grad_scale, found_inf)
        if plan.launches:
            telemetry.watch("amax_update", plan.update_amax)
            telemetry.watch(V_CLIPPED, plan.clipped)
        beta1, beta2 = (float(b) for b in group["betas"])
        position = {id(p): i for i, p in enumerate(group["params"])}
        for i in plan.reference:
            p = params[i]
            if skip:
                break
            grad = local(p.grad)
            check_param_grad(i, local(p), grad)
            grad = grad if grad_scale is None else grad.float() / grad_scale.to(grad.device)
            rows = local_row_indices(p) if isinstance(p, DTensor) else None
            # a sharded factored matrix: the mean of (unscaled) g² over every rank's rows
            col_mean = columns[p] / p.shape[0] if columns is not None and p in columns else None
            amax = turbo_adam_step(local(p), grad, local_state(self.state[p]), self.layout(p, group),
                                   lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                                   weight_decay=float(group["weight_decay"]),
                                   seed=self._param_seed(index, position[id(p)]),
                                   rows_index=rows, col_sq_mean=col_mean)  # fmt: skip
            telemetry.add("amax_update", amax)

    def _param_seed(self, group: int, index: int) -> int:
        """The random stream of parameter ``index`` of group ``group``: the same on every rank."""
        return (self.seed * 1_000_003 + group * 65_537 + index) & 0xFFFFFFFF


class ReferenceTurboAdam(TurboAdam):
    """TurboAdam on its PyTorch reference path (reference.py) whatever KERNEL_FACTORY_BACKEND says:
    the oracle of the fused kernels' parity cells."""

    backend = "torch"
