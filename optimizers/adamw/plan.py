"""Launch plans for the fused Adam/AdamW step.

A plan is built once per param group (again only when the set of parameters
with gradients changes, or after ``load_state_dict``). It splits the group's
tensors into buckets by where they can run:

- ``TritonMultiTensor``: CUDA, 16-byte aligned, contiguous: one launch for the
  bucket through pointer tables built at plan time; only the grad table is
  re-uploaded, and only when the gradients' addresses change.
- ``TritonSingleTensor``: the interpreter on CPU (it cannot read pointer
  tables) and CUDA tensors that are not 16-byte aligned: one launch per tensor.
- ``TorchFused``: CPU tensors under ``auto``: torch's fused CPU kernel, so the
  result is bitwise that of ``torch.optim.AdamW(fused=True)``.
- ``Reference``: the pure PyTorch path (``KERNEL_FACTORY_BACKEND=torch``, fp64,
  non-contiguous parameters, no Triton).

Each bucket keeps its step counts in one float32 buffer; ``state['step']`` of
each parameter is a 0-d view into it, so state_dict keeps torch's layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim.adam import adam as torch_functional_adam

from kernel_factory.generator import ADAMW, backend_mode, detect_arch, load, select

from ..shared import precompile
from ..shared.buckets import (
    TRITON_DTYPES,
    LrBuffer,
    aligned,
    chunk_work_list,
    kernel_path,
    log2_pair,
    pointer_table,
    share_step_counts,
)
from ..shared.checks import checked_grads
from ..shared.dtensor import local
from ..shared.grad_table import GradTable
from ..shared.steppers import register_group_stepper
from .reference import adam_reference_step


class Hyper:
    """One group's hyperparameters for this step, as the kernels take them."""

    __slots__ = ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "amsgrad", "maximize")

    def __init__(self, group: dict) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        self.lr = group["lr"]
        self.beta1, self.beta2 = beta1, beta2
        self.eps = float(group["eps"])
        self.weight_decay = float(group["weight_decay"])
        self.decoupled = bool(group["decoupled_weight_decay"])
        self.amsgrad = bool(group["amsgrad"])
        self.maximize = bool(group["maximize"])

    def kernel_scalars(self) -> tuple[float, ...]:  # (KERNEL_SCALARS of them)
        """beta2, 1-beta1, 1-beta2, log2 beta1 and log2 beta2 (each as an fp32 pair hi + lo),
        eps, weight_decay: computed in double so the kernel's copies are exact."""
        b1, b2 = self.beta1, self.beta2
        return (b2, 1.0 - b1, 1.0 - b2, *log2_pair(b1), *log2_pair(b2), self.eps, self.weight_decay)


KERNEL_SCALARS = ("beta2", "1-beta1", "1-beta2", "log2 beta1 hi", "log2 beta1 lo", "log2 beta2 hi",
                  "log2 beta2 lo", "eps", "weight_decay")


