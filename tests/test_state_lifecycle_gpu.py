"""GPU tier: the CPU tier's state-lifecycle checks on the CUDA kernels (FP8 AdamMini): a step
called under ``torch.compile`` is the eager step, and a state dict shaped for other parameters is
refused with the optimizer's own state kept."""

from __future__ import annotations

import copy

import pytest
import torch
from mini_models import OPTIMIZERS, fresh_grads, gqa_model, no_decay_optimizer, steps_stay_equal

from kernel_factory.optimizers.shared.workloads import ShapeModel, llama_param_shapes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_called_under_torch_compile_is_the_eager_step_on_the_gpu(name):
    torch._dynamo.reset()
    model = gqa_model(device="cuda")
    opt = no_decay_optimizer(name, model, momentum="fp8")
    twin = copy.deepcopy(model)
    twin_opt = no_decay_optimizer(name, twin, momentum="fp8")
    compiled = torch.compile(lambda: twin_opt.step())

    class Compiled:
        def step(self) -> None:
            compiled()

    assert steps_stay_equal(model, opt, twin, Compiled())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_state_dict_of_other_shapes_is_refused_on_the_gpu(name):
    other = ShapeModel(llama_param_shapes(dim=32, layers=2, ffn=64, vocab=40, n_heads=4, n_kv_heads=2)
                       + [("layers.1.mlp.down_proj.bias", (32,))], device="cuda")  # fmt: skip
    other_opt = no_decay_optimizer(name, other, momentum="fp8")
    fresh_grads(other)
    other_opt.step()
    model = gqa_model(device="cuda")
    opt = no_decay_optimizer(name, model, momentum="fp8")
    twin = copy.deepcopy(model)
    with pytest.raises(ValueError, match="state dict of another model"):
        opt.load_state_dict(other_opt.state_dict())
    assert steps_stay_equal(model, opt, twin, no_decay_optimizer(name, twin, momentum="fp8"))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_optimizer_built_before_the_model_moved_to_the_gpu_steps_as_one_built_after(name):
    # torch.optim makes state at the first step; ours is made with the optimizer, on the CPU here,
    # and must follow the parameters (AdamMini's is made anew: FP8 momentum where the CPU kept bf16)
    model = gqa_model()
    opt = no_decay_optimizer(name, model, momentum="fp8")
    model.cuda()
    twin = copy.deepcopy(model)
    twin_opt = no_decay_optimizer(name, twin, momentum="fp8")
    assert steps_stay_equal(model, opt, twin, twin_opt)
    moved = {key: t.device.type for state in opt.state.values() for key, t in state.items() if torch.is_tensor(t)}
    made = {key: t.device.type for state in twin_opt.state.values() for key, t in state.items() if torch.is_tensor(t)}
    assert moved == made
