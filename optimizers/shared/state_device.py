"""State made before the model moved or was cast: torch.optim makes state at the first step, so
``model.to(...)`` after building the optimizer never meets it; our optimizers make state with the
optimizer (DCP reads it before any step), so the state must follow its parameter when a plan is
built, or the kernels would be handed another device's pointers."""

from __future__ import annotations

from collections.abc import Container

from torch import Tensor


def follow_param(p: Tensor, state: dict, host: Container[str] = (), param_dtype: Container[str] = ()) -> None:
    """Move every tensor of ``state`` (one plain, unsharded parameter's) to ``p``'s device, but
    those under ``host`` keys (a step count kept on the CPU); cast those under ``param_dtype``
    keys (statistics kept in the parameter's dtype) to ``p.dtype``. Other dtypes are kept: codes,
    scales and fp32 moments do not depend on the parameter's."""
    for key, value in state.items():
        if not isinstance(value, Tensor) or key in host:
            continue
        dtype = p.dtype if key in param_dtype else value.dtype
        if value.device != p.device or value.dtype != dtype:
            state[key] = value.to(device=p.device, dtype=dtype)
