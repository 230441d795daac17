"""The TurboAdam tuning workloads: the parameter list of the model at each of the family's tune
sizes (``workloads.model_at_bucket``: the 134M Llama-style list at 2^27, Qwen2.5-0.5B at 2^29, four
layers of Llama-2-7B at 2^30, Llama-3.2-1B at 2^31) in each param dtype, at the default (4-bit m,
factored v) and in the v-only and m-only modes, each launch checked against the PyTorch reference
step. A task allocates its model when first used and frees it after its study. Used by
``python -m kernel_factory.optimizers.tune --families turbo_adam``.
"""

from __future__ import annotations

import torch

from kernel_factory.generator import TURBO_ADAM, size_bucket

from ..parity import relative_error
from ..shared import precompile
from ..shared.buckets import TRITON_DTYPES
from ..shared.tuning import ModelWorkloadTask
from ..shared.workloads import SHAPE_SETS, model_at
from .optimizer import TurboAdam
from .plan import V_AXIS, TurboLaunch
from .reference import matrix_view, turbo_adam_step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Normwise tolerance on the params after one launch: fp32 rounding (approximate sqrt, division and
# log2 on the GPU; a stochastic rounding they move changes one v code, far below this), or one
# rounding of a bf16 / fp16 param.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}
CODE_FLIPS = 1e-3  # fraction of code bytes allowed to differ from the reference's
MODES = {"default": {}, "v_only": {"compress_m": False}, "m_only": {"compress_v": False}}


def launch_codecs(shapes: list[tuple[int, ...]], mode: str) -> list[tuple[str, str, int]]:
    """(m_codec, v_codec, elements) of each fused CUDA launch a step of a list of ``shapes`` makes in
    ``mode``, largest first, known without allocating: the optimizer's own layout rule on meta
    tensors. A layout is a launch, and exact tensors ride in the largest (plan.py); Llama-2-7B's
    4096-element norms take 4-bit ln codes for v, a launch of their own."""
    params = [torch.empty(s, device="meta") for s in shapes]
    opt = TurboAdam(params, **MODES[mode])
    sizes: dict[tuple[str, str], int] = {}
    exact = 0
    for p in params:
        layout = opt.layout(p, opt.param_groups[0])
        if layout.exact:
            exact += p.numel()
        else:
            key = ("q4" if layout.compress_m else "exact", V_AXIS[layout.v_codec])
            sizes[key] = sizes.get(key, 0) + p.numel()
    launches = sorted(([m, v, n] for (m, v), n in sizes.items()), key=lambda c: -c[2])
    if launches:
        launches[0][2] += exact
    return [tuple(c) for c in launches]


class TurboAdamTuningTask(ModelWorkloadTask):
    """One fused launch (its codecs ``codecs``, as ``launch_codecs`` lists them) of a step in one
    param dtype and mode on a model's parameter list as a tuner task."""

    family = TURBO_ADAM
    WORKLOAD = (*ModelWorkloadTask.WORKLOAD, "launch", "group")

    def __init__(self, dtype: torch.dtype, mode: str, device: str, bandwidth_tbs: float | None = None, seed: int = 0,
                 model: str = "llama134m", codecs: tuple[str, str, int] | None = None) -> None:  # fmt: skip
        self.param_dtype, self.mode, self.device, self.bandwidth_tbs = dtype, mode, device, bandwidth_tbs
        self.seed, self.model = seed, model
        if codecs is None:
            launches = launch_codecs([s for _, s in SHAPE_SETS[model]], mode)
            if not launches:
                raise ValueError(f"TurboAdam tuning: {model!r} has no compressed tensor (no fused launch) in {mode!r}")
            codecs = launches[0]
        m_codec, v_codec, numel = codecs
        self.variant = TURBO_ADAM.tuning_key(TURBO_ADAM.variant(
            multi_tensor=torch.device(device).type == "cuda", m_codec=m_codec, v_codec=v_codec))  # fmt: skip
        self.dtype = TRITON_DTYPES[dtype]
        self.numel = size_bucket(numel)
        self.tol = TOL[dtype]

    def allocate(self) -> None:
        """Allocate params, grads and the optimizer; build its plan and state with one step."""
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        dtype = self.param_dtype
        shapes = [s for _, s in SHAPE_SETS[self.model]]
        self.params = [(torch.randn(s, device=self.device, generator=gen) * 0.02).to(dtype) for s in shapes]
        for p in self.params:
            p.grad = torch.randn(p.shape, device=self.device, generator=gen).to(dtype)
        self.opt = TurboAdam(self.params, lr=1e-3, weight_decay=0.01, **MODES[self.mode])
        self.opt.step()  # builds the plan and the state
        (plan,) = self.opt._plans.values()
        mine = [ln for ln in plan.launches if TURBO_ADAM.tuning_key(TURBO_ADAM.variant(**ln.variant)) == self.variant]
        if len(mine) != 1 or plan.reference:
            raise RuntimeError("TurboAdam tuning needs the fused path for every tensor (CUDA)")
        self.launch: TurboLaunch = mine[0]
        self.group = self.opt.param_groups[0]
        numel = sum(p.numel() for p in self.launch.params)
        state = sum(t.numel() * t.element_size() for s in self.launch.states for k, t in s.items() if k != "step")
        coded = self.launch.params[: self.launch.n_coded]
        stats = sum(p.numel() for p in coded) if self.launch.stats_work is not None else 0
        moved = numel * 3 * dtype.itemsize + 2 * state + stats * dtype.itemsize  # the stats pass reads g again
        self.floor_ms = moved / (self.bandwidth_tbs * 1e12) * 1e3 if self.bandwidth_tbs else None
        self.snapshot(self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        states = [t for s in self.launch.states for k, t in s.items() if k != "step"]
        return [*self.launch.params, *states, self.launch.steps, self.launch.mean]

    def precompile(self, configs) -> None:
        """Compile ``configs``' kernels on background threads, in parallel, and return when they are
        done (the tuner's compile-ahead); the launch stays on its config."""
        self.ensure()
        precompile.wait_all([w for config in configs for w in self.launch.warm_config(config)])

    def configure(self, config) -> None:
        self.ensure()
        self.launch.configure(config)
        self.run()  # compiles here, so compile failures are typed as such
        self._sync()

    def run(self) -> None:
        self.ensure()
        g = self.group
        self.launch.run(g["lr"], g["betas"], g["eps"], g["weight_decay"], None, None)

    def check(self) -> float:
        """Worst normwise relative error of the params after one launch against the reference
        (inf if more than CODE_FLIPS of any code tensor differs), on fresh grads."""
        self.restore()
        for p in self.params:
            p.grad.normal_()
        launch, g = self.launch, self.group
        refs = []
        for t, (source, p, state) in enumerate(zip(launch.sources, launch.params, launch.states, strict=True)):
            layout = self.opt.layout(source, g)
            if layout.exact:
                continue
            q, s = p.clone(), {k: v.clone() for k, v in state.items()}
            turbo_adam_step(q, source.grad, s, layout, lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1],
                            eps=g["eps"], weight_decay=g["weight_decay"], seed=int(launch.meta[t, 3]))  # fmt: skip
            refs.append((p, state, q, s))
        self.run()
        self._sync()
        error = 0.0
        for p, state, q, s in refs:
            error = max(error, relative_error(matrix_view(p), matrix_view(q)))
            for key, t in state.items():
                if t.dtype == torch.uint8 and float((t != s[key]).float().mean()) > CODE_FLIPS:
                    error = float("inf")
        self.restore()
        return error

    def _sync(self) -> None:
        if self.params[0].is_cuda:
            torch.cuda.synchronize()


def turbo_adam_tasks(dtypes, device: str, bandwidth_tbs: float | None) -> list[TurboAdamTuningTask]:
    """The TurboAdam keys: each tune size's model x dtype x mode x each fused launch of its step."""
    models = [model_at(TURBO_ADAM, numel) for numel in TURBO_ADAM.tune_sizes]
    return [TurboAdamTuningTask(DTYPES[d], mode, device, bandwidth_tbs, model=model, codecs=codecs)
            for model in models for d in dtypes for mode in MODES
            for codecs in launch_codecs([s for _, s in SHAPE_SETS[model]], mode)]  # fmt: skip
