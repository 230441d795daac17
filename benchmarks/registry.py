"""The optimizers that race: ours, torch.optim's, and peers when they are installed.

Each entry builds an optimizer from named parameters. A peer whose package is missing (or
that needs CUDA on a CPU run) is skipped with a one-line note; an unknown name is an error
listing the known ones.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from kernel_factory.optimizers import Adafactor, AdamMini, AdamW, Muon, TurboAdam

BETAS = (0.9, 0.95)
NamedParams = list[tuple[str, Tensor]]


@dataclass(frozen=True)
class Shape:
    """What Hessian-aware optimizers (adam-mini) need to know about the model."""

    dim: int
    n_heads: int
    n_kv_heads: int


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    build: Callable[[NamedParams, Shape, float, float], object]  # (params, shape, lr, wd)
    module: str | None = None  # the package a peer needs
    cuda_only: bool = False
    capturable: bool = False  # a step can be captured in a CUDA graph
    # param-sized reads a step needs beyond one pass over p, g and the state (the floor's bytes):
    # Adafactor's three passes read g twice more and p once more
    extra_reads: int = 0
    # a Muon step, bound by NS's matrix products: its floor is their FLOPs at the matmul rate
    ns_floor: bool = False

    def missing(self, device: str) -> str | None:
        """Why this optimizer cannot run here, or None."""
        if self.module and importlib.util.find_spec(self.module) is None:
            return f"{self.name}: skipped, package {self.module!r} is not installed"
        if self.cuda_only and device != "cuda":
            return f"{self.name}: skipped, needs a CUDA device"
        return None


class Chain:
    """Two optimizers stepped as one (Muon for hidden matrices, AdamW for the rest)."""

    def __init__(self, *optimizers) -> None:
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def _tensors(named: NamedParams) -> list[Tensor]:
    return [p for _, p in named]


def _is_hidden_matrix(name: str, p: Tensor) -> bool:
    return p.ndim == 2 and not any(k in name for k in ("embed", "lm_head"))


def _muon(named, shape, lr, wd):
    hidden = [p for n, p in named if _is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not _is_hidden_matrix(n, p)]
    # match_rms_adamw scales Muon's update to AdamW's RMS, so both take the same lr.
    parts = [torch.optim.Muon(hidden, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw")] if hidden else []
    if rest:
        parts.append(torch.optim.AdamW(rest, lr=lr, betas=BETAS, weight_decay=wd))
    return Chain(*parts)


def _ours_muon(named, shape, lr, wd):
    # torch_muon's split and hyperparameters: Muon's default name rules send embed/lm_head to AdamW.
    return Muon(named, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw", adamw_lr=lr, adamw_betas=BETAS,
                adamw_weight_decay=wd)  # fmt: skip


def _adam_mini(named, shape, lr, wd):
    from adam_mini import Adam_mini

    return Adam_mini(named, lr=lr, betas=BETAS, weight_decay=wd, dim=shape.dim, n_heads=shape.n_heads,
                     n_kv_heads=shape.n_kv_heads, verbose=False)  # fmt: skip


def _ours_adam_mini(momentum: str):
    def build(named, shape, lr, wd):
        return AdamMini(named, lr=lr, betas=BETAS, weight_decay=wd, dim=shape.dim, n_heads=shape.n_heads,
                        n_kv_heads=shape.n_kv_heads, momentum_dtype=momentum)  # fmt: skip

    return build


def _torchao(cls_name: str):
    def build(named, shape, lr, wd):
        import torchao.optim

        return getattr(torchao.optim, cls_name)(_tensors(named), lr=lr, betas=BETAS, weight_decay=wd)

    return build


def _torch_adamw(**impl):
    def build(named, shape, lr, wd):
        params = _tensors(named)
        # capturable (CUDA only) lets the benchmark replay a step from a CUDA graph.
        return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=wd, capturable=params[0].is_cuda, **impl)

    return build


def _turboadam(named, shape, lr, wd):
    import turboadam

    return turboadam.TurboAdam(_tensors(named), lr=lr, betas=BETAS, weight_decay=wd)


def _flashoptim(named, shape, lr, wd):
    import flashoptim

    params = _tensors(named)
    # its 24-bit master weights are for bf16/fp16 params; it refuses them for fp32 ones
    bits = None if params[0].dtype == torch.float32 else 24
    return flashoptim.FlashAdamW(params, lr=lr, betas=BETAS, weight_decay=wd, master_weight_bits=bits)


def _adafactor8bit(named, shape, lr, wd):
    import adafactor8bit

    # relative_step=False: torch's step size min(lr, 1/sqrt(t)) RMS(p), without its host syncs
    return adafactor8bit.Adafactor8Bit(_tensors(named), lr=lr, weight_decay=wd, relative_step=False)


def _bnb(named, shape, lr, wd):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(_tensors(named), lr=lr, betas=BETAS, weight_decay=wd)


REGISTRY: dict[str, OptimizerSpec] = {
    s.name: s
    for s in (
        OptimizerSpec("kernel_factory_adamw",
                      lambda n, s, lr, wd: AdamW(_tensors(n), lr=lr, betas=BETAS, weight_decay=wd), capturable=True),
        OptimizerSpec("torch_adamw_fused", _torch_adamw(fused=True), capturable=True),
        OptimizerSpec("torch_adamw_foreach", _torch_adamw(foreach=True), capturable=True),
        OptimizerSpec("kernel_factory_adam_mini", _ours_adam_mini("fp8"), capturable=True),
        OptimizerSpec("kernel_factory_adam_mini_fp32", _ours_adam_mini("fp32"), capturable=True),
        OptimizerSpec("adam_mini", _adam_mini, module="adam_mini"),
        OptimizerSpec("torchao_adamw8bit", _torchao("AdamW8bit"), module="torchao", cuda_only=True),
        OptimizerSpec("torchao_adamw4bit", _torchao("AdamW4bit"), module="torchao", cuda_only=True),
        OptimizerSpec("torchao_adamw_fp8", _torchao("AdamWFp8"), module="torchao", cuda_only=True),
        OptimizerSpec("bnb_adamw8bit", _bnb, module="bitsandbytes", cuda_only=True),
        OptimizerSpec("kernel_factory_turbo_adam",
                      lambda n, s, lr, wd: TurboAdam(_tensors(n), lr=lr, betas=BETAS, weight_decay=wd),
                      capturable=True),
        OptimizerSpec("kernel_factory_turbo_adam_v_only",
                      lambda n, s, lr, wd: TurboAdam(_tensors(n), lr=lr, betas=BETAS, weight_decay=wd,
                                                     compress_m=False),
                      capturable=True),
        OptimizerSpec("turboadam", _turboadam, module="turboadam", cuda_only=True),
        OptimizerSpec("flashoptim_adamw", _flashoptim, module="flashoptim", cuda_only=True),
        OptimizerSpec("torch_muon", _muon, ns_floor=True),
        OptimizerSpec("kernel_factory_muon", _ours_muon, ns_floor=True),
        OptimizerSpec("torch_adafactor",
                      lambda n, s, lr, wd: torch.optim.Adafactor(_tensors(n), lr=lr, weight_decay=wd), extra_reads=3),
        OptimizerSpec("kernel_factory_adafactor",
                      lambda n, s, lr, wd: Adafactor(_tensors(n), lr=lr, weight_decay=wd), capturable=True,
                      extra_reads=3),
        OptimizerSpec("kernel_factory_adafactor_fp32_stats",
                      lambda n, s, lr, wd: Adafactor(_tensors(n), lr=lr, weight_decay=wd, state_bits=32),
                      capturable=True, extra_reads=3),
        *(OptimizerSpec(f"kernel_factory_adafactor_momentum_{m}",
                        lambda n, s, lr, wd, m=m: Adafactor(_tensors(n), lr=lr, weight_decay=wd, beta1=BETAS[0],
                                                            momentum_dtype=m),
                        capturable=True, extra_reads=3) for m in ("bf16", "int8")),
        OptimizerSpec("adafactor8bit", _adafactor8bit, module="adafactor8bit", cuda_only=True, extra_reads=3),
    )
}  # fmt: skip
OURS = "kernel_factory_adamw"


def select(names: Iterable[str] | None, device: str) -> tuple[list[OptimizerSpec], list[str]]:
    """The runnable specs among ``names`` (all when None), and one note per skipped one.
    Unknown names raise ValueError listing the known ones."""
    names = list(REGISTRY) if names is None else list(names)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown optimizer(s) {unknown}; known: {', '.join(REGISTRY)}")
    specs, notes = [], []
    for name in names:
        why = REGISTRY[name].missing(device)
        (notes.append(why) if why else specs.append(REGISTRY[name]))
    return specs, notes


def state_bytes(optimizer) -> int:
    """Bytes of every tensor in the optimizer's state, packed tensor subclasses (torchao's
    quantized states) counted by their inner tensors, tensors in nested dicts, lists and tuples
    (turboadam's per-moment code records) and in the attributes of plain wrapper objects
    (flashoptim's quantized moments) counted too, a few levels deep."""

    def nbytes(x, depth: int = 0) -> int:
        if depth > 3:
            return 0
        if isinstance(x, dict):
            return sum(nbytes(v, depth + 1) for v in x.values())
        if isinstance(x, list | tuple):
            return sum(nbytes(v, depth + 1) for v in x)
        if not isinstance(x, Tensor):
            return sum(nbytes(v, depth + 1) for v in vars(x).values()) if hasattr(x, "__dict__") else 0
        if hasattr(x, "__tensor_flatten__") and type(x) is not Tensor and not isinstance(x, torch.nn.Parameter):
            inner, _ = x.__tensor_flatten__()
            return sum(nbytes(getattr(x, a), depth + 1) for a in inner)
        return x.numel() * x.element_size()

    return sum(nbytes(s) for s in optimizer.state.values())
