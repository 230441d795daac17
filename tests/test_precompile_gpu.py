"""GPU tier for the background compiles (optimizers/shared/precompile.py): each optimizer queues
its kernels when it is built, every queued compile succeeds (a failed one would be dropped
silently and compiled again at the step), and the first steps are bitwise those of the same
optimizer built with precompiling off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kernel_factory.optimizers import Adafactor, AdamMini, AdamW, Muon, TurboAdam
from kernel_factory.optimizers.shared import precompile
from kernel_factory.optimizers.shared.workloads import ShapeModel, llama_param_shapes

pytestmark = pytest.mark.gpu
# a GQA Llama-style list: TurboAdam compresses its matrices (>= 4096 elements), Muon takes
# square and rectangular batches, AdamMini its heads and rows
GEOMETRY = dict(dim=128, n_heads=4, n_kv_heads=2)
SHAPES = llama_param_shapes(layers=2, ffn=384, vocab=512, **GEOMETRY)
BUILDERS = {
    "adamw": lambda m: AdamW(m.parameters(), lr=1e-3, weight_decay=0.1),
    "adafactor": lambda m: Adafactor(m.parameters(), lr=1e-2),
    "turbo_adam": lambda m: TurboAdam(m.parameters(), lr=1e-3, weight_decay=0.1),
    "muon": lambda m: Muon(m.named(), lr=2e-2),
    "adam_mini": lambda m: AdamMini(m.named(), lr=1e-3, weight_decay=0.1, **GEOMETRY),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_kernels_compile_ahead_and_the_steps_are_unchanged(name, dtype, monkeypatch):
    queued = []
    real = precompile.warm

    def recording(*args, **kwargs):
        handle = real(*args, **kwargs)
        queued.append(handle._future)
        return handle

    monkeypatch.setattr(precompile, "warm", recording)
    ahead = ShapeModel(SHAPES, dtype, "cuda")
    opt_ahead = BUILDERS[name](ahead)
    assert queued and all(f is not None for f in queued)
    for future in queued:
        future.result(timeout=600)  # raises a failed compile's error
    monkeypatch.setenv("KERNEL_FACTORY_PRECOMPILE", "0")
    queued.clear()
    plain = ShapeModel(SHAPES, dtype, "cuda")
    opt_plain = BUILDERS[name](plain)
    assert not queued
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        for p, q in zip(ahead.parameters(), plain.parameters(), strict=True):
            p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(dtype)
            q.grad = p.grad.clone()
        opt_ahead.step()
        opt_plain.step()
    for p, q in zip(ahead.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["adamw", "turbo_adam"])
def test_a_process_that_exits_right_after_its_first_step_exits_cleanly(name, tmp_path):
    # its GradScaler variants are still compiling at exit (queued behind the rest): a worker left
    # inside Triton's C++ when the interpreter finalizes aborted the process (exit status -6)
    build = {"adamw": "AdamW(model.parameters(), lr=1e-3)", "turbo_adam": "TurboAdam(model.parameters(), lr=1e-3)"}
    script = (f"import torch\n"
              f"from kernel_factory.optimizers import AdamW, TurboAdam\n"
              f"from kernel_factory.optimizers.shared.workloads import ShapeModel, llama_param_shapes\n"
              f"shapes = llama_param_shapes(layers=2, ffn=384, vocab=512, dim=128, n_heads=4, n_kv_heads=2)\n"
              f"model = ShapeModel(shapes, torch.bfloat16, 'cuda')\n"
              f"opt = {build[name]}\n"
              f"for p in model.parameters():\n"
              f"    p.grad = torch.ones_like(p)\n"
              f"opt.step()\n"
              f"torch.cuda.synchronize()\n"
              f"print('stepped')\n")  # fmt: skip
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "KERNEL_FACTORY_CACHE_DIR": str(tmp_path / "kf")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                         check=False)  # fmt: skip
    assert out.returncode == 0 and "stepped" in out.stdout, out.stderr[-3000:]


LAUNCHER_SCRIPT = """
import hashlib, json, pathlib
import torch
import triton.runtime.build as build
from kernel_factory.optimizers import TurboAdam
from kernel_factory.optimizers.shared import precompile
from kernel_factory.optimizers.shared.workloads import ShapeModel, llama_param_shapes
gcc = build._build
built = []  # (module name, hash of its C source) of each build with the host's compiler
def recording(name, src, *rest):
    built.append((name, hashlib.sha256(pathlib.Path(src).read_bytes()).hexdigest()))
    return gcc(name, src, *rest)
build._build = recording
shapes = llama_param_shapes(layers=2, ffn=384, vocab=512, dim=128, n_heads=4, n_kv_heads=2)
model = ShapeModel(shapes, torch.float32, 'cuda')
opt = TurboAdam(model.parameters(), lr=1e-3)
for p in model.parameters():
    p.grad = torch.ones_like(p)
opt.step()
precompile.settle()
print(json.dumps({"built": built, "timeline": precompile.timeline()}))
"""


def test_launchers_build_beside_their_compiles_and_once(tmp_path):
    # Triton 3.6 builds a C launcher per kernel signature after the compile (launcher_prebuild):
    # it is built from the signature as soon as the variant is queued, and found by the load
    from triton.backends.nvidia import driver as nvidia

    if not hasattr(nvidia, "make_launcher"):
        pytest.skip("this Triton builds no C launchers")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "KERNEL_FACTORY_CACHE_DIR": str(tmp_path / "kf")}
    out = subprocess.run([sys.executable, "-c", LAUNCHER_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=600, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    launchers = [digest for name, digest in report["built"] if name == "__triton_launcher"]
    assert launchers and len(launchers) == len(set(launchers)), report["built"]  # none built twice
    ends = {label: end for label, _, end in report["timeline"]}
    ahead = [(label, start) for label, start, _ in report["timeline"] if label.startswith("launcher of ")]
    assert len(ahead) == len(launchers)  # every build was one ahead of its launch
    for label, start in ahead:
        assert start < ends[label.removeprefix("launcher of ")], (label, report["timeline"])
