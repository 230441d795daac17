"""Muon with batched Newton–Schulz, and AdamW for the parameters Muon is not for, in one step().

Muon's math and arguments are torch.optim.Muon's (torch 2.13): per hidden matrix,

    B ← B + (1 − μ)(g − B);   U = g + μ(B − g) if nesterov else B;   O = NS(U)
    p ← p · (1 − lr·wd);      p ← p − lr·adjust(shape)·O

with adjust "original" = sqrt(max(1, A/B)) and "match_rms_adamw" = 0.2·sqrt(max(A, B)) for an
A x B matrix. What torch.optim.Muon leaves to the user is done here: matrices of one shape are
orthogonalized in one batched NS call; conv weights are flattened to (out, in·kh·kw); parameters
that are not hidden matrices (ndim < 2, or a name with embed/embd/wte/wpe/lm_head) go to
param groups updated by the factory AdamW (its own lr, betas, eps, weight decay) in the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from ..shared import precompile
from ..shared.checks import (
    check_adam_hyperparameters,
    check_lr,
    check_real,
    start_step,
)
from ..shared.dtensor import DTensor
from ..shared.eager import eager_step
from ..shared.picklable import KeepsSettings
from ..shared.state_dict import checked_load, own_loaded_state
from ..shared.steppers import GroupPlan, group_state_init, group_stepper
from ..shared.telemetry import AMAX_UPDATE, Telemetry
from .distributed import sharded_muon_group_plan
from .newton_schulz import DEFAULT_EPS, NS5_COEFFICIENTS, coefficient_schedule
from .plan import init_muon_group_state, muon_group_plan

ADAMW_NAMES = ("embed", "embd", "wte", "wpe", "lm_head")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# Keys the AdamW stepper reads from a group (adamw/plan.py, looked up by name in the stepper table),
# fixed for Muon's AdamW groups.
_ADAMW_FIXED = dict(amsgrad=False, maximize=False, decoupled_weight_decay=True)


def uses_muon(name: str | None, p: Tensor, adamw_names: Iterable[str] = ADAMW_NAMES) -> bool:
    """A hidden matrix (Muon) or not (AdamW): ndim >= 2 and no AdamW name substring (lower case)."""
    if p.dim() < 2:
        return False
    lowered = (name or "").lower()
    return not any(s in lowered for s in adamw_names)


class Muon(KeepsSettings, torch.optim.Optimizer):
    """Muon for hidden matrices, AdamW for the rest.

    Args: as ``torch.optim.Muon``: ``params`` (tensors, (name, tensor) pairs as from
    ``model.named_parameters()``, or group dicts), ``lr``, ``weight_decay``, ``momentum``,
    ``nesterov``, ``ns_coefficients`` (a triple, ``"polar_express"`` or one triple per step),
    ``eps``, ``ns_steps``, ``adjust_lr_fn``. Extra, for the AdamW part: ``adamw_lr``,
    ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay``; ``adamw_names`` (name substrings sent to
    AdamW). A group dict may set ``use_muon`` (True/False) to override the split.

    Parameters: fp32/bf16/fp16 of any ndim (Muon's: >= 2, viewed as (shape[0], rest); complex ones
    raise torch.optim.Muon's RuntimeError). Each group given becomes up to two groups, Muon's and
    AdamW's (``param_groups[i]["use_muon"]``), so LR schedulers and state_dict see both.

    ``telemetry.summary()``: ``steps`` (counted on the device, CUDA graph replays included), the
    last step's ``amax_update`` (max |adjusted lr · O| over Muon's matrices and max
    |lr m̂ / (√v̂ + ε)| over AdamW's, weight decay left out), and step times with
    ``telemetry.time_steps = True``. Like torch.optim.Muon it takes no ``found_inf``: GradScaler
    checks for infs and skips ``step()`` itself, so ``steps`` counts the steps that ran.
    """

    _settings = ("adamw_names", "adamw_defaults")  # pickled (KeepsSettings): add_param_group splits with them
    _constructing = False  # True while torch's __init__ adds the constructor's groups

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients=NS5_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        adamw_names: Iterable[str] = ADAMW_NAMES,
    ) -> None:
        check_lr(lr)
        check_real(momentum=momentum, weight_decay=weight_decay, eps=eps)
        if isinstance(adamw_names, str):  # iterated, a string would give its letters
            raise TypeError(f"adamw_names must be an iterable of name substrings, not a str: got {adamw_names!r}; "
                            f"write ({adamw_names!r},)")  # fmt: skip
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        coefficient_schedule(ns_coefficients, ns_steps)  # validates both
        check_adam_hyperparameters(adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay)
        self.adamw_names = tuple(s.lower() for s in adamw_names)
        self.adamw_defaults = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                                   weight_decay=adamw_weight_decay, **_ADAMW_FIXED)  # fmt: skip
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        use_muon=True)  # fmt: skip
        self._new_caches()  # (the constructor's groups plan in add_param_group)
        self._constructing = True  # torch's __init__ adds the groups split here one by one
        super().__init__(self._split_groups(precompile.begin(params)), defaults)
        self._constructing = False
        # plans built now, kernels compiling in the background; those built in add_param_group are
        # found cached
        precompile.plan_ahead(self, self._plan_ahead)

    def _plan_ahead(self, index: int, group: dict, params: list[Tensor]) -> None:
        """Group ``index``'s plan for ``params``, built as the first step would (FSDP2's matrices
        are left to the step), its kernels queued for their background compile."""
        if not group["use_muon"]:
            group_stepper("adamw")(self._plans, index, params, self.state, group)
        elif not any(isinstance(p, DTensor) for p in params):
            muon_group_plan(self._plans, index, params, self.state).precompile(group)

    def _split_groups(self, params) -> list[dict]:
        """Each group given as up to two groups, Muon's and AdamW's, with torch.optim's errors for
        a bare tensor, an empty list, a set and names on some params only; (name, tensor) pairs
        keep their names (torch records them as the groups' ``param_names``)."""
        if isinstance(params, Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                            "but got " + torch.typename(params))  # fmt: skip
        items = list(params)
        if not items:
            raise ValueError("optimizer got an empty parameter list")
        groups = items if isinstance(items[0], dict) else [{"params": items}]
        out = []
        for group in groups:
            if isinstance(group["params"], set):
                raise TypeError("optimizer parameters need to be organized in ordered collections, but the "
                                "ordering of tensors in sets will change between runs. Please use a list instead.")
            entries = [group["params"]] if isinstance(group["params"], Tensor) else list(group["params"])
            named = [isinstance(e, tuple) for e in entries]
            if any(named) and not all(named):
                raise ValueError("all optimizer params should be with/without names. Some param names are missing")
            forced = group.get("use_muon")
            split = {True: [], False: []}
            for entry in entries:
                name, p = entry if isinstance(entry, tuple) else (None, entry)
                if not isinstance(p, Tensor):
                    raise TypeError("optimizer can only optimize Tensors, but one of the params is "
                                    + torch.typename(p))  # fmt: skip
                muon = uses_muon(name, p, self.adamw_names) if forced is None else bool(forced)
                if muon and p.dim() < 2:
                    raise ValueError(f"use_muon=True needs parameters with ndim >= 2, got shape {tuple(p.shape)}"
                                     + (f" ({name})" if name else ""))  # fmt: skip
                split[muon].append(entry)
            rest = {k: v for k, v in group.items() if k not in ("params", "use_muon")}
            if split[True]:
                out.append({**rest, "params": split[True], "use_muon": True})
            if split[False]:
                adamw = {**self.adamw_defaults, **{k[6:]: v for k, v in rest.items() if k.startswith("adamw_")}}
                out.append({**adamw, "params": split[False], "use_muon": False})
        return out

    def _new_caches(self) -> None:
        self._plans: dict[int, GroupPlan] = {}  # by group index
        self.telemetry = Telemetry(AMAX_UPDATE)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, for each group the constructor makes of ``param_group`` (Muon's matrices and
        AdamW's rest, or all on the side its ``use_muon`` names, with the constructor's errors; an
        empty group as it is), then the new params' state (momentum buffers, or AdamW's moments)."""
        groups = [param_group] if self._constructing else self._split_groups([param_group]) or [param_group]
        for group in groups:
            if self._constructing:
                self._plan_before_torch(len(self.param_groups), group)
            super().add_param_group(group)
            added = self.param_groups[-1]
            (init_muon_group_state if added["use_muon"] else group_state_init("adamw"))(added, self.state)

    def _plan_before_torch(self, index: int, group: dict) -> None:
        """A constructor's group ``index`` planned before torch adds it (precompile.plan_group), so
        that its kernels compile while torch.optim's first add_param_group imports torch._dynamo:
        the group as torch will hold it (the defaults filled in, names apart; the plan makes the
        params' state, found there once torch has added the group). A group torch then refuses
        fails the constructor, plan and all."""
        entries = [group["params"]] if isinstance(group["params"], Tensor) else list(group["params"])
        planned = {**self.defaults, **group, "params": [e[1] if isinstance(e, tuple) else e for e in entries]}
        precompile.plan_group(self, self._plan_ahead, index, planned, planned["params"])

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader (which also takes DCP's name-keyed state dicts, and casts the momentum to
        the parameter's dtype); the state becomes this optimizer's own copy; launch plans are
        rebuilt on the next step."""
        with checked_load(self):
            super().load_state_dict(state_dict)
            own_loaded_state(self, state_dict, lambda p, key, saved: False)
        self._plans = {}

    @eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One Muon/AdamW update of every parameter with a grad. Returns ``closure()``'s loss."""
        loss = start_step(self, closure)
        with self.telemetry.step(self.param_groups[0]["params"][0].device) as telemetry:
            # FSDP2's matrices: an owner rank per matrix (distributed.py). Their all-to-alls to the
            # owners move while the other groups step; the last replies while the first are applied.
            sharded_plans = []
            for index, group in enumerate(self.param_groups):
                sharded = [p for p in group["params"] if p.grad is not None and isinstance(p, DTensor)]
                if group["use_muon"] and sharded:
                    plan = sharded_muon_group_plan(self._plans, index, sharded, self.state)
                    plan.send(group)
                    sharded_plans.append(plan)
            for index, group in enumerate(self.param_groups):
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                if group["use_muon"]:
                    # One batch per NS shape (plan.py): same-shape matrices, tall ones transposed (NS of
                    # Xᵀ is NS(X)ᵀ, and torch's own NS transposes a tall matrix the same way).
                    plan = muon_group_plan(self._plans, index, [p for p in params if not isinstance(p, DTensor)],
                                           self.state)  # fmt: skip
                    plan.run(group)
                else:
                    plan = group_stepper("adamw")(self._plans, index, params, self.state, group)
                    plan.run(group, None, None)
                telemetry.watch("amax_update", plan.update_amax)
            for plan in sharded_plans:
                plan.start()
            for plan in sharded_plans:
                plan.finish()
                telemetry.watch("amax_update", plan.update_amax)
        return loss
