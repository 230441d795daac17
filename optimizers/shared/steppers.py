"""The table of group steppers: how a family steps one param group, for optimizers that combine
families by name (Muon steps the parameters that are not hidden matrices with AdamW's stepper).

A family registers its stepper when its package is imported; ``kernel_factory.optimizers`` imports
every family, so the table is full by the time any optimizer runs. A combining family looks a
stepper up by name and imports no module of the other family.

A stepper is ``stepper(plans, index, params, state, group) -> plan``: the cached launch plan of
param group ``index`` (``plans`` maps group indices to plans; the stepper rebuilds the entry when
the params with grads change), whose ``plan.run(group, grad_scale, found_inf)`` steps it and
``plan.update_amax()`` returns the last step's largest |update| (0-d tensor, computed when called).
A family registers with it ``init_state(group, state)``, which creates the state of the group's
parameters up front (optimizers create state eagerly: DCP fakes a step on one that has none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor


class GroupPlan(Protocol):
    def run(self, group: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> None: ...

    def update_amax(self) -> Tensor: ...


GroupStepper = Callable[[dict, int, list[Tensor], dict, dict], GroupPlan]
StateInit = Callable[[dict, dict], None]
_STEPPERS: dict[str, tuple[GroupStepper, StateInit]] = {}


def register_group_stepper(family: str, stepper: GroupStepper, init_state: StateInit) -> None:
    """Make ``stepper`` the way to step a param group of ``family``, and ``init_state`` the way to
    create its state."""
    _STEPPERS[family] = (stepper, init_state)


def _registered(family: str) -> tuple[GroupStepper, StateInit]:
    try:
        return _STEPPERS[family]
    except KeyError:
        raise KeyError(f"no group stepper registered for {family!r}; registered: {sorted(_STEPPERS)}") from None


def group_stepper(family: str) -> GroupStepper:
    """The registered stepper of ``family``; KeyError naming the registered ones if it has none."""
    return _registered(family)[0]


def group_state_init(family: str) -> StateInit:
    """The registered ``init_state(group, state)`` of ``family`` (KeyError as ``group_stepper``)."""
    return _registered(family)[1]
