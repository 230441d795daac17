"""Tuned-config lookup from ``autotune_cache/<arch>.json`` (schema in DESIGN.md).

Lookup order for (family, tuning key, dtype, size) on a GPU: entries tuned on this GPU (its name,
e.g. "NVIDIA H100 80GB HBM3"), then entries of the same architecture tuned on another GPU (one
warning), then the family default (one warning); among a GPU's entries, the exact size bucket,
else the nearest (in log2 distance). An entry without a ``device`` was tuned on the GPU its
file's ``environment`` names. A user overlay (``<user cache dir>/<arch>.json``) wins over the
packaged file entry by entry.
Entries tuned on another template source (hash mismatch) are ignored with one
warning; an unreadable or corrupt file gives one warning and the defaults.
Each file is read once per process and each key resolved once: after the first
lookup of a key, selection is a dict hit with no file I/O.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path

from .atomic import write_text_atomic
from .families import get_family
from .family import Config, KernelFamily
from .render import template_hash, user_cache_dir

SCHEMA_VERSION = 1
_CACHE_PACKAGE = "kernel_factory.autotune_cache"
_selected: dict[tuple, Config] = {}
_warned: set[tuple] = set()


def size_bucket(numel: int) -> int:
    """Next power of two of the work per launch (elements), at least 1."""
    return 1 << max(0, int(numel) - 1).bit_length()


def packaged_cache_path(arch: str) -> Path:
    return Path(str(resources.files(_CACHE_PACKAGE).joinpath(f"{arch}.json")))


def overlay_cache_path(arch: str) -> Path:
    return user_cache_dir() / f"{arch}.json"


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _entry_key(e: dict) -> tuple:
    """What identifies an entry in a file: family, variant, dtype, bucket and the GPU it was tuned on."""
    return e["family"], e["variant"], e["dtype"], int(e["bucket"]), e.get("device")


def _read_raw(path: Path, warn: bool = True) -> tuple[list[dict], dict[str, str]]:
    """A cache file's entries, each with its ``device`` (the file's GPU where the entry names
    none), and its template hashes, whatever template each family was tuned on; ([], {}) if
    absent or unreadable (one warning unless ``warn`` is false)."""
    if not path.exists():
        return [], {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA_VERSION}")
        entries, hashes = data["entries"], dict(data["template_hashes"])
        file_gpu = (data.get("environment") or {}).get("gpu")
        return [{"device": file_gpu, **entry} for entry in entries], hashes
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        if warn:
            _warn_once(("corrupt", str(path)), f"kernel_factory: ignoring tuning cache {path}: {exc}")
        return [], {}


def _current_hash(family: str) -> str | None:
    """The template hash of ``family`` in this tree, None for a family it does not have."""
    try:
        return template_hash(get_family(family))
    except KeyError:
        return None


def _companion(entry: dict) -> str | None:
    """The family whose template ``entry``'s config also runs (its family's ``impl_templates``)."""
    config = entry.get("config")
    impl = config.get("impl") if isinstance(config, dict) else None
    return get_family(entry["family"]).impl_templates.get(impl)


def _companions(families: Iterable[str]) -> set[str]:
    """The companion families (``impl_templates``) of ``families``."""
    return {c for f in families if _current_hash(f) is not None for c in get_family(f).impl_templates.values()}


def _read(path: Path, arch: str, warn: bool = True) -> list[dict]:
    """Entries of one cache file whose template hash is current, each with its ``device`` (the
    file's GPU where the entry names none); [] if absent or unreadable (each with one warning
    unless ``warn`` is false)."""
    entries, hashes = _read_raw(path, warn)
    fresh = []
    for entry in entries:
        family = entry.get("family")
        current = _current_hash(family)
        if current is None:
            continue
        companion = _companion(entry)
        if hashes.get(family) != current or (companion and hashes.get(companion) != _current_hash(companion)):
            if not warn:
                continue
            _warn_once(
                ("stale", str(path), family),
                f"kernel_factory: {path} was tuned on another version of the {family!r} "
                f"template; its entries are ignored (re-tune with `nox -s tune -- --arch {arch}`)",
            )
            continue
        fresh.append(entry)
    return fresh


def prior_configs(path: Path, device: str | None = None) -> dict[tuple, dict]:
    """Configs of the entries in the cache file at ``path`` by (family, variant, dtype, bucket),
    whatever template version they were tuned on, those tuned on ``device`` first: starting
    points for a re-tune, never used to launch. {} if the file is absent or unreadable."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        file_gpu = (data.get("environment") or {}).get("gpu")
        entries = sorted(data["entries"], key=lambda e: e.get("device", file_gpu) == device)  # own GPU's last
        return {(e["family"], e["variant"], e["dtype"], int(e["bucket"])): dict(e["config"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def trials_on_device(paths: Iterable[Path], arch: str, device: str | None) -> dict[tuple, int]:
    """Trials of the usable entries (current template) tuned on ``device`` in the cache files
    ``paths``, by (family, variant, dtype, bucket); the larger count where two files hold a key.
    What ``tune --fewer-trials-than`` reads to find the studies worth running on."""
    trials: dict[tuple, int] = {}
    for path in paths:
        for e in _read(Path(path), arch, warn=False):
            if e.get("device") == device:
                key = _entry_key(e)[:4]
                trials[key] = max(trials.get(key, 0), int(e.get("trials") or 0))
    return trials


@cache
def load_entries(arch: str) -> tuple[dict, ...]:
    """All usable entries for ``arch``: overlay entries replace packaged ones with the same key."""
    merged: dict[tuple, dict] = {}
    for path in (packaged_cache_path(arch), overlay_cache_path(arch)):
        for e in _read(path, arch):
            merged[_entry_key(e)] = e
    return tuple(merged.values())


@cache
def current_device() -> str | None:
    """The name of this process's CUDA GPU (the entries' ``device``), None without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def clear() -> None:
    """Forget everything read or selected (tests, and the tuner after it writes a file)."""
    load_entries.cache_clear()
    _selected.clear()
    _warned.clear()


def select(
    family: KernelFamily | str,
    arch: str,
    variant: Mapping[str, object],
    dtype: str,
    numel: int,
    device: str | None = None,
) -> Config:
    """The config to launch ``family``'s ``variant`` with for ``numel`` elements of ``dtype`` on ``arch``,
    on the GPU named ``device`` (default: this process's; None on the CPU: any GPU's entries)."""
    family = get_family(family) if isinstance(family, str) else family
    device = device if device is not None or arch == "cpu" else current_device()
    tkey = family.tuning_key(variant)
    bucket = size_bucket(numel)
    key = (family.name, arch, tkey, dtype, bucket, device)
    config = _selected.get(key)
    if config is not None:
        return config
    near = {a: int(variant[a]) for a in family.nearest_axes}
    candidates = [
        e
        for e in load_entries(arch)
        if e["family"] == family.name and e["dtype"] == dtype and _same_variant(e["variant"], tkey, near)
    ]
    own = [e for e in candidates if e["device"] == device]
    if candidates and not own and device is not None:  # one warning for all families
        tuned_on = sorted({str(e["device"]) for e in candidates})
        _warn_once(("other gpu", arch, device),
                   f"kernel_factory: some {arch} configs were tuned on {', '.join(tuned_on)}, not on this "
                   f"{device}; using theirs (tune this GPU with `nox -s tune -- --arch {arch}`)")  # fmt: skip
    candidates = own or sorted(candidates, key=lambda e: str(e["device"]))  # another GPU's: a fixed order
    config = None
    if candidates:
        best = min(candidates, key=lambda e: (abs(math.log2(int(e["bucket"])) - math.log2(bucket)),
                                              _distance(e["variant"], near)))  # fmt: skip
        try:
            config = family.check_config(best["config"])
        except (ValueError, TypeError) as exc:
            _warn_once(("illegal", arch, family.name), f"kernel_factory: cached config ignored: {exc}")
    if config is None and arch != "cpu":  # nothing is tuned for the interpreter
        _warn_once(
            ("default", arch, family.name),
            f"kernel_factory: no tuned {family.name!r} config for {arch}; using the family default "
            f"{dict(family.default_config)} (tune with `nox -s tune -- --arch {arch}`)",
        )
    if config is None:
        config = family.default_config
    _selected[key] = config
    return config


def _fields(tkey: str) -> dict[str, str]:
    """A tuning key's axis values: "a=1,b=x" -> {"a": "1", "b": "x"}."""
    return dict(part.split("=", 1) for part in tkey.split(",") if part)


def _same_variant(entry_key: str, tkey: str, near: Mapping[str, int]) -> bool:
    """Whether an entry's tuning key matches ``tkey`` on every axis but the ``near`` ones."""
    if not near:
        return entry_key == tkey
    mine, theirs = _fields(tkey), _fields(entry_key)
    return mine.keys() == theirs.keys() and all(theirs[a] == v for a, v in mine.items() if a not in near)


def _distance(entry_key: str, near: Mapping[str, int]) -> float:
    """How far an entry's ``near`` axes are from the looked-up values, in octaves."""
    fields = _fields(entry_key)
    return sum(abs(math.log2(int(fields[a])) - math.log2(v)) for a, v in near.items())


def write_cache_file(path: Path, data: dict) -> None:
    """Write a cache file atomically (temp file + rename) as sorted-key, indented JSON."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def environment() -> dict:
    """What a tuning result was measured on (stored per file)."""
    import torch
    import triton

    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }


def merge_entries(path: Path, arch: str, entries: list[dict]) -> None:
    """Add or replace ``entries`` (keyed by family, variant, dtype, bucket and GPU: this one's
    where an entry names none) in the cache file at ``path``, keeping its other entries, other
    GPUs' included, and refresh its header. Of the families written, stale entries (another
    template) and those keyed by a variant the family's axes no longer have are dropped, as a
    lookup would ignore them; every other family's entries stay as they are, with the template
    hash they were tuned on (a tree whose template of that family differs, such as one being
    edited, must not drop what was tuned on the file's)."""
    env = environment()
    raw, hashes = _read_raw(Path(path), warn=False)
    written = {e["family"] for e in entries}
    kept: dict[tuple, dict] = {}
    for e in raw:
        family, current = e.get("family"), _current_hash(e.get("family"))
        if current is None or family not in hashes:
            continue
        companion = _companion(e)
        if hashes[family] == current and not (companion and hashes.get(companion) != _current_hash(companion)):
            if e["variant"] not in get_family(family).tuning_keys():
                continue
        elif family in written:  # stale: replaced by this tuning run's template
            continue
        kept[_entry_key(e)] = e
    kept.update({_entry_key(e): e for e in ({"device": env["gpu"], **e} for e in entries)})
    families = {e["family"] for e in kept.values()}
    written |= _companions(written)
    families = sorted(f for f in families | _companions(families) if f in written or f in hashes)
    data = {
        "schema": SCHEMA_VERSION,
        "arch": arch,
        "environment": env,  # the last tuning run's; each entry names its GPU
        "template_hashes": {f: _current_hash(f) if f in written else hashes[f] for f in families},
        "entries": sorted(kept.values(), key=lambda e: (*_entry_key(e)[:4], str(e["device"]))),
    }
    write_cache_file(path, data)
    clear()
