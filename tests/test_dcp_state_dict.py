"""torch.distributed.checkpoint's optimizer state-dict API in one process (no process group): how
torchtitan, accelerate and most FSDP2 code save and load optimizers. Its state dicts are keyed by
parameter names, not indices."""

from __future__ import annotations

import copy

import pytest
import torch
from mini_models import OPTIMIZERS, fresh_grads, gqa_model, no_decay_optimizer
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from kernel_factory.optimizers import AdamW


def _steps(model, opt, n: int, seed: int) -> None:
    torch.manual_seed(seed)
    for _ in range(n):
        fresh_grads(model)
        opt.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_dcp_state_dict_loads_into_a_fresh_optimizer_and_training_continues_equally(name):
    model = gqa_model()
    opt = no_decay_optimizer(name, model, momentum="bf16")
    _steps(model, opt, 3, seed=0)
    saved = get_optimizer_state_dict(model, opt)
    assert all(isinstance(key, str) for key in saved["state"])  # parameter names
    twin = copy.deepcopy(model)
    twin_opt = no_decay_optimizer(name, twin, momentum="bf16")
    set_optimizer_state_dict(twin, twin_opt, saved)
    for p, q in zip(model.params, twin.params, strict=True):
        for key, value in opt.state[p].items():
            assert twin_opt.state[q][key].dtype == value.dtype, key  # bf16 momentum stays bf16
            assert torch.equal(twin_opt.state[q][key], value), key
    _steps(model, opt, 2, seed=1)
    _steps(twin, twin_opt, 2, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.params, twin.params, strict=True))


@pytest.mark.parametrize("direction", ["torch to ours", "ours to torch"])
def test_checkpoints_move_between_torch_adamw_and_ours_through_dcp(direction):
    model = gqa_model()
    first, second = (torch.optim.AdamW, AdamW) if direction == "torch to ours" else (AdamW, torch.optim.AdamW)
    opt = first(model.parameters(), lr=1e-2)
    _steps(model, opt, 3, seed=0)
    twin = copy.deepcopy(model)
    twin_opt = second(twin.parameters(), lr=1e-2)
    set_optimizer_state_dict(twin, twin_opt, get_optimizer_state_dict(model, opt))
    for p, q in zip(model.params, twin.params, strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(twin_opt.state[q][key], opt.state[p][key]), key


def test_fp32_state_of_bf16_params_stays_fp32_through_dcp():
    model = gqa_model(dtype=torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-2, state_dtype="fp32")
    _steps(model, opt, 2, seed=0)
    twin = copy.deepcopy(model)
    twin_opt = AdamW(twin.parameters(), lr=1e-2, state_dtype="fp32")
    set_optimizer_state_dict(twin, twin_opt, get_optimizer_state_dict(model, opt))
    for p, q in zip(model.params, twin.params, strict=True):
        assert twin_opt.state[q]["exp_avg"].dtype == torch.float32
        assert torch.equal(twin_opt.state[q]["exp_avg"], opt.state[p]["exp_avg"])
