"""Pickling and ``copy.deepcopy`` of an optimizer that keeps settings outside its param groups.

``torch.optim.Optimizer`` pickles ``defaults``, ``state`` and ``param_groups`` alone, and its
``__setstate__`` restores only those: an attribute set in ``__init__`` (a rounding seed, a model's
block partition) would be lost, and the launch plans, telemetry and device buffers built for the
step would be missing, so the copy's first ``step()`` would fail. ``KeepsSettings`` pickles the
attributes a class names in ``_settings`` beside torch's three, and rebuilds what the step
caches (``_new_caches``), as a fresh optimizer would before its first step.
"""

from __future__ import annotations

_KEY = "kernel_factory_settings"


class KeepsSettings:
    """Mixin for a ``torch.optim.Optimizer`` subclass (listed before it): ``_settings`` are the
    attributes pickled with it; ``_new_caches()`` (re)creates the step's caches, called by
    ``__init__`` and after unpickling."""

    _settings: tuple[str, ...] = ()

    def _new_caches(self) -> None:
        """Create the step's caches (plans, telemetry, buffers): each optimizer's own."""
        raise NotImplementedError

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state[_KEY] = {name: getattr(self, name) for name in self._settings}
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickling: torch's three, the settings, new caches. torch's ``load_state_dict`` calls
        this too, with the state and param groups alone: the settings and caches stay as they
        are (each optimizer's ``load_state_dict`` drops the plans that held the old tensors)."""
        state = dict(state)
        settings = state.pop(_KEY, None)
        super().__setstate__(state)
        if settings is None:
            if all(name in self.__dict__ for name in self._settings):
                return
            raise RuntimeError(f"{type(self).__name__}: the pickled optimizer lacks its settings "
                               "(pickled by another version?); build a new one and use load_state_dict")  # fmt: skip
        self.__dict__.update(settings)
        self._new_caches()
