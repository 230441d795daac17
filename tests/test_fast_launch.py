"""Launches that skip the JIT's dispatch (generator/fast_launch.py): a launch goes straight to a
compiled variant only where an earlier launch through the JIT had every argument specialize the same
way; the arguments, the trailing constexprs and defaults, the grid and the stream reach the
launcher in the JIT's order. On CPUs against a stand-in kernel; on a GPU (``-m gpu``) against
Triton's own, results compared with torch."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernel_factory.generator import fast_launch
from kernel_factory.generator.fast_launch import FastKernel, FastModule

STREAM = (0, 1234)  # (device, raw stream) the stand-in reports


class Param:
    def __init__(self, name, default=fast_launch.inspect.Parameter.empty):
        self.name, self.default = name, default


class Compiled:
    """A compiled variant's stand-in: records what its launcher was given."""

    function, packed_metadata = "fn", "meta"

    def __init__(self, log):
        self.log = log

    def run(self, x, y, z, stream, function, meta, launch_metadata, enter, exit, *args):
        self.log.append(("direct", (x, y, z), stream, args))


class StandInKernel:
    """A JITFunction's stand-in: (a, n, x, BLOCK: constexpr, G: constexpr = 2)."""

    params = [Param("a"), Param("n"), Param("x"), Param("BLOCK"), Param("G", 2)]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return Compiled(self.log)

        return launch


def fast():
    kernel = StandInKernel()
    return kernel, FastKernel(kernel, stream=lambda: STREAM)


def kinds(kernel):
    return [entry[0] for entry in kernel.log]


def test_a_seen_key_goes_to_the_launcher_with_the_jits_argument_order():
    kernel, k = fast()
    t = torch.zeros(16)
    k[(4,)](t, 8, 0.5, BLOCK=64)
    k[(4, 3)](t, 8, 0.25, BLOCK=64)  # only a float changed
    assert kinds(kernel) == ["jit", "direct"]
    assert kernel.log[1] == ("direct", (4, 3, 1), STREAM[1], (t, 8, 0.25, 64, 2))


@pytest.mark.parametrize("change", ["int", "bool_for_int", "dtype", "alignment", "keyword", "float_for_int"])
def test_a_launch_that_specializes_otherwise_takes_the_jit(change):
    kernel, k = fast()
    t = torch.zeros(16)
    k[(4,)](t, 1, 0.5, BLOCK=64)
    args, kwargs = {
        "int": ((t, 16, 0.5), {"BLOCK": 64}),
        "bool_for_int": ((t, True, 0.5), {"BLOCK": 64}),  # True == 1 in Python, not to Triton
        "dtype": ((t.double(), 1, 0.5), {"BLOCK": 64}),
        "alignment": ((t[1:], 1, 0.5), {"BLOCK": 64}),  # 4 bytes past a 16-byte boundary
        "keyword": ((t, 1, 0.5), {"BLOCK": 128}),
        "float_for_int": ((t, 1.0, 0.5), {"BLOCK": 64}),
    }[change]
    k[(4,)](*args, **kwargs)
    k[(4,)](*args, **kwargs)
    assert kinds(kernel) == ["jit", "jit", "direct"]


def test_arguments_it_cannot_key_hooks_callable_grids_and_the_switch_take_the_jit(monkeypatch):
    kernel, k = fast()
    t = torch.zeros(16)
    for _ in range(2):
        k[(4,)](t, object(), 0.5, BLOCK=64)  # a tensor descriptor, say
        k[lambda meta: (4,)](t, 1, 0.5, BLOCK=64)
        k[(4,)](t, 1, 0.5, BLOCK=[64])  # unhashable keyword value
    assert set(kinds(kernel)) == {"jit"}
    k[(4,)](t, 1, 0.5, BLOCK=64)
    monkeypatch.setattr(fast_launch, "ENABLED", False)  # KERNEL_FACTORY_FAST_LAUNCH=0
    k[(4,)](t, 1, 0.5, BLOCK=64)
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    monkeypatch.setattr(fast_launch, "_hooks", lambda: True)
    k[(4,)](t, 1, 0.5, BLOCK=64)
    assert kinds(kernel)[-3:] == ["jit", "jit", "jit"]


