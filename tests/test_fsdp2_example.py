"""``examples/fsdp2_train.py`` as the README runs it: ``torchrun`` with 2 Gloo ranks on the CPU, a
tiny Llama. A run stopped and resumed from its DCP checkpoint at the same world size ends with
the same loss as a straight run; the checkpoint also resumes at 1 rank. GPU tier: one NCCL rank."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fsdp2_train.py"
TINY = ["--size", "tiny", "--device", "cpu", "--steps", "6", "--batch-size", "4", "--length", "64"]


def _torchrun(ranks: int, *args: str) -> dict[int, str]:
    """Run the example on ``ranks`` ranks (``args`` after the tiny CPU defaults override them); its
    printed losses by step (as printed, 6 digits)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           str(EXAMPLE), *TINY, *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", KERNEL_FACTORY_BACKEND="auto")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {int(s): loss for s, loss in re.findall(r"step +(\d+) +loss (\S+)", done.stdout)}


@pytest.mark.parametrize("optimizer", ["adamw", "distributed_adamw"])
def test_fsdp2_example_resumes_from_its_checkpoint_as_if_never_stopped(optimizer, tmp_path):
    straight = _torchrun(2, "--optimizer", optimizer)
    first = _torchrun(2, "--optimizer", optimizer, "--stop-after", "3", "--checkpoint", str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    resumed = _torchrun(2, "--optimizer", optimizer, "--resume", "--checkpoint", str(tmp_path / "a"))
    assert max(first) == 2 and min(resumed) == 3 and max(resumed) == 5
    assert resumed[5] == straight[5] and first[2] == straight[2]
    other_world = _torchrun(1, "--optimizer", optimizer, "--resume", "--checkpoint", str(tmp_path / "b"))
    assert max(other_world) == 5 and float(other_world[5]) < float(straight[0])


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adamw", "distributed_adamw"])
def test_fsdp2_example_trains_and_resumes_on_one_gpu_over_nccl(optimizer, tmp_path):
    """A one-rank NCCL mesh with the real kernels, 85M parameters; bf16 autocast and atomics in
    backward make GPU runs differ in their last digits, so the resumed run is checked to go on
    from the checkpoint's step and keep training, not for equal bits."""
    gpu = ["--size", "real", "--device", "cuda", "--steps", "30", "--batch-size", "8", "--length", "256"]
    first = _torchrun(1, *gpu, "--optimizer", optimizer, "--stop-after", "20", "--checkpoint", str(tmp_path / "c"))
    resumed = _torchrun(1, *gpu, "--optimizer", optimizer, "--resume", "--checkpoint", str(tmp_path / "c"))
    assert max(first) == 19 and min(resumed) >= 20 and max(resumed) == 29  # every 3rd step is printed
    assert float(resumed[29]) < float(first[19]) < float(first[0])
