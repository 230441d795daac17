"""benchmarks/ab/compile_offline: the kernels compile for sm_90 on a machine without a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.ab import compile_offline

ROOT = Path(__file__).resolve().parent.parent


def test_statistics_kernel_compiles_for_sm90_and_reports_its_stages(tmp_path):
    """In a process of its own: the CPU tier's interpreter (TRITON_INTERPRET=1) replaces the
    kernels that a real compile needs."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(KERNEL_FACTORY_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "benchmarks.ab.compile_offline", "turbo_adam_stats", "--repeat", "1",
                          "--sass"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert re.match(r"compile \d+\.\d\d s \(ttir .*cubin .*\), PTX [1-9]\d* KB, SASS [1-9]\d* instructions", line), line


def test_signature_types_pointers_by_name():
    fn = compile_offline.kernel_function("adam_mini", "float32")
    sig = compile_offline.signature(fn, {"ROWS": 1})
    assert sig["items_ptr"] == sig["meta_ptr"] == "*i32" and sig["p_table"] == "*i64"
    assert sig["ROWS"] == "constexpr" and sig["lr"] == "fp32" and sig["tel_count"] == "*i64"
