"""Adafactor, a drop-in for torch.optim.Adafactor, with its factored statistics optionally kept as
8-bit ln codes (shared/log_codes.py: a grid that moves by whole steps, stochastic rounding).

    opt = Adafactor(model.parameters(), lr=1e-2)                 # 8-bit row/column statistics
    opt = Adafactor(model.parameters(), lr=1e-2, state_bits=32)  # torch.optim.Adafactor's states

The step is torch.optim.Adafactor's (Shazeer & Stern 2018, as torch 2.13 implements it): step size
min(lr, 1/sqrt(t)) * max(eps2, RMS(p)); beta2_t = 1 - t^beta2_decay; for a tensor of 2+ dims the
EMAs of g²'s means over its last dim (rows) and over its second-last dim (columns), whose product
over the rows' mean (clamped at eps1) estimates E[g²]; a vector keeps E[g²] per element; the
update g / sqrt(max(estimate, eps1²)) is divided by max(1, RMS(update) / d); decoupled weight decay
p *= 1 - lr * weight_decay. On CUDA it runs as three fused multi-tensor launches per param group
(plan.py, kernel_templates/adafactor.py.j2: fp32 arithmetic, the parameter rounded once); on the
CPU in PyTorch ops, one parameter at a time, where with ``state_bits=32`` the ops and their order
are torch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from kernel_factory.generator import backend_mode

from ..shared import log_codes, precompile
from ..shared.checks import check_param_grad, check_real, start_step
from ..shared.dtensor import DTensor, local
from ..shared.eager import eager_step
from ..shared.picklable import KeepsSettings
from ..shared.shard_sums import ShardSums
from ..shared.state_device import follow_param
from ..shared.state_dict import checked_load, own_loaded_state
from ..shared.telemetry import AMAX_UPDATE, SKIPPED_STEPS, TOTAL, Telemetry
from . import momentum
from .distributed import ShardedSteps, shard_slots, shardable, sharded_statistics
from .plan import AdafactorGroupPlan

STATE_BITS = (8, 32)
CODE_BITS, CODE_STEP = 8, 1 / 16  # 255 codes a block span 16 octaves, steps of 4.4%
BLOCK = 128  # statistics per block of a row: one int16 base each
MIN_CODED_VECTOR = 4096  # a vector's per-element variance is coded from this many elements on


class Adafactor(KeepsSettings, torch.optim.Optimizer):
    """torch.optim.Adafactor's arguments, checks and math, plus ``state_bits``.

    Args:
        params, lr, beta2_decay, eps (eps1 or None for the dtype's eps, eps2), d, weight_decay,
            foreach (accepted), maximize: as torch.optim.Adafactor.
        state_bits: 8 (default) keeps ``row_var`` / ``col_var`` of tensors of 2+ dims, and the
            ``variance`` of vectors of 4096+ elements, as 8-bit ln codes (uint8, one per value) with
            an int16 base per 128 values; 32 keeps torch's fp32 tensors.
        rounding_seed: the stochastic rounding's random stream.
        beta1: None (default, torch's Adafactor) or a first moment's decay in [0, 1): ``exp_avg`` =
            beta1 exp_avg + (1 - beta1) x this step's clipped, scaled update, by which p then moves
            (Shazeer & Stern 2018, as Hugging Face's Adafactor applies it).
        momentum_dtype: the first moment's storage, ``"bf16"`` (default), ``"fp32"`` or ``"int8"``
            (8-bit linear codes with a bf16 scale per 128 values of a row: momentum.py).

    State per parameter: ``step`` (0-d fp32); ``row_var`` (shape[:-1] + (1,)) and ``col_var``
    (shape[:-2] + (1, shape[-1])) or ``variance`` (vectors), as torch keeps them; coded, each is
    ``<name>_codes`` (uint8, (leading dims, values)) and ``<name>_base`` (int16, per block); with
    ``beta1``, ``exp_avg`` (the parameter's shape), or with int8 ``exp_avg_codes`` (int8, the
    parameter's shape) and ``exp_avg_scale`` (bf16, per 128 values of a row).

    Matrices, vectors and scalars on CUDA take the fused kernels (plan.py: three launches per
    param group, device and dtype, no host sync, CUDA-graph capturable), FSDP2's sharded ones
    their split launches (distributed.py); tensors of 3+ dims and the CPU take PyTorch ops.
    ``GradScaler`` hands the step ``grad_scale`` / ``found_inf``: grads are unscaled, and a step
    with an inf is skipped.
    """

    _step_supports_amp_scaling = True
    backend: str | None = None  # None: KERNEL_FACTORY_BACKEND decides; subclasses may pin it
    _settings = ("seed",)  # pickled (KeepsSettings)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float | Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        state_bits: int = 8,
        rounding_seed: int = 0,
        beta1: float | None = None,
        momentum_dtype: str = "bf16",
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not isinstance(lr, Tensor):
            check_real(lr=lr)
        check_real(beta2_decay=beta2_decay, d=d, weight_decay=weight_decay)
        if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, int):
            raise TypeError(f"rounding_seed must be an int, got {rounding_seed!r}")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 >= beta2_decay:
            raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise TypeError(f"eps must be a pair (eps1 or None, eps2), as torch.optim.Adafactor's, got {eps!r}")
        check_real(**{"eps[1]": eps[1]}, **({} if eps[0] is None else {"eps[0]": eps[0]}))
        if eps[0] is not None and not 0.0 <= eps[0]:
            raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}")
        if not 0.0 <= eps[1]:
            raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}")
        if not 1.0 <= d:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")
        if state_bits not in STATE_BITS:
            raise ValueError(f"state_bits must be one of {STATE_BITS}, got {state_bits!r}")
        if beta1 is not None and (isinstance(beta1, bool) or not isinstance(beta1, int | float)
                                  or not 0.0 <= beta1 < 1.0):  # fmt: skip
            raise ValueError(f"beta1 must be None or a float in [0, 1), got {beta1!r}")
        if momentum_dtype not in momentum.MOMENTUM_DTYPES:
            raise ValueError(f"momentum_dtype must be one of {sorted(momentum.MOMENTUM_DTYPES)}, "
                             f"got {momentum_dtype!r}")  # fmt: skip
        self.seed = rounding_seed
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay, foreach=foreach,
                        maximize=maximize, state_bits=state_bits, beta1=beta1,
                        momentum_dtype=momentum_dtype)  # fmt: skip
        self._new_caches()
        super().__init__(precompile.begin(params), defaults)
        precompile.plan_ahead(self, self._build_plan)  # plans built now, kernels compiling in the background

    def _new_caches(self) -> None:
        """What the step builds and keeps (KeepsSettings: after unpickling too)."""
        self._plans: dict[int, AdafactorGroupPlan] = {}
        self._sums: tuple[list, tuple | None] = ([], None)  # (the plans they serve, the shard groups' sums)
        self.telemetry = Telemetry({**AMAX_UPDATE, SKIPPED_STEPS: TOTAL})  # the last step's largest |update|, skips

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if p.requires_grad and not p.is_meta:
                self._init_state(p, group)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader, then every state tensor back in its saved dtype (torch casts the uint8
        codes and int16 bases to the parameter's dtype)."""
        with checked_load(self):
            super().load_state_dict(state_dict)
            own_loaded_state(self, state_dict, lambda p, key, saved: True)
            for group in self.param_groups:  # torch's Adafactor's groups lack our options
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
        self._plans = {}  # they hold the replaced state tensors

    @staticmethod
    def _coded(p: Tensor, group: dict) -> bool:
        # a sharded param keeps its statistics in its dtype (distributed.py)
        big = p.dim() > 1 or p.numel() >= MIN_CODED_VECTOR
        return group["state_bits"] == 8 and not isinstance(p, DTensor) and big

    def _init_state(self, p: Tensor, group: dict) -> None:
        state = self.state[p]
        if state:
            if not isinstance(p, DTensor):  # the step count stays on the host
                follow_param(p, state, host=("step",), param_dtype=("row_var", "col_var", "variance"))
            return
        # (on the device for a sharded param: its step reads it there, distributed.py)
        state["step"] = torch.zeros((), dtype=torch.float32, device=local(p).device if isinstance(p, DTensor) else None)
        if group["beta1"] is not None:  # (DTensors split like p where p is one)
            state.update(momentum.new_state(p, group["momentum_dtype"]))
        if isinstance(p, DTensor):
            if not shardable(p):
                raise RuntimeError(f"Adafactor: a parameter of shape {tuple(p.shape)} with placements {p.placements} "
                                   "is split otherwise than along dim 0 (tensor parallelism); only FSDP2's and "
                                   "HSDP's dim-0 shards are supported")  # fmt: skip
            state.update(sharded_statistics(p))
            return
        for name, shape in _statistics(p).items():
            if not self._coded(p, group):
                state[name] = torch.zeros(shape, dtype=p.dtype, device=p.device)
                continue
            rows, cols = _as_rows(shape)
            state[f"{name}_codes"] = torch.zeros((rows, cols), dtype=torch.uint8, device=p.device)
            state[f"{name}_base"] = torch.zeros((rows, -(-cols // BLOCK)), dtype=torch.int16, device=p.device)

    def decoded_state(self, p: Tensor) -> dict[str, Tensor]:
        """``p``'s state as torch.optim.Adafactor keeps it: ``step`` and ``row_var`` / ``col_var``
        (tensors of 2+ dims: shape[:-1] + (1,) and shape[:-2] + (1, shape[-1])) or ``variance``
        (vectors), decoded from the codes where they are coded, and with ``beta1`` the first moment
        ``exp_avg`` (fp32, p's shape) (copies either way)."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        state, coded = self.state[p], self._coded(p, group)
        out = {"step": state["step"].clone()}
        out.update({name: self._read(state, name, shape, coded).clone() for name, shape in _statistics(p).items()})
        if group["beta1"] is not None:
            out["exp_avg"] = momentum.read(state)
        return out

    def _read(self, state: dict, name: str, shape: tuple[int, ...], coded: bool) -> Tensor:
        if not coded:
            return state[name]
        _, cols = _as_rows(shape)
        codes, base = state[f"{name}_codes"], state[f"{name}_base"]
        return log_codes.decode_log(log_codes.unpack(codes, CODE_BITS, cols), base, CODE_STEP, BLOCK).view(shape)

    def _write(self, state: dict, name: str, value: Tensor, coded: bool, seed: int, step: int) -> None:
        if not coded:
            return  # updated in place
        rows, cols = _as_rows(tuple(value.shape))
        u = log_codes.weyl_uniform(seed, step, torch.arange(rows * cols, device=value.device).view(rows, cols))
        base = state[f"{name}_base"]
        codes = log_codes.encode_log(value.reshape(rows, cols).float(), base, CODE_BITS, CODE_STEP, BLOCK, u)
        state[f"{name}_codes"].copy_(log_codes.pack(codes, CODE_BITS))

    @eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One Adafactor update of every parameter with a grad. Returns ``closure()``'s loss."""
        loss = start_step(self, closure)
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        plans = [self._group_plan(index, group) for index, group in enumerate(self.param_groups)]
        # Only the PyTorch path reads found_inf on the host (one sync); the kernels read it on the device.
        skip = found_inf is not None and any(plan.reference for plan, _ in plans) and bool(found_inf.item())
        sharded = self._sharded_steps(plans, grad_scale, found_inf, skip)
        with self.telemetry.step(self.param_groups[0]["params"][0].device, found_inf) as telemetry:
            for gi, (group, (plan, params)) in enumerate(zip(self.param_groups, plans, strict=True)):
                for launch in plan.launches:
                    launch.run(group, grad_scale, found_inf)
                if plan.launches:
                    telemetry.watch("amax_update", plan.update_amax)
                if gi in sharded:
                    telemetry.add("amax_update", sharded[gi].apply())
                if skip or not plan.reference:
                    continue
                lr = float(group["lr"])  # (a host read of a tensor lr: the PyTorch path's only)
                eps1, eps2 = group["eps"]
                position = {id(p): i for i, p in enumerate(group["params"])}
                for i in plan.reference:
                    p = params[i]
                    if isinstance(p, DTensor):
                        continue  # (ShardedSteps)
                    seed = self._param_seed(gi, position[id(p)])
                    grad = self._unscaled_grad(i, p, group, grad_scale)
                    telemetry.add("amax_update", self._step_one(p, grad, group, lr, eps1, eps2, seed))
        return loss

    @staticmethod
    def _unscaled_grad(i: int, p: Tensor, group: dict, grad_scale: Tensor | None) -> Tensor:
        """Parameter ``i``'s local grad, checked, unscaled and negated under ``maximize``."""
        check_param_grad(i, local(p), local(p.grad))
        grad = local(p.grad) if grad_scale is None else local(p.grad) / grad_scale.to(local(p.grad).device)
        return -grad if group["maximize"] else grad

    def _sharded_steps(self, plans: list, grad_scale: Tensor | None, found_inf: Tensor | None,
                       skip: bool) -> dict[int, ShardedSteps]:  # fmt: skip
        """The first two phases of the sharded params' step, around the shard groups' sums (one
        all-reduce per shard group after each: shard_sums.py): the split launches' (plan.py) and
        the PyTorch path's (``ShardedSteps``, returned by group index for the last phase). The
        all-reduces run on every rank even where a step is skipped."""
        sums = self._shard_sums(plans)
        if sums is None:
            return {}
        red1, red2 = sums
        red1.zero_(whole=skip)  # a skipped step's PyTorch-path slots are not written
        red2.zero_(whole=skip)
        steps = {}
        for gi, (group, (plan, params)) in enumerate(zip(self.param_groups, plans, strict=True)):
            for launch in plan.launches:
                launch.run_stats(group, grad_scale, found_inf)
            mine = [(i, params[i]) for i in plan.reference if isinstance(params[i], DTensor)]
            if mine and not skip:
                eps1, eps2 = group["eps"]
                eps1 = torch.finfo(mine[0][1].dtype).eps if eps1 is None else eps1
                steps[gi] = ShardedSteps([p for _, p in mine], [self._unscaled_grad(i, p, group, grad_scale)
                                                               for i, p in mine],
                                         [self.state[p] for _, p in mine], group, float(group["lr"]), eps1, eps2,
                                         red1, red2)  # fmt: skip
                steps[gi].local_sums()
        red1.all_reduce()
        for gi, (group, (plan, _)) in enumerate(zip(self.param_groups, plans, strict=True)):
            for launch in plan.launches:
                launch.run_norm(group, grad_scale, found_inf)
            if gi in steps:
                steps[gi].norms()
        red2.all_reduce()
        return steps

    def _shard_sums(self, plans: list[tuple[AdafactorGroupPlan, list[Tensor]]]) -> tuple[ShardSums, ShardSums] | None:
        """The shard groups' sums of every sharded param of the optimizer (``shard_slots``: the same
        slots on every rank, whatever it holds locally), made when the plans (each with the params
        it serves) change; the split launches keep their sums in them."""
        served = self._sums[0]
        if len(served) != len(plans) or any(a is not b for a, (b, _) in zip(served, plans, strict=False)):
            sharded = [p for group in self.param_groups for p in group["params"]
                       if isinstance(p, DTensor) and p.requires_grad]  # fmt: skip
            sums = tuple(ShardSums(slots) for slots in shard_slots(sharded)) if sharded else None
            written = set()  # every step stores these params' slots whole: the split launches' and the PyTorch path's
            for plan, params in plans:
                written.update(id(params[i]) for i in plan.reference if isinstance(params[i], DTensor))
                for launch in plan.launches:
                    if launch.split and sums is not None:
                        launch.use_shard_sums(sums[0].views, sums[1].views)
                        written.update(id(p) for p in launch.sources)
            for s in sums or ():
                s.written(written)
            self._sums = ([plan for plan, _ in plans], sums)
        return self._sums[1]

    def _group_plan(self, index: int, group: dict) -> tuple[AdafactorGroupPlan, list[Tensor]]:
        """The cached plan of param group ``index`` and the params with grads it was built for
        (checked and given state when it is built; the fused path re-checks a grad when its
        address changes, the PyTorch path every step)."""
        params = [p for p in group["params"] if p.grad is not None]
        plan = self._plans.get(index)
        if plan is None or plan.key != self._plan_key(group, params):
            for i, p in enumerate(params):
                if p.is_complex():
                    raise RuntimeError(f"Adafactor does not support complex parameters (parameter {i}, "
                                       f"shape {tuple(p.shape)})")  # fmt: skip
                check_param_grad(i, local(p), local(p.grad))
            plan = self._build_plan(index, group, params)
        return plan, params

    @staticmethod
    def _plan_key(group: dict, params: list[Tensor]) -> tuple:
        return tuple(map(id, params)), group["state_bits"], group["beta1"] is None, group["momentum_dtype"]

    def _build_plan(self, index: int, group: dict, params: list[Tensor]) -> AdafactorGroupPlan:
        """Group ``index``'s plan for ``params`` (their states made where missing), cached."""
        for p in params:
            self._init_state(p, group)
        position = {id(p): i for i, p in enumerate(group["params"])}
        plan = self._plans[index] = AdafactorGroupPlan(
            self._plan_key(group, params), params, [self.state[p] for p in params],
            [self._coded(p, group) for p in params], [self._param_seed(index, position[id(p)]) for p in params],
            self.backend or backend_mode(),
            "none" if group["beta1"] is None else _TRITON_MOMENTUM[group["momentum_dtype"]])  # fmt: skip
        return plan

    def _param_seed(self, group: int, index: int) -> int:
        """The random stream of parameter ``index`` of group ``group``: the same on every rank."""
        return (self.seed * 1_000_003 + group * 65_537 + index) & 0xFFFFFFFF

    def _step_one(self, p: Tensor, grad: Tensor, group: dict, lr: float, eps1: float | None, eps2: float,
                  seed: int) -> Tensor:  # fmt: skip
        """torch.optim.Adafactor's step of one parameter (``grad`` unscaled, negated under
        ``maximize``), its statistics decoded and re-coded around it; returns the largest |update|
        it applied (0-d fp32; weight decay left out)."""
        state = self.state[p]
        coded = self._coded(p, group)
        if coded:  # decoded statistics are fp32: so is the arithmetic around them
            grad = grad.float()
        eps1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
        state["step"] += 1
        if p.numel() == 0:  # nothing to update (torch's RMS(p) divides by its size: ZeroDivisionError)
            return torch.zeros((), dtype=torch.float32, device=p.device)
        t = state["step"].item()
        one_minus_beta2 = t ** group["beta2_decay"]
        rho = min(lr, 1 / (t**0.5))
        alpha = max(eps2, p.norm(2).item() / (p.numel() ** 0.5)) * rho
        if group["weight_decay"] != 0:
            p.mul_(1 - lr * group["weight_decay"])
        if grad.dim() > 1:
            shapes = _statistics(p)
            row_var = self._read(state, "row_var", shapes["row_var"], coded)
            col_var = self._read(state, "col_var", shapes["col_var"], coded)
            row_var.lerp_(torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1)),
                          one_minus_beta2)  # fmt: skip
            col_var.lerp_(torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2)),
                          one_minus_beta2)  # fmt: skip
            estimate = row_var @ col_var
            estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
            self._write(state, "row_var", row_var, coded, seed, int(t))
            self._write(state, "col_var", col_var, coded, seed ^ 0x5BD1E995, int(t))
        else:
            variance = self._read(state, "variance", _statistics(p)["variance"], coded)
            variance.lerp_(grad * grad, one_minus_beta2)
            estimate = variance.clone()
            self._write(state, "variance", variance, coded, seed, int(t))
        update = estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        denom = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * group["d"]))
        if group["beta1"] is None:
            p.add_(update, alpha=-alpha / denom)
        else:  # the kernels' order: m = beta1 m + (1 - beta1) (coef u) in fp32, p -= m, m stored rounded
            p.sub_(momentum.step(state, group["beta1"], update, alpha / denom))
        return update.abs().amax().float() * (alpha / denom)


_TRITON_MOMENTUM = {"bf16": "bfloat16", "fp32": "float32", "int8": "int8"}  # the template's momentum axis


def _statistics(p: Tensor) -> dict[str, tuple[int, ...]]:
    """The second-moment statistics torch.optim.Adafactor keeps for ``p``, with their shapes:
    factored over the last two dims for 2+ dims, per element for a vector or scalar."""
    if p.dim() > 1:
        return {"row_var": (*p.shape[:-1], 1), "col_var": (*p.shape[:-2], 1, p.shape[-1])}
    return {"variance": tuple(p.shape)}


def _as_rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """A statistic's shape as (rows, values): its leading dims, then all its values in a row."""
    values = math.prod(s for s in shape[-2:] if s != 1) if len(shape) >= 2 else math.prod(shape)
    return max(1, math.prod(shape) // max(values, 1)), values


class ReferenceAdafactor(Adafactor):
    """Adafactor on its PyTorch path whatever KERNEL_FACTORY_BACKEND says: the oracle of the fused
    kernels' parity cells."""

    backend = "torch"
