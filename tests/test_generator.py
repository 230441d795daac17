"""Generator: families as data, rendering, loading, arch and backend selection."""

from __future__ import annotations

import itertools

import jinja2
import pytest
import torch

from kernel_factory import generator
from kernel_factory.generator import ADAMW, KernelFamily, Tunable, get_family, render
from kernel_factory.generator.render import load


def test_family_default_is_legal_and_space_is_pruned():
    space = ADAMW.search_space()
    assert dict(ADAMW.default_config) in space
    assert all(ADAMW.is_legal(c) for c in space)
    everything = 1
    for t in ADAMW.tunables:
        everything *= len(t.choices)
    assert 0 < len(space) < everything  # the predicate removed something


def test_illegal_default_and_unknown_axes_are_rejected():
    with pytest.raises(ValueError, match="default config"):
        KernelFamily("bad", "adamw.py.j2", {"x": (1,)}, (Tunable("B", 1, (1, 2)),), lambda c: c["B"] > 1)
    with pytest.raises(ValueError, match="unknown axes"):
        ADAMW.variant(flavour="vanilla")
    with pytest.raises(ValueError, match="not in"):
        ADAMW.variant(param_dtype="float64")
    with pytest.raises(ValueError, match="illegal config"):
        ADAMW.check_config(dict(ADAMW.default_config, CHUNK=ADAMW.default_config["BLOCK"] + 1))
    with pytest.raises(KeyError, match="known"):
        get_family("lion")


def test_every_structural_variant_renders_distinct_kernel_source():
    # Triton keys its on-disk cache on the jitted functions' source: two variants whose kernel
    # text is equal (say, differing only in a module global) would share one binary. That
    # bug ran an fp32 kernel on bf16 tensors on the H200; this guards against its return.
    axes = ADAMW.axes
    bodies = {}
    for values in itertools.product(*axes.values()):
        variant = ADAMW.variant(**dict(zip(axes, values, strict=True)))
        source = render(ADAMW, variant)
        body = source[source.index("@triton.jit") :]
        assert body not in bodies, f"{dict(variant)} renders the same kernels as {bodies.get(body)}"
        bodies[body] = dict(variant)


def test_muon_rows_is_muons_module_and_two_split_kernels():
    """``muon_rows.py.j2`` includes ``muon.py.j2`` whole (its tuned entries stay hashed on that
    source) and adds the split kernels to the multi-tensor variants only."""
    from kernel_factory.generator import MUON, MUON_ROWS

    for values in itertools.product(*MUON.axes.values()):
        variant = dict(zip(MUON.axes, values, strict=True))
        muon, rows = (render(f, f.variant(**variant)).split("\n", 1)[1] for f in (MUON, MUON_ROWS))
        assert rows.startswith(muon.rstrip("\n")), variant
        added = rows[len(muon.rstrip("\n")) :]
        split = ("def momentum_split_kernel(", "def apply_split_kernel(")
        assert all((name in added) == variant["multi_tensor"] for name in split), variant


def test_render_is_strict_about_missing_axes():
    with pytest.raises(jinja2.UndefinedError):
        render(ADAMW, {"multi_tensor": True})


def test_load_renders_once_into_a_content_hashed_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_FACTORY_CACHE_DIR", str(tmp_path))
    variant = ADAMW.variant(multi_tensor=False, amsgrad=True)
    a = load(ADAMW, variant)
    assert load(ADAMW, variant) is a
    assert hasattr(a, "adam_kernel")
    assert a.__file__.startswith(str(tmp_path)) or "kernels" in a.__file__


def test_detect_arch_on_cpu_tensors():
    assert generator.detect_arch("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert generator.detect_arch() == "cpu"


def test_backend_mode_validates(monkeypatch):
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "TORCH")
    assert generator.backend_mode() == "torch"
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "cuda")
    with pytest.raises(ValueError, match="auto"):
        generator.backend_mode()


def test_size_bucket_is_next_power_of_two():
    assert [generator.size_bucket(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]
