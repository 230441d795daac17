"""Argument checks shared by the optimizers, with torch.optim's error types and wording."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from .buckets import warn_once
from .dtensor import DTensor, local

_STATE_DTYPES = {
    None: None,
    "fp32": torch.float32,
    "float32": torch.float32,
    torch.float32: torch.float32,
}


def check_real(**values) -> None:
    """TypeError naming the first of ``values`` (name=value) that is not a real number (an int or
    float, numpy's included; a bool is not one): the range checks after it would otherwise fail in
    a comparison whose message names no parameter (torch.optim's do)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")


def check_non_negative_int(**values) -> None:
    """ValueError naming the first of ``values`` (name=value) that is not an int >= 0."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def check_lr(lr: float | Tensor) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr.is_floating_point():
            raise TypeError(f"Tensor lr must be floating point, got {lr.dtype}")
        if lr.device.type == "cpu" and not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        return
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise TypeError(f"lr must be a float or a 1-element Tensor, got {type(lr).__name__}")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def check_adam_hyperparameters(lr, betas, eps, weight_decay) -> None:
    """The checks torch.optim.Adam makes, in its order and with its ValueError messages. Unlike
    torch's foreach path, a Tensor lr or Tensor betas are taken with ``foreach=True`` too (the
    kernels read lr on the device; tensor betas must be 1-element CPU tensors, read on the host)."""
    check_lr(lr)
    check_real(eps=eps)
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, Tensor) and beta.numel() != 1:  # torch fails here on bool(tensor)
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
        if not isinstance(beta, Tensor):
            check_real(**{f"betas[{i}]": beta})
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    check_real(weight_decay=weight_decay)
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, Tensor) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, beta in enumerate(betas):
        if isinstance(beta, Tensor) and beta.device.type != "cpu":
            raise ValueError(f"Tensor betas[{i}] must be a CPU tensor (it is read on the host), got {beta.device}")


def check_implementation_flags(*, foreach, fused, capturable, differentiable) -> None:
    """``foreach``/``fused`` are accepted for drop-in compatibility (this optimizer always
    fuses); their types and the torch rule that they exclude each other are checked."""
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be None or a bool, got {value!r}")
    if not isinstance(capturable, bool):
        raise TypeError(f"capturable must be a bool, got {capturable!r}")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if differentiable:
        raise ValueError(
            "differentiable=True is not supported: the fused kernels update parameters in place "
            "outside autograd; use torch.optim.AdamW(differentiable=True) for that"
        )


def resolve_state_dtype(state_dtype) -> torch.dtype | None:
    """``None`` keeps torch's convention (state in the parameter dtype); ``"fp32"`` or
    ``torch.float32`` keeps fp32 state for bf16/fp16 parameters."""
    try:
        return _STATE_DTYPES[state_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"state_dtype must be None, 'fp32' or torch.float32, got {state_dtype!r}") from None


def check_param_grad(index: int, p: Tensor, g: Tensor) -> None:
    """Reject what the fused kernels cannot update correctly, naming the parameter."""
    where = f"parameter {index} (shape {tuple(p.shape)}, {p.dtype})"
    if g.is_sparse or p.is_sparse:
        raise RuntimeError(f"{where}: sparse gradients are not supported; use torch.optim.SparseAdam")
    if p.is_complex() or g.is_complex():
        raise TypeError(f"{where}: complex parameters are not supported; use torch.view_as_real")
    if not p.is_floating_point():
        raise TypeError(f"{where}: only floating point parameters can be optimized")
    if g.shape != p.shape:
        raise ValueError(f"{where}: grad shape {tuple(g.shape)} does not match the parameter")
    if g.dtype != p.dtype:
        raise TypeError(f"{where}: grad dtype {g.dtype} does not match the parameter dtype")
    if g.device != p.device:
        raise ValueError(f"{where}: grad is on {g.device}, the parameter on {p.device}")
    if p.is_meta:
        raise RuntimeError(f"{where} is on the meta device: materialize the model before stepping")


def check_params_once(optimizer: torch.optim.Optimizer) -> None:
    """``check_params_are_live`` on an optimizer's first step, and again after ``add_param_group``."""
    groups = len(optimizer.param_groups)
    if getattr(optimizer, "_groups_checked", 0) != groups:
        check_params_are_live(optimizer.param_groups, type(optimizer).__name__)
        optimizer._groups_checked = groups


def warn_if_nothing_stepped(optimizer: torch.optim.Optimizer, stepped: bool) -> None:
    """One warning when a step under torch.distributed found no gradient at all: the mark of an
    optimizer built before ``fully_shard`` on a torch whose FSDP2 leaves no tag on the parameters it
    replaces (torch 2.11; ``check_params_are_live`` catches it on torch 2.13)."""
    if not stepped and torch.distributed.is_available() and torch.distributed.is_initialized():
        warn_once(f"{type(optimizer).__name__}.step() found no parameter with a gradient; if fully_shard (FSDP2) "
                  "wrapped the model after the optimizer was built, the optimizer holds the parameters it "
                  "replaced: build it after fully_shard(model)")  # fmt: skip


def check_params_are_live(param_groups: list[dict], optimizer: str) -> None:
    """RuntimeError naming the first parameter the model no longer uses, so that it would never get
    a gradient and the step would silently skip it: a meta-device parameter (``to_empty`` and
    ``load_state_dict(assign=True)`` replace them), or one that ``fully_shard`` replaced with a
    DTensor parameter (FSDP2 tags the originals with ``_fsdp_orig_uid``). Call on the first step."""
    for gi, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            where = f"{optimizer}: parameter {i} of param group {gi} (shape {tuple(p.shape)})"
            if p.is_meta:
                raise RuntimeError(f"{where} is on the meta device; build the optimizer after the model is "
                                   "materialized (to_empty and initialization replace meta parameters)")  # fmt: skip
            if hasattr(p, "_fsdp_orig_uid") and not isinstance(p, DTensor):
                raise RuntimeError(f"{where} was replaced by fully_shard (FSDP2); build the optimizer after "
                                   "fully_shard(model), from model.parameters()")  # fmt: skip


def start_step(optimizer: torch.optim.Optimizer, closure):
    """What every ``step()`` does first: ``closure()``'s loss (``evaluate_closure``), the first
    step's checks (``check_params_once``) and the warning for a step with no gradient at all."""
    loss = evaluate_closure(closure)
    check_params_once(optimizer)
    warn_if_nothing_stepped(optimizer, any(p.grad is not None for g in optimizer.param_groups for p in g["params"]))
    return loss


def evaluate_closure(closure):
    """``closure()`` with autograd on (optimizers step under no_grad), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def checked_grads(params: list[Tensor]) -> list[Tensor]:
    """The grads of ``params`` (their local shards for DTensors), each checked against its
    parameter's by ``check_param_grad`` (index, shape, dtype, device, sparse, complex)."""
    grads = [local(p.grad) for p in params]
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        check_param_grad(i, local(p), g)
    return grads
