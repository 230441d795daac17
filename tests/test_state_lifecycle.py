"""When state exists and which parameters an optimizer may step: state is created with the
optimizer (DCP's ``get_optimizer_state_dict`` fakes a step on one without state), and a step on
parameters the model no longer uses (left on the meta device, or replaced by ``fully_shard``)
raises instead of silently doing nothing."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from mini_models import OPTIMIZERS, fresh_grads, gqa_model, no_decay_optimizer, steps_stay_equal
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from kernel_factory.optimizers import AdamW, Muon
from kernel_factory.optimizers.shared.workloads import ShapeModel, llama_param_shapes


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_exists_before_the_first_step_and_dcp_reads_it_without_stepping(name):
    model = gqa_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = no_decay_optimizer(name, model)
    assert set(opt.state) == set(model.parameters())
    assert all(float(s["step"]) == 0 for s in opt.state.values() if "step" in s)
    saved = get_optimizer_state_dict(model, opt)
    assert len(saved["state"]) == len(before)
    assert all(p.grad is None for p in model.parameters())  # no fake step ran
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_frozen_parameters_get_no_state_and_added_groups_do():
    model = gqa_model()
    frozen, *rest = model.parameters()
    frozen.requires_grad_(False)
    opt = AdamW(rest[:3], amsgrad=True)
    opt.add_param_group({"params": rest[3:]})
    assert set(opt.state) == set(rest)
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"} for s in opt.state.values())
    opt.add_param_group({"params": [frozen]})
    assert frozen not in opt.state


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_optimizer_over_meta_parameters_refuses_to_step_after_the_model_is_materialized(name):
    model = gqa_model(device="meta")
    opt = no_decay_optimizer(name, model)
    assert not opt.state  # nothing to allocate for meta parameters
    model.to_empty(device="cpu")  # replaces the meta Parameters with new ones
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="is on the meta device; build the optimizer after"):
        opt.step()


def test_a_meta_parameter_with_a_grad_is_named():
    p = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    p.grad = torch.empty_like(p)
    with pytest.raises(RuntimeError, match="parameter 0 of param group 0 .* meta device"):
        Muon([p]).step()


def test_state_of_a_muon_model_is_split_between_its_families():
    model = ShapeModel([("embed.weight", (10, 4)), ("layers.0.w", (4, 4)), ("norm.weight", (4,))])
    opt = Muon(model.named())
    keys = [set(opt.state[p]) for p in model.parameters()]
    assert keys == [{"step", "exp_avg", "exp_avg_sq"}, {"momentum_buffer"}, {"step", "exp_avg", "exp_avg_sq"}]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_copied_optimizer_keeps_its_settings_and_steps_as_the_original(name, how):
    # torch.optim pickles defaults, state and param groups alone: a seed or a block partition set in
    # __init__, and the plans and telemetry the step builds, must come back too
    model = gqa_model()
    opt = no_decay_optimizer(name, model)
    if hasattr(opt, "seed"):
        opt.seed = 1234
    fresh_grads(model)
    opt.step()  # plans and telemetry built: the copies must not share or lack them
    twin, twin_opt = copy.deepcopy((model, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, opt)))
    assert getattr(twin_opt, "seed", None) == getattr(opt, "seed", None)
    assert steps_stay_equal(model, opt, twin, twin_opt)
    assert twin_opt.telemetry.summary().keys() == opt.telemetry.summary().keys()


class _Compiled:
    """An optimizer whose ``step`` is called through ``torch.compile``, as users compile a training
    step around it."""

    def __init__(self, opt) -> None:
        self.opt = opt
        self._step = torch.compile(lambda: opt.step())

    def step(self) -> None:
        self._step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_called_under_torch_compile_is_the_eager_step(name):
    # Dynamo leaves the steps untraced (shared/eager.py): traced, Adafactor's CPU path raised a
    # KeyError and AdamMini, Muon and TurboAdam stepped to other values
    torch._dynamo.reset()
    model = gqa_model()
    opt = no_decay_optimizer(name, model)
    twin = copy.deepcopy(model)
    assert steps_stay_equal(model, opt, twin, _Compiled(no_decay_optimizer(name, twin)))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_state_dict_of_other_shapes_is_refused_and_the_optimizer_keeps_its_own(name):
    # the same parameter count and order (ffn 64 for 48): torch's loader takes it; the kernels would
    # index the loaded moments by the parameters' shapes, past their ends
    other = ShapeModel(llama_param_shapes(dim=32, layers=2, ffn=64, vocab=40, n_heads=4, n_kv_heads=2)
                       + [("layers.1.mlp.down_proj.bias", (32,))])  # fmt: skip
    other_opt = no_decay_optimizer(name, other)
    fresh_grads(other)
    other_opt.step()
    model = gqa_model()
    opt = no_decay_optimizer(name, model)
    twin = copy.deepcopy(model)
    with pytest.raises(ValueError, match="state dict of another model"):
        opt.load_state_dict(other_opt.state_dict())
    assert steps_stay_equal(model, opt, twin, no_decay_optimizer(name, twin))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_optimizer_built_before_the_model_is_cast_steps_as_one_built_after(name):
    # torch.optim makes state at the first step, so `model.to(dtype)` after the optimizer is
    # harmless there; here state exists from construction and must follow the parameters (the
    # Adafactor CPU path's fp32 `variance` of a bf16 vector failed in lerp)
    model = gqa_model()
    opt = no_decay_optimizer(name, model)
    model.to(torch.bfloat16)
    twin = copy.deepcopy(model)
    assert steps_stay_equal(model, opt, twin, no_decay_optimizer(name, twin), steps=2)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_empty_parameter_is_left_as_it_is_and_the_others_step(name):
    # torch's AdamW steps an empty tensor (nothing to do); AdamMini's block partition divided by its
    # zero rows and Adafactor by its zero size (torch's Adafactor: ZeroDivisionError)
    shapes = llama_param_shapes(dim=32, layers=2, ffn=48, vocab=40, n_heads=4, n_kv_heads=2)
    model = ShapeModel(shapes + [("layers.1.mlp.gate_proj.lora_A", (0, 32)), ("layers.1.empty_scale", (0,))])
    opt = no_decay_optimizer(name, model)
    before = [p.detach().clone() for p in model.params]
    fresh_grads(model)
    opt.step()
    assert all(p.numel() == 0 or not torch.equal(p, b) for p, b in zip(model.params, before, strict=True))


def test_importing_the_package_leaves_dynamo_and_triton_for_later():
    # eager_step makes its disabled step at the first call: Dynamo imports Triton, which reads
    # TRITON_INTERPRET when imported, and the parity matrix sets it after importing the package
    # (where a GPU is seen, precompile starts Triton's hash on a thread at import: Dynamo alone then)
    import os
    import subprocess
    import sys

    script = ("import sys, kernel_factory.optimizers; "
              "print(' '.join(m for m in ('torch._dynamo', 'triton') if m in sys.modules))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         check=True)  # fmt: skip
    imported = out.stdout.split()
    assert "torch._dynamo" not in imported
    assert torch.cuda.is_available() or "triton" not in imported
