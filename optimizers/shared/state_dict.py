"""Helpers for optimizers' ``load_state_dict``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

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


def shape_mismatch(key: str, index: int, group: int, p: Tensor, value: Tensor, keeps: tuple[int, ...]) -> ValueError:
    """The error for a loaded state tensor ``value`` (under ``key``, of parameter ``index`` of param
    group ``group``) whose shape is not ``keeps``, the shape the optimizer keeps for ``p``."""
    return ValueError(f"load_state_dict: state {key!r} of parameter {index} of group {group} (shape {tuple(p.shape)}) "
                      f"has shape {tuple(value.shape)}, where this optimizer keeps {tuple(keeps)}: a state dict of "
                      "another model?")  # fmt: skip


def _state_shapes(optimizer) -> dict[int, dict[str, tuple[int, ...]]]:
    """The shape of each state tensor (a DTensor's global shape), by ``id`` of its parameter."""
    return {id(p): {key: tuple(value.shape) for key, value in state.items() if isinstance(value, Tensor)}
            for p, state in optimizer.state.items()}  # fmt: skip


@contextlib.contextmanager
def checked_load(optimizer) -> Iterator[None]:
    """Around a ``load_state_dict`` (torch's loader and the optimizer's own conversions): a loaded
    state tensor whose shape is not the one the optimizer had made under that name for its
    parameter (a state dict of another model or layout, which the kernels, indexing state by the
    parameter's shape, would read and write past) raises ValueError, and the optimizer keeps the
    state and param groups it had (torch's loader replaces both objects; the old ones are put back)."""
    before, state, groups = _state_shapes(optimizer), optimizer.state, optimizer.param_groups
    try:
        yield
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                expected = before.get(id(p), {})
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, Tensor) and key in expected and tuple(value.shape) != expected[key]:
                        raise shape_mismatch(key, pi, gi, p, value, expected[key])
    except BaseException:
        optimizer.state, optimizer.param_groups = state, groups
        raise
