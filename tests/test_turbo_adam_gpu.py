"""GPU tier for TurboAdam's PyTorch path (the fused kernels are still to come): the same codes and
steps on CUDA as on the CPU, and under FSDP2 (two ranks on one GPU over Gloo)."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from fsdp_probe import turbo_adam_equal_to_one_process

from kernel_factory.optimizers import TurboAdam
from kernel_factory.optimizers.parity import compare_tensors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("v_bits", [2, 4, 8])
def test_cuda_steps_follow_the_cpu_steps(v_bits):
    """The codecs' integer parts (hash, packing) are exact on both devices; log and exp may differ
    by an ulp, which moves a stochastic rounding only when its uniform falls within that ulp of the
    threshold: params within 1e-6 of the CPU's after 5 steps."""
    torch.manual_seed(0)
    cpu = torch.nn.Parameter(torch.randn(256, 384))
    gpu = torch.nn.Parameter(cpu.detach().cuda())
    opts = [TurboAdam([p], lr=1e-2, v_bits=v_bits, rounding_seed=3) for p in (cpu, gpu)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        g = torch.randn(256, 384, generator=gen)
        cpu.grad, gpu.grad = g, g.cuda()
        for opt in opts:
            opt.step()
    assert compare_tensors("p", "x", gpu.detach().cpu(), cpu.detach(), 1e-6).passed
    assert {k: t.dtype for k, t in opts[1].state[gpu].items()} == {k: t.dtype for k, t in opts[0].state[cpu].items()}


def test_turbo_adam_under_fsdp2_on_the_gpu_is_within_1e6_of_one_process():
    run_ranks(2, turbo_adam_equal_to_one_process, 1e-6, "cuda")
