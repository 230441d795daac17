"""GPU tier: AdamW and Adam under FSDP2, and DistributedAdamW, with the real multi-tensor kernels,
two ranks on one GPU over Gloo. Gloo stages through the host: these runs prove correctness, not
speed."""

from __future__ import annotations

import pytest
from distributed import run_ranks
from fsdp_probe import equal_to_one_process
from zero_probe import zero_equal_to_one_process

pytestmark = pytest.mark.gpu


def test_fsdp2_step_on_the_gpu_kernels_is_bitwise_the_one_process_step():
    run_ranks(2, equal_to_one_process, "auto", 0.0, "cuda")


@pytest.mark.parametrize("micro", [1, 2])
def test_distributed_adamw_on_the_gpu_kernels_is_bitwise_the_one_process_step(micro):
    run_ranks(2, zero_equal_to_one_process, "auto", "cuda", micro)
