"""TurboAdam's step in plain PyTorch, one parameter at a time: decode the stored moments, form this
step's exact fp32 moments and AdamW's update from them, re-encode (codecs.py). The CPU path and the
oracle the kernels will be held to."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..shared import log_codes
from . import codecs


@dataclass(frozen=True)
class Layout:
    """How one parameter's moments are kept: ``m`` compressed or exact; ``v`` one of
    ``codecs.V_CODECS`` or None (exact); ``block`` elements per block within a row."""

    compress_m: bool
    v_codec: str | None
    block: int

    @property
    def exact(self) -> bool:
        return not self.compress_m and self.v_codec is None


def matrix_view(t: Tensor) -> Tensor:
    """``t`` as (rows, cols): rows = shape[0], a vector (or a scalar) one row; a shard of no rows too."""
    return t.reshape(1, -1) if t.dim() < 2 else t.reshape(t.shape[0], math.prod(t.shape[1:]))


def init_state(p: Tensor, layout: Layout) -> dict[str, Tensor]:
    """Zero state of ``p`` (a plain tensor, or a DTensor's local rows) in ``layout`` (docstring of
    ``TurboAdam`` lists the keys)."""
    rows, cols = matrix_view(p).shape
    nb = -(-cols // layout.block)
    dev = p.device
    state = {"step": torch.zeros((), dtype=torch.float32, device=dev)}
    if layout.compress_m:
        state["exp_avg_codes"] = torch.zeros((rows, log_codes.planar_bytes(cols, 4)), dtype=torch.uint8, device=dev)
        state["exp_avg_scale"] = torch.zeros((rows, nb), dtype=torch.bfloat16, device=dev)
    else:
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
    if layout.v_codec is None:
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        return state
    bits, _ = codecs.V_CODECS[layout.v_codec]
    state["exp_avg_sq_codes"] = torch.zeros((rows, log_codes.planar_bytes(cols, bits)), dtype=torch.uint8, device=dev)
    if layout.v_codec == codecs.FACTORED:
        state["exp_avg_sq_row"] = torch.zeros(rows, dtype=torch.float32, device=dev)
        state["exp_avg_sq_col"] = torch.zeros(cols, dtype=torch.float32, device=dev)
    else:
        state["exp_avg_sq_base"] = torch.zeros((rows, nb), dtype=torch.int16, device=dev)
    return state


def decoded_moments(state: dict[str, Tensor], shape: tuple[int, int], layout: Layout) -> tuple[Tensor, Tensor]:
    """(m, v) fp32 (rows, cols) as stored."""
    _, cols = shape
    v = decoded_v(state, cols, layout)
    if layout.compress_m:  # coded relative to sqrt(v): v first
        m = codecs.decode_m(state["exp_avg_codes"], state["exp_avg_scale"], v, layout.block)
    else:
        m = matrix_view(state["exp_avg"]).to(torch.float32, copy=True)
    return m, v


def decoded_v(state: dict[str, Tensor], cols: int, layout: Layout) -> Tensor:
    """v fp32 (rows, cols) as stored (the factored codec against the row and column means the state
    holds)."""
    if layout.v_codec is None:
        return matrix_view(state["exp_avg_sq"]).to(torch.float32, copy=True)
    if layout.v_codec == codecs.FACTORED:
        return codecs.decode_v_factored(state["exp_avg_sq_codes"], state["exp_avg_sq_row"], state["exp_avg_sq_col"])
    return codecs.decode_v_log(state["exp_avg_sq_codes"], state["exp_avg_sq_base"], layout.v_codec, cols, layout.block)


def turbo_adam_step(p: Tensor, grad: Tensor, state: dict[str, Tensor], layout: Layout, *, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float, seed: int, rows_index: Tensor | None = None,
                    col_sq_mean: Tensor | None = None) -> Tensor:  # fmt: skip
    """One TurboAdam step of ``p`` (fp32, bf16 or fp16) in place: AdamW's update from this step's
    exact fp32 moments, then the moments re-encoded. ``seed``: this parameter's random stream.
    Sharded (FSDP2): ``p``, ``grad`` and ``state`` are this rank's rows, ``rows_index`` their global
    indices (the random bits follow the element, not the rank) and ``col_sq_mean`` (cols,) the mean
    of g² over all ranks' rows (the factored codec's column statistic). Returns the largest
    |lr m̂ / (sqrt(v̂) + eps)| of the step (0-d fp32; weight decay left out)."""
    state["step"] += 1
    if not p.numel():  # an empty shard (FSDP2's tail rank): the step count and the replicated column
        if col_sq_mean is not None:  # means advance as on every rank, with no host read of the step
            state["exp_avg_sq_col"].mul_(beta2).add_(col_sq_mean, alpha=1 - beta2)
        return torch.zeros((), dtype=torch.float32, device=p.device)
    x = matrix_view(p)
    g = matrix_view(grad).float()
    rows, cols = x.shape
    step = int(state["step"].item())
    m, v = decoded_moments(state, (rows, cols), layout)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1, bc2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
    xf = x.float()
    xf.mul_(1 - lr * weight_decay)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    amax = (m / denom).abs().amax() * (lr / bc1) if m.numel() else m.new_zeros(())
    xf.addcdiv_(m, denom, value=-lr / bc1)
    x.copy_(xf)
    if layout.v_codec == codecs.FACTORED:  # Adafactor's statistics of this step's g², then the codes
        sq = g * g
        state["exp_avg_sq_row"].mul_(beta2).add_(sq.mean(1), alpha=1 - beta2)
        state["exp_avg_sq_col"].mul_(beta2).add_(sq.mean(0) if col_sq_mean is None else col_sq_mean, alpha=1 - beta2)
    store_moments(state, m, v, layout, seed, step, rows_index)
    return amax


def store_moments(state: dict[str, Tensor], m: Tensor, v: Tensor, layout: Layout, seed: int, step: int,
                  rows_index: Tensor | None = None) -> None:  # fmt: skip
    """Encode fp32 m and v (rows, cols) into ``state``'s existing storage (a loaded state and a
    captured graph keep theirs); the factored codec codes v against the row and column means the
    state holds. ``step`` and the elements' global indices (rows ``rows_index``, default 0..rows-1)
    pick the random bits."""
    rows, cols = m.shape
    if rows_index is None:
        rows_index = torch.arange(rows, dtype=torch.int64, device=m.device)
    if layout.v_codec is None:
        matrix_view(state["exp_avg_sq"]).copy_(v)
    else:
        u = log_codes.plane_uniforms(seed, step, rows_index, cols)
        if layout.v_codec == codecs.FACTORED:
            codes = codecs.encode_v_factored(v, state["exp_avg_sq_row"], state["exp_avg_sq_col"], u)
        else:
            codes = codecs.encode_v_log(v, state["exp_avg_sq_base"], layout.v_codec, layout.block, u)
        state["exp_avg_sq_codes"].copy_(codes)
    if layout.compress_m:  # against v as the next step decodes it
        u = log_codes.plane_uniforms(seed, step, rows_index, cols, codecs.M_STREAM)
        codes, scale = codecs.encode_m(m, stored_inverse_root(state, v, cols, layout), layout.block, u)
        state["exp_avg_codes"].copy_(codes)
        state["exp_avg_scale"].copy_(scale)
    else:
        matrix_view(state["exp_avg"]).copy_(m)


def stored_inverse_root(state: dict[str, Tensor], v: Tensor, cols: int, layout: Layout) -> Tensor:
    """1 / sqrt of v (rows, cols) as ``state`` now stores it (v: the exact value, where kept exact)."""
    if layout.v_codec is None:
        return codecs.inverse_root(v)
    if layout.v_codec == codecs.FACTORED:
        return codecs.factored_inverse_root(state["exp_avg_sq_codes"], state["exp_avg_sq_row"], state["exp_avg_sq_col"])
    return codecs.log_inverse_root(state["exp_avg_sq_codes"], state["exp_avg_sq_base"], layout.v_codec, cols,
                                   layout.block)  # fmt: skip


def layout_of_state(state: dict[str, Tensor], cols: int, block: int) -> Layout:
    """The layout a state was kept in, read from its keys (and, for per-element log codes, from the
    codes' width: 4 bits pack two per byte, 8 bits one)."""
    codec = None
    if "exp_avg_sq_row" in state:
        codec = codecs.FACTORED
    elif "exp_avg_sq_base" in state:
        four = state["exp_avg_sq_codes"].shape[-1] == log_codes.planar_bytes(cols, 4)
        codec = codecs.LOG4 if four else codecs.LOG8
    return Layout("exp_avg_codes" in state, codec, block)


def convert_state(p: Tensor, state: dict[str, Tensor], target: Layout, seed: int) -> dict[str, Tensor]:
    """``state`` (any layout: torch AdamW's ``exp_avg`` / ``exp_avg_sq``, or codes) re-kept in
    ``target``; the factored codec's row and column means are taken from v's."""
    rows, cols = matrix_view(p).shape
    m, v = decoded_moments(state, (rows, cols), layout_of_state(state, cols, target.block))
    out = init_state(p, target)
    out["step"] = state["step"].detach().to(torch.float32).reshape(()).clone()
    if target.v_codec == codecs.FACTORED:
        out["exp_avg_sq_row"].copy_(v.mean(1))
        out["exp_avg_sq_col"].copy_(v.mean(0))
    store_moments(out, m.to(p.device), v.to(p.device), target, seed, int(out["step"].item()))
    return out
