"""Hessian-aware partition of a model's parameters into Adam-mini blocks.

Adam-mini (Zhang et al. 2024, arXiv:2406.16793) keeps one second-moment value per block of
the Hessian's near-block-diagonal structure. Every block here is a run of whole rows of the
parameter viewed as a matrix (rows = shape[0], cols = numel // rows; a 1-D tensor is one row),
so a block is contiguous in memory and a kernel reads it as rows (a vector is one row):

- ``head``:  Q and K, one block per attention head (``head_dim`` rows);
- ``row``:   V, attention output, MLP, embeddings and lm_head, one block per row (output
  neuron, or token for the embeddings and lm_head);
- ``whole``: norms (and, as in adam-mini 1.1.1, parameters no rule names) as one block;
- ``adam``:  biases, one second moment per element (plain Adam);
- ``fused_qkv``: a fused QKV weight split by rows into Q heads, K heads and V rows.

Names are matched lower-cased by substring with adam-mini 1.1.1's lists and precedence
(bias, then Q/K, then the per-row kinds, else one block); users extend any list through
``NameRules``. Parameters no rule names are listed with kind ``whole (unmatched)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

KINDS = ("head", "row", "whole", "adam", "fused_qkv")


@dataclass(frozen=True)
class NameRules:
    """Lower-case substrings that name each kind (adam-mini 1.1.1's lists by default)."""

    embed: tuple[str, ...] = ("embed", "embd", "wte")
    output: tuple[str, ...] = ("lm_head", "output", "final_layer")
    query_key: tuple[str, ...] = ("q_proj", "k_proj", "wq", "wk", "query", "key")
    value: tuple[str, ...] = ("v_proj", "wv", "value")
    attn_out: tuple[str, ...] = ("o_proj", "wo", "attn.proj")
    mlp: tuple[str, ...] = ("mlp", "feed_forward", "linear")
    adam: tuple[str, ...] = ("bias",)
    norm: tuple[str, ...] = ("norm",)
    fused_qkv: tuple[str, ...] = ("qkv", "c_attn", "query_key_value")
    no_decay: tuple[str, ...] = ("norm", "ln", "bias")

    def extended(self, **extra: tuple[str, ...] | list[str]) -> NameRules:
        """These rules with more substrings added to the named lists, e.g.
        ``NameRules().extended(embed=("tok_emb",))``."""
        unknown = set(extra) - set(self.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown name rule(s) {sorted(unknown)}; known: {', '.join(self.__dataclass_fields__)}")
        return replace(self, **{k: (*getattr(self, k), *(s.lower() for s in v)) for k, v in extra.items()})


@dataclass(frozen=True)
class ModelShape:
    """Attention geometry: ``head_dim`` defaults to dim // n_heads; GQA through n_kv_heads."""

    dim: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("dim", "n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}: pass head_dim")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads


@dataclass(frozen=True)
class Segment:
    """``count`` rows from ``start``, split into blocks of ``rows_per_block`` rows."""

    start: int
    count: int
    rows_per_block: int

    @property
    def blocks(self) -> int:
        return self.count // self.rows_per_block


@dataclass(frozen=True)
class ParamPartition:
    """How one parameter is split: its matrix view (rows x cols) and its row segments."""

    name: str
    shape: tuple[int, ...]
    kind: str
    segments: tuple[Segment, ...]
    weight_decay: bool
    matched: bool = True

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) >= 2 else 1  # a vector is one row

    @property
    def cols(self) -> int:
        return math.prod(self.shape) // self.rows if self.rows else 0

    @property
    def blocks(self) -> int:
        """Second-moment values kept for this parameter."""
        if self.kind == "adam":
            return math.prod(self.shape)
        return sum(s.blocks for s in self.segments)

    def block_rows(self) -> list[int]:
        """Row boundaries of the blocks: block i spans rows [b[i], b[i+1])."""
        bounds = [0]
        for s in self.segments:
            bounds += [s.start + (i + 1) * s.rows_per_block for i in range(s.blocks)]
        return bounds

    def block_numel(self) -> Tensor:
        """Elements of each block, whole: fp32 [blocks] (the divisor of its sum of g²)."""
        bounds = self.block_rows()
        return torch.tensor([(b - a) * self.cols for a, b in zip(bounds, bounds[1:], strict=False)],
                            dtype=torch.float32)  # fmt: skip


@dataclass
class Partition:
    """The partition of every parameter, in the order given."""

    params: list[ParamPartition] = field(default_factory=list)

    def table(self, momentum_dtype: str = "") -> list[tuple]:
        """Rows (name, shape, kind, blocks, momentum dtype)."""
        return [(p.name, p.shape, p.kind if p.matched else "whole (unmatched)", p.blocks, momentum_dtype)
                for p in self.params]  # fmt: skip

    def unmatched(self) -> list[str]:
        return [p.name for p in self.params if not p.matched]


def format_table(rows: list[tuple]) -> str:
    """A plain-text table of ``Partition.table`` rows."""
    head = ("name", "shape", "kind", "blocks", "momentum")
    cells = [head] + [(n, "x".join(map(str, s)) or "scalar", k, str(b), d) for n, s, k, b, d in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _has(name: str, substrings: tuple[str, ...]) -> bool:
    return any(s in name for s in substrings)


def _heads(name: str, rows: int, head_dim: int) -> Segment:
    if rows % head_dim:
        raise ValueError(f"parameter {name!r}: {rows} rows are not a multiple of head_dim {head_dim}")
    return Segment(0, rows, head_dim)


def partition_param(name: str, p: Tensor, shape: ModelShape, rules: NameRules,
                    qkv_split: tuple[int, int, int] | None = None) -> ParamPartition:  # fmt: skip
    """The partition of one named parameter (see the module docstring for the rules)."""
    lower = name.lower()
    dims = tuple(p.shape)
    rows = dims[0] if len(dims) >= 2 else 1  # a vector is one row
    decay = not _has(lower, rules.no_decay)
    make = lambda kind, segs, matched=True: ParamPartition(name, dims, kind, tuple(segs), decay, matched)  # noqa: E731
    if _has(lower, rules.adam) or p.numel() == 0:  # an empty tensor: no blocks to average over
        return make("adam", [])
    if p.dim() < 2:  # norms, scales: one block (a per-row or per-head split needs a matrix)
        return make("whole", [Segment(0, rows, rows)], matched=_has(lower, rules.norm) or _has(lower, rules.no_decay))
    hd = shape.head_size
    if _has(lower, rules.fused_qkv):
        q, k, v = qkv_split or (shape.n_heads * hd, shape.kv_heads * hd, shape.kv_heads * hd)
        if q + k + v != rows:
            raise ValueError(f"parameter {name!r}: fused QKV split {q}+{k}+{v} != its {rows} rows; pass qkv_split")
        return make("fused_qkv", [_heads(name, q, hd), replace(_heads(name, k, hd), start=q), Segment(q + k, v, 1)])
    if _has(lower, rules.query_key):
        return make("head", [_heads(name, rows, hd)])
    if _has(lower, rules.embed + rules.output + rules.value + rules.attn_out + rules.mlp):
        return make("row", [Segment(0, rows, 1)])
    return make("whole", [Segment(0, rows, rows)], matched=_has(lower, rules.norm))