def test_a_missing_parameter_is_the_jits_error_and_keys_are_bounded(monkeypatch):
    class Raising(StandInKernel):
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise TypeError("dynamic_func() missing 1 required positional argument: 'BLOCK'")

            return launch

    k = FastKernel(Raising(), stream=lambda: STREAM)
    with pytest.raises(TypeError, match="BLOCK"):
        k[(4,)](torch.zeros(4), 1, 0.5)
    monkeypatch.setattr(fast_launch, "MAX_VARIANTS", 2)
    kernel, k = fast()
    t = torch.zeros(16)
    for n in (1, 2, 3, 3):
        k[(4,)](t, n, 0.5, BLOCK=64)
    assert kinds(kernel) == ["jit", "jit", "jit", "jit"]  # the third key was not kept


def test_a_module_wraps_each_kernel_once_and_passes_the_rest(monkeypatch):
    class Module:
        kernel = StandInKernel()
        helper = StandInKernel()
        BLOCK = 64

    monkeypatch.setattr(fast_launch, "_is_jit", lambda v: isinstance(v, StandInKernel))
    m = FastModule(Module)
    assert isinstance(m.kernel, FastKernel) and m.kernel is m.kernel and m.kernel.kernel is Module.kernel
    assert m.BLOCK == 64 and m.kernel.params is Module.kernel.params
    with pytest.raises(AttributeError):
        m.missing  # noqa: B018


def test_interpreted_kernels_are_not_wrapped():
    from kernel_factory.generator import load
    from kernel_factory.generator.families import ADAMW

    module = load(ADAMW, ADAMW.variant())
    kernel = module.adam_kernel
    assert isinstance(kernel, FastKernel) == (not fast_launch.os.environ.get("TRITON_INTERPRET"))


@triton.jit
def axpb(src, out, n, x, b, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(src + offs, mask=mask) * x + b, mask=mask)


@pytest.mark.gpu
def test_triton_kernels_launched_directly_compute_what_the_jit_does():
    k = FastKernel(axpb)
    base = torch.randn(4096, device="cuda")
    for step, (x, b, offset) in enumerate([(0.5, 1.0, 0), (2.0, -1.0, 0), (3.0, 0.0, 1), (1.5, 2.0, 1)]):
        src = base[offset : offset + 4000]  # one length: only the alignment tells the views apart
        out = torch.empty_like(src)
        n = src.numel()
        k[(-(-n // 1024),)](src, out, n, x, b, BLOCK=1024)
        torch.testing.assert_close(out, torch.addcmul(torch.full_like(src, b), src, torch.full_like(src, x)),
                                   rtol=1e-6, atol=1e-6)  # fp32 FMA on both sides, rounding may differ by an ulp
        assert len(k._variants) == (1 if step < 2 else 2), "aligned and misaligned views are two variants"


def test_a_launcher_that_refuses_the_arguments_sends_every_launch_to_the_jit(monkeypatch):
    class Refusing(Compiled):
        def run(self, *args):
            raise TypeError("function takes exactly 30 arguments (28 given)")

    class Kernel(StandInKernel):
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.log.append(("jit", grid, args, kwargs))
                return Refusing(self.log)

            return launch

    monkeypatch.setattr(fast_launch, "ENABLED", True)
    kernel = Kernel()
    k = FastKernel(kernel, stream=lambda: STREAM)
    t = torch.zeros(16)
    with pytest.warns(UserWarning, match="through the JIT"):
        for _ in range(3):
            k[(4,)](t, 1, 0.5, BLOCK=64)
    assert kinds(kernel) == ["jit", "jit", "jit"] and fast_launch.ENABLED is False


def test_a_triton_without_knobs_launches_through_the_jit(monkeypatch):
    monkeypatch.setattr(fast_launch, "_RUNTIME", [None])
    kernel, k = fast()
    t = torch.zeros(16)
    for _ in range(3):
        k[(4,)](t, 1, 0.5, BLOCK=64)
    assert kinds(kernel) == ["jit", "jit", "jit"]