class Bucket:
    """Tensors of one group that run the same way on one device: params and their state, as the
    kernels take them (local shards of DTensors)."""

    def __init__(self, params: list[Tensor], states: list[dict], amsgrad: bool) -> None:
        self.sources = params  # the optimizer's params, whose .grad the step reads
        self.params = [local(p) for p in params]
        self.device = self.params[0].device
        self.exp_avgs = [local(s["exp_avg"]) for s in states]
        self.exp_avg_sqs = [local(s["exp_avg_sq"]) for s in states]
        self.max_exp_avg_sqs = [local(s["max_exp_avg_sq"]) for s in states] if amsgrad else []
        self.steps = share_step_counts(states, self.device)
        self._states = states
        self._last: tuple[Hyper, float | Tensor] | None = None  # the last step's hyperparameters and lr

    def step_views(self) -> list[Tensor]:
        return [s["step"] for s in self._states]

    def grads(self) -> list[Tensor]:
        return checked_grads(self.sources)

    def run(self, h: Hyper, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        raise NotImplementedError

    def update_amax(self) -> Tensor:
        """The last step's largest |lr m̂ / (√v̂ + ε)| (the Adam update, weight decay left out) as a
        0-d fp32 tensor, recomputed from the state when called: no cost in the step itself, and
        under a CUDA graph replay it reads the state and lr the replay left. A step that
        ``found_inf`` skipped left the state, and so this value, as the step before it."""
        if self._last is None:
            return torch.zeros((), device=self.device)
        h, lr = self._last
        lr = torch.as_tensor(lr, device=self.device).double().reshape(())
        vs = self.max_exp_avg_sqs if h.amsgrad else self.exp_avg_sqs
        amax = torch.zeros((), dtype=torch.float32, device=self.device)
        for m, v, t in zip(self.exp_avgs, vs, self.steps.double(), strict=True):
            step_size = (lr / (1 - h.beta1**t)).float()
            bc2_sqrt = torch.sqrt(1 - h.beta2**t).float()
            update = step_size * m.float().abs() / (v.float().sqrt() / bc2_sqrt + h.eps)
            amax = torch.maximum(amax, update.max() if update.numel() else amax)
        return amax


class Reference(Bucket):
    def run(self, h, grad_scale, found_inf):
        self._last = (h, h.lr)
        adam_reference_step(
            self.params, self.grads(), self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs,
            self.step_views(),
            lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
            decoupled=h.decoupled, amsgrad=h.amsgrad, maximize=h.maximize,
            grad_scale=grad_scale, found_inf=found_inf,
        )  # fmt: skip


class TorchFused(Bucket):
    """torch's own fused CPU kernel (what torch.optim.AdamW(fused=True) runs on CPU)."""

    def run(self, h, grad_scale, found_inf):
        self._last = (h, h.lr)
        torch_functional_adam(
            self.params, self.grads(), self.exp_avgs, self.exp_avg_sqs, self.max_exp_avg_sqs,
            self.step_views(),
            foreach=False, capturable=False, differentiable=False, fused=True,
            grad_scale=grad_scale, found_inf=found_inf, has_complex=False,
            decoupled_weight_decay=h.decoupled, amsgrad=h.amsgrad, beta1=h.beta1, beta2=h.beta2,
            lr=h.lr, weight_decay=h.weight_decay, eps=h.eps, maximize=h.maximize,
        )  # fmt: skip


class TritonBucket(Bucket):
    """What both Triton buckets share: variant selection, the lr buffer, counters."""

    multi_tensor: bool

    def __init__(self, params, states, amsgrad, decoupled, maximize, state_dtype) -> None:
        super().__init__(params, states, amsgrad)
        self._variant = dict(
            multi_tensor=self.multi_tensor,
            param_dtype=TRITON_DTYPES[params[0].dtype],
            state_dtype=TRITON_DTYPES[state_dtype],
            decoupled=decoupled,
            amsgrad=amsgrad,
            maximize=maximize,
        )
        self._kernels: dict[bool, Callable] = {}
        self._warm: dict[bool, precompile.Warm] = {}  # variants compiling in the background
        self.done = torch.zeros(len(params), dtype=torch.int32, device=self.device)
        self.lr_tensor = LrBuffer(self.device)
        arch = "cpu" if self.device.type == "cpu" else detect_arch(self.device)
        total = sum(p.numel() for p in params)
        self.config = dict(select(ADAMW, arch, ADAMW.variant(**self._variant, grad_scaling=False),
                                  self._variant["param_dtype"], total))  # fmt: skip
        self.chunk = self.config["CHUNK"]

    def configure(self, config) -> None:
        """Launch with ``config`` from now on (benchmarks and the tuner try configs this way)."""
        self.config = dict(ADAMW.check_config(config))
        self.chunk = self.config["CHUNK"]

    @property
    def launch_options(self) -> dict:
        """The kernel's keyword arguments: the config, whose num_stages the BLOCK loop pipelines
        (STAGES; a launch's num_stages alone pipelines only loops that feed tl.dot)."""
        return dict(self.config, STAGES=self.config["num_stages"])

    def _load(self, grad_scaling: bool) -> Callable:
        k = self._kernels.get(grad_scaling)
        if k is None:
            variant = ADAMW.variant(**self._variant, grad_scaling=grad_scaling)
            k = self._kernels[grad_scaling] = load(ADAMW, variant).adam_kernel
        return k

    def kernel(self, grad_scaling: bool) -> Callable:
        """The kernel to launch now (once its background compile, if any, has finished)."""
        warm = self._warm.pop(grad_scaling, None)
        if warm is not None:
            warm.wait()
        return self._load(grad_scaling)

    def lr_for_step(self, h: Hyper) -> Tensor:
        """The device lr the kernel reads this step (kept for ``update_amax``)."""
        lr = self.lr_tensor(h.lr)
        self._last = (h, lr)
        return lr

    def scaler_args(self, grad_scale, found_inf) -> tuple[Tensor, Tensor]:
        if grad_scale is None and found_inf is None:
            return self.steps, self.steps  # unused placeholders
        if grad_scale is None:
            grad_scale = torch.ones((), device=self.device)
        if found_inf is None:
            found_inf = torch.zeros((), device=self.device)
        return grad_scale.to(self.device), found_inf.to(self.device)


class TritonSingleTensor(TritonBucket):
    multi_tensor = False

    def run(self, h, grad_scale, found_inf):
        kernel = self.kernel(grad_scale is not None or found_inf is not None)
        lr = self.lr_for_step(h)
        gs, fi = self.scaler_args(grad_scale, found_inf)
        scalars = h.kernel_scalars()
        for i, (p, g) in enumerate(zip(self.params, self.grads(), strict=True)):
            vmax = self.max_exp_avg_sqs[i] if h.amsgrad else self.exp_avg_sqs[i]
            n = p.numel()
            kernel[(-(-n // self.chunk),)](
                p, g.contiguous(), self.exp_avgs[i], self.exp_avg_sqs[i], vmax, n,
                self.steps[i], self.done[i], lr, gs, fi, *scalars, **self.launch_options,
            )  # fmt: skip


class TritonMultiTensor(TritonBucket):
    multi_tensor = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        dev = self.device
        self._numels = torch.tensor([p.numel() for p in self.params], dtype=torch.int64)
        self.numel = self._numels.to(dev)
        self.configure(self.config)
        self.param_table = pointer_table(self.params, dev)
        self.exp_avg_table = pointer_table(self.exp_avgs, dev)
        self.exp_avg_sq_table = pointer_table(self.exp_avg_sqs, dev)
        self.max_table = pointer_table(self.max_exp_avg_sqs, dev) if self.max_exp_avg_sqs else self.exp_avg_sq_table
        self._grads = GradTable(dev, len(self.params))
        # both variants (with and without GradScaler's tensors) are queued now, GradScaler's behind
        # the rest (precompile.py); a dtype stands for a tensor the launch takes later (the lr
        # buffer, GradScaler's)
        for scaling in (False, True):
            scaler = (torch.float32, torch.float32) if scaling else self.scaler_args(None, None)
            args = self._args(self._grads.table, torch.float32, *scaler, (0.0,) * len(KERNEL_SCALARS))
            self._warm[scaling] = precompile.warm(self._load(scaling), (self.n_work,), args, self.launch_options, dev,
                                                  later=scaling)  # fmt: skip

    def configure(self, config) -> None:
        super().configure(config)
        self.work, self.nchunks = chunk_work_list(self._numels, self.chunk, self.device)
        self.n_work = self.work.shape[0]

    def _args(self, grad_table, lr, gs, fi, scalars) -> tuple:
        return (self.work, self.numel, self.nchunks, self.param_table, grad_table, self.exp_avg_table,
                self.exp_avg_sq_table, self.max_table, self.steps, self.done, lr, gs, fi, *scalars)  # fmt: skip

    def run(self, h, grad_scale, found_inf):
        # Grads are validated when their addresses change (a new grad tensor), not every step.
        grad_table = self._grads.update(self.sources, self.grads)
        kernel = self.kernel(grad_scale is not None or found_inf is not None)
        gs, fi = self.scaler_args(grad_scale, found_inf)
        kernel[(self.n_work,)](*self._args(grad_table, self.lr_for_step(h), gs, fi, h.kernel_scalars()),
                               **self.launch_options)  # fmt: skip


def _bucket_kind(p: Tensor, state_dtype: torch.dtype, mode: str) -> type[Bucket]:
    path = kernel_path(p, mode)
    if path == "cpu":  # torch's fused CPU kernel keeps state in the parameter dtype
        return TorchFused if state_dtype == p.dtype else Reference
    if path == "reference" or state_dtype not in TRITON_DTYPES or p.numel() == 0:
        return Reference
    if path == "interpreter":
        return TritonSingleTensor
    return TritonMultiTensor if aligned([p]) else TritonSingleTensor


def _init_state(p: Tensor, state: dict, amsgrad: bool, state_dtype: torch.dtype) -> None:
    """Lazily create (or, after a checkpoint load, normalise) one parameter's state: tensors like
    the param (DTensors with its placements for a DTensor param)."""
    if "step" not in state:
        state["step"] = torch.zeros((), dtype=torch.float32)
    keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
    for key in keys:
        t = state.get(key)
        shard = local(t) if t is not None else None
        if t is None:
            state[key] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.contiguous_format)
        elif (t.dtype != state_dtype or shard.device != local(p).device or not shard.is_contiguous()
              or shard.data_ptr() % 16):  # fmt: skip
            # A loaded checkpoint may hold views into shared storage: the kernels need
            # contiguous, 16-byte aligned state of the expected dtype on the param's device.
            state[key] = t.to(device=p.device, dtype=state_dtype, memory_format=torch.contiguous_format, copy=True)


def _state_dtype(p: Tensor, group: dict) -> torch.dtype:
    """fp32 for bf16/fp16 params when the group asks for fp32 state, else the param's dtype."""
    return torch.float32 if group.get("state_dtype") == "fp32" and p.dtype in TRITON_DTYPES else p.dtype


def init_group_state(group: dict, state: dict) -> None:
    """Create the state of each parameter of ``group`` that can be stepped (requires grad, not on
    the meta device) now, not on its first step: DCP's ``get_optimizer_state_dict`` on an optimizer
    without state runs a fake step to make some."""
    for p in group["params"]:
        if p.requires_grad and not p.is_meta:
            _init_state(p, state[p], bool(group["amsgrad"]), _state_dtype(p, group))


class AdamGroupPlan:
    """How one param group steps: its buckets, built from the params that have grads."""

    def __init__(self, key: tuple, params: list[Tensor], state: dict, group: dict,
                 backend: str | None = None) -> None:  # fmt: skip
        """``backend`` overrides KERNEL_FACTORY_BACKEND (auto | triton | torch)."""
        self.key = key
        mode = backend or backend_mode()
        amsgrad = bool(group["amsgrad"])
        kinds: dict[tuple, list[Tensor]] = {}
        for p in params:
            sd = _state_dtype(p, group)
            _init_state(p, state[p], amsgrad, sd)
            shard = local(p)
            kinds.setdefault((_bucket_kind(shard, sd, mode), shard.device, p.dtype, sd), []).append(p)
        self.buckets: list[Bucket] = []
        for (kind, _, _, sd), ps in kinds.items():
            states = [state[p] for p in ps]
            if issubclass(kind, TritonBucket):
                bucket = kind(ps, states, amsgrad, bool(group["decoupled_weight_decay"]),
                              bool(group["maximize"]), sd)  # fmt: skip
            else:
                bucket = kind(ps, states, amsgrad)
            self.buckets.append(bucket)

    def run(self, group: dict, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        h = Hyper(group)
        for bucket in self.buckets:
            if bucket.device.type == "cuda" and bucket.device.index != torch.cuda.current_device():
                with torch.cuda.device(bucket.device):  # Triton launches on the current device
                    bucket.run(h, grad_scale, found_inf)
            else:
                bucket.run(h, grad_scale, found_inf)

    def update_amax(self) -> Tensor:
        """The last step's largest |update| over the buckets (``Bucket.update_amax``), on the first
        bucket's device."""
        device = self.buckets[0].device
        return torch.stack([b.update_amax().to(device) for b in self.buckets]).max()


def group_plan(plans: dict[int, AdamGroupPlan], index: int, params: list[Tensor], state: dict, group: dict,
               backend: str | None = None) -> AdamGroupPlan:  # fmt: skip
    """The cached plan of param group ``index`` (``plans``: index -> plan), rebuilt when the params
    with grads or the group's structural options changed."""
    key = (tuple(map(id, params)), group["amsgrad"], group["maximize"], group["decoupled_weight_decay"],
           group.get("state_dtype"))  # fmt: skip
    plan = plans.get(index)
    if plan is None or plan.key != key:
        plan = plans[index] = AdamGroupPlan(key, params, state, group, backend)
    return plan


register_group_stepper("adamw", group_plan, init_group_state)
