"""Helpers for optimizers' ``load_state_dict``."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def saved_params(state_dict: dict, param_groups: list[dict]) -> dict[object, Tensor]:
    """The parameter each key of ``state_dict["state"]`` belongs to, by torch.optim's rule: the
    i-th entry of the j-th saved group's ``params`` is the i-th parameter of the j-th group. The
    keys are indices in ``Optimizer.state_dict()`` and parameter names in DCP's
    ``get_optimizer_state_dict``; either works."""
    return {key: p for saved, group in zip(state_dict["param_groups"], param_groups, strict=True)
            for key, p in zip(saved["params"], group["params"], strict=True)}  # fmt: skip


def own_loaded_state(optimizer, state_dict: dict, keep_saved_dtype: Callable[[Tensor, str, Tensor], bool]) -> None:
    """Call after torch's ``Optimizer.load_state_dict``: every state tensor of the loaded entries
    becomes the optimizer's own copy, on its parameter's device, in its saved dtype where
    ``keep_saved_dtype(param, key, saved)`` says so, else as torch cast it (floating state to the
    parameter's dtype). torch keeps a saved tensor itself where no cast is needed, so a state dict
    still in use elsewhere (DCP's in-memory one, another optimizer's state) would be stepped by
    both."""
    owner = saved_params(state_dict, optimizer.param_groups)
    for key, saved in state_dict["state"].items():
        p = owner[key]
        state = optimizer.state[p]
        for name, value in saved.items():
            if isinstance(value, Tensor):
                source = value if keep_saved_dtype(p, name, value) else state[name]
                state[name] = source.to(p.device, copy=True)
