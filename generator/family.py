"""Kernel families as data.

A family names a Jinja template, the structural axes the template branches on
(each rendered combination is a *variant*), and the tunable parameters that
stay ``tl.constexpr`` or launch parameters, so one rendered source serves every
tuned config. One predicate per family says which configs are legal; the same
predicate prunes the tuner's search space and guards the runtime fallback.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

Config = Mapping[str, int | str]


@dataclass(frozen=True)
class Tunable:
    """One tunable parameter: its name as the kernel or launcher takes it,
    the default, and the legal values the tuner may pick from."""

    name: str
    default: int | str
    choices: tuple[int | str, ...]

    def __post_init__(self) -> None:
        if self.default not in self.choices:
            raise ValueError(f"tunable {self.name}: default {self.default} not in {self.choices}")


@dataclass(frozen=True, eq=False)  # families are singletons: identity equality and hash
class KernelFamily:
    """A template plus its axes and tunables.

    ``axes`` maps each structural axis to its allowed values (the first is the
    default). ``tuning_axes`` names the axes that change the memory traffic or
    the loop structure enough to deserve their own tuned config; the others
    (e.g. ``maximize``) share the config of the variant they differ from.
    ``is_legal(config)`` is the single legality predicate. ``tune_sizes`` are the work sizes
    (elements per launch) the tuner measures; lookups in between take the nearest bucket.
    ``nearest_axes``: tuning axes of powers of two that a lookup matches by nearness, after the
    bucket (a tie-break between entries as near in work), rather than exactly.
    ``impl_templates``: for configs whose ``impl`` runs another family's template, that family.
    """

    name: str
    template: str
    axes: Mapping[str, tuple]
    tunables: tuple[Tunable, ...]
    is_legal: Callable[[Config], bool]
    tuning_axes: tuple[str, ...] = ()
    tune_sizes: tuple[int, ...] = ()  # work per launch (elements) the tuner measures at
    description: str = ""
    seed_configs: tuple[Config, ...] = ()  # legal configs every study tries (after the default)
    nearest_axes: tuple[str, ...] = ()
    # impl value -> the family whose template the configs of that impl run (a family of its own so
    # that this one's template hash stays put): the cache keeps that template's hash beside this
    # one's, and an entry of that impl is stale when either changed.
    impl_templates: Mapping[str, str] = field(default_factory=dict)
    _default: Config = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", MappingProxyType(dict(self.axes)))
        default = MappingProxyType({t.name: t.default for t in self.tunables})
        if not self.is_legal(default):
            raise ValueError(f"family {self.name}: its default config {dict(default)} is illegal")
        object.__setattr__(self, "_default", default)
        for config in self.seed_configs:
            self.check_config(config)
        unknown = set(self.tuning_axes) - set(self.axes)
        if unknown:
            raise ValueError(f"family {self.name}: tuning_axes {sorted(unknown)} are not axes")
        if set(self.nearest_axes) - set(self.tuning_axes):
            raise ValueError(f"family {self.name}: nearest_axes {sorted(self.nearest_axes)} must be tuning axes")

    @property
    def default_config(self) -> Config:
        return self._default

    def variant(self, **values) -> Mapping[str, object]:
        """Complete and check a structural variant: unknown axes or values raise ValueError."""
        unknown = set(values) - set(self.axes)
        if unknown:
            raise ValueError(f"family {self.name}: unknown axes {sorted(unknown)}; known: {sorted(self.axes)}")
        out = {}
        for axis, allowed in self.axes.items():
            value = values.get(axis, allowed[0])
            if value not in allowed:
                raise ValueError(f"family {self.name}: axis {axis}={value!r} not in {allowed}")
            out[axis] = value
        return MappingProxyType(out)

    def tuning_key(self, variant: Mapping[str, object]) -> str:
        """The part of a variant that the cache keys on, as a stable string."""
        return ",".join(f"{a}={variant[a]}" for a in self.tuning_axes)

    def tuning_keys(self) -> frozenset[str]:
        """Every ``tuning_key`` the axes allow (a cache entry keyed otherwise is never looked up)."""
        combos = itertools.product(*(self.axes[a] for a in self.tuning_axes))
        return frozenset(self.tuning_key(dict(zip(self.tuning_axes, c, strict=True))) for c in combos)

    def search_space(self) -> list[Config]:
        """Every legal config, in a stable order (the tuner samples from these)."""
        names = [t.name for t in self.tunables]
        combos = itertools.product(*(t.choices for t in self.tunables))
        return [c for c in (dict(zip(names, v, strict=True)) for v in combos) if self.is_legal(c)]

    def check_config(self, config: Mapping[str, int]) -> Config:
        """Return ``config`` as a read-only mapping, or raise ValueError if it is not legal."""
        names = {t.name for t in self.tunables}
        if set(config) != names:
            raise ValueError(f"family {self.name}: config keys {sorted(config)} != {sorted(names)}")
        if not self.is_legal(config):
            raise ValueError(f"family {self.name}: illegal config {dict(config)}")
        return MappingProxyType(dict(config))
