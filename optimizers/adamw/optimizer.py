"""Adam and AdamW with fused Triton kernels, drop-in for torch.optim.Adam / AdamW.

Same arguments, ValueErrors and state_dict as torch.optim (``step``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``), so checkpoints move both ways.
CUDA tensors take the tuned Triton kernel (one launch per param group and
dtype); CPU tensors take torch's fused CPU kernel. ``GradScaler`` passes
``grad_scale``/``found_inf``, which the kernel applies (unscale, skip on inf). ``telemetry``
counts steps and skipped steps on the device and gives the last step's largest |update|.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from ..shared import precompile
from ..shared.checks import (
    check_adam_hyperparameters,
    check_implementation_flags,
    check_params_once,
    evaluate_closure,
    resolve_state_dtype,
    warn_if_nothing_stepped,
)
from ..shared.eager import eager_step
from ..shared.state_dict import checked_load, own_loaded_state
from ..shared.telemetry import AMAX_UPDATE, SKIPPED_STEPS, TOTAL, Telemetry
from .plan import AdamGroupPlan, group_plan, init_group_state

_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
TELEMETRY = {**AMAX_UPDATE, SKIPPED_STEPS: TOTAL}


class Adam(torch.optim.Optimizer):
    """Adam (L2 weight decay, or decoupled with ``decoupled_weight_decay=True``).

    Args: as ``torch.optim.Adam``, with its checks and messages: ``params`` (tensors,
    (name, tensor) pairs or param-group dicts), ``lr`` (float or 1-element tensor), ``betas``
    (both floats or both 1-element CPU tensors), ``eps``, ``weight_decay``, ``amsgrad``,
    ``maximize``, ``capturable``, ``foreach``/``fused`` (accepted and checked; the step is always
    fused, so a Tensor lr or Tensor betas work with ``foreach=True`` too, where torch's foreach
    path refuses them), ``differentiable`` (must be False), ``decoupled_weight_decay``. Extra:
    ``state_dtype=None`` keeps state in the parameter dtype like torch; ``"fp32"`` keeps fp32
    moments for bf16/fp16 parameters (+8 bytes/param of traffic, better precision).

    Parameters: fp32, bf16, fp16 (fp64 takes the reference path); grads of the
    same shape, dtype and device.

    ``telemetry.summary()``: ``steps``, ``skipped_steps`` (GradScaler's found_inf), the last
    step's ``amax_update`` (max |lr m̂ / (√v̂ + ε)|, computed from the state when asked), and
    ``step_ms_mean`` / ``step_ms_last`` with ``telemetry.time_steps = True`` (CUDA events).
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf
    backend: str | None = None  # None: KERNEL_FACTORY_BACKEND decides; subclasses may pin it

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        state_dtype: str | torch.dtype | None = None,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        check_implementation_flags(
            foreach=foreach, fused=fused, capturable=capturable, differentiable=differentiable
        )
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        # Groups carry torch.optim.AdamW's keys only, unless fp32 state is asked for: DCP's loads
        # are strict about missing keys, so a torch checkpoint loads into a group with no extra key.
        if resolve_state_dtype(state_dtype) is not None:
            defaults["state_dtype"] = "fp32"
        super().__init__(precompile.begin(params), defaults)
        self._plans: dict[int, AdamGroupPlan] = {}
        self.telemetry = Telemetry(TELEMETRY)
        self._prebuild_plans()

    def _prebuild_plans(self) -> None:
        """Launch plans built now, their kernels compiling in the background (precompile.plan_ahead)."""
        precompile.plan_ahead(self, lambda index, group, params: group_plan(self._plans, index, params, self.state,
                                                                            group, self.backend))  # fmt: skip

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in (("amsgrad", False), ("maximize", False), ("foreach", None),
                               ("capturable", False), ("differentiable", False), ("fused", None),
                               ("decoupled_weight_decay", isinstance(self, AdamW))):  # fmt: skip
                group.setdefault(key, value)
        self._plans = {}
        self.telemetry = Telemetry(TELEMETRY)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then the new params' state is created (``init_group_state``)."""
        super().add_param_group(param_group)
        init_group_state(self.param_groups[-1], self.state)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader (which also takes DCP's name-keyed state dicts); the state becomes this
        optimizer's own copy, with fp32 moments kept where ``state_dtype='fp32'`` (torch casts
        state to the parameter dtype); launch plans are rebuilt on the next step."""
        with checked_load(self):
            super().load_state_dict(state_dict)
            fp32_state = {id(p) for g in self.param_groups if g.get("state_dtype") == "fp32" for p in g["params"]}
            own_loaded_state(self, state_dict, lambda p, key, saved: id(p) in fp32_state and key in _STATE_KEYS
                             and saved.dtype == torch.float32)  # fmt: skip
        self._plans = {}

    @eager_step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One fused update of every parameter that has a grad. Returns ``closure()``'s loss."""
        loss = evaluate_closure(closure)
        check_params_once(self)
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        stepped = False
        with self.telemetry.step(self.param_groups[0]["params"][0].device, found_inf) as telemetry:
            for index, group in enumerate(self.param_groups):
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                plan = group_plan(self._plans, index, params, self.state, group, self.backend)
                plan.run(group, grad_scale, found_inf)
                telemetry.watch("amax_update", plan.update_amax)
                stepped = True
        warn_if_nothing_stepped(self, stepped)
        return loss


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay (default ``weight_decay=1e-2``), drop-in for
    ``torch.optim.AdamW``; see :class:`Adam` for arguments, dtypes and backends."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_dtype: str | torch.dtype | None = None,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
            capturable=capturable, differentiable=differentiable, fused=fused,
            decoupled_weight_decay=True, state_dtype=state_dtype,
        )  # fmt: skip


class ReferenceAdam(Adam):
    """:class:`Adam` pinned to the pure PyTorch reference (fp32 math for fp16/bf16 params):
    the parity oracle, e.g. for fp16 where torch's CPU kernel computes in half precision."""

    backend = "torch"


class ReferenceAdamW(AdamW):
    """:class:`AdamW` pinned to the pure PyTorch reference; see :class:`ReferenceAdam`."""

    backend = "torch"
