"""The examples as a user runs them: a plain PyTorch loop and a Hugging Face Trainer run on a
transformers Llama, with each of our optimizers; tiny on the CPU tier, 85M parameters on the GPU."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import hf_trainer  # noqa: E402
import plain_loop  # noqa: E402
from llama_setup import OPTIMIZERS  # noqa: E402

EXAMPLES = {"plain_loop": plain_loop.main, "hf_trainer": hf_trainer.main}


def _trains(losses: list[float]) -> bool:
    return len(losses) >= 2 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_examples_train_a_tiny_llama_on_the_cpu(example, optimizer, capsys):
    losses = EXAMPLES[example](["--optimizer", optimizer, "--size", "tiny", "--device", "cpu", "--steps", "20",
                                "--batch-size", "8", "--length", "64"])  # fmt: skip
    assert _trains(losses), losses
    out = capsys.readouterr().out
    assert "amax_update" in out  # the telemetry table
    if optimizer == "adam_mini":  # the partition, from transformers' own module names
        assert "model.layers.0.self_attn.k_proj.weight" in out and "head" in out


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_examples_train_an_85m_llama_on_the_gpu(example, optimizer):
    assert torch.cuda.is_available()
    losses = EXAMPLES[example](["--optimizer", optimizer, "--size", "real", "--steps", "60"])
    assert _trains(losses), losses
