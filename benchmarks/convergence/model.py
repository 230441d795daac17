"""A small decoder-only transformer with Llama-style parameter names.

Names: ``embed_tokens``, ``layers.N.self_attn.{q,k,v,o}_proj`` (grouped-query attention:
``n_kv_heads`` key/value heads shared by ``n_heads // n_kv_heads`` query heads each),
``layers.N.mlp.{gate,up,down}_proj`` (SwiGLU), ``layers.N.{input,post_attention}_layernorm``,
``norm`` (RMSNorms) and ``lm_head``. Rotary position embeddings (Su et al., 2021).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    head_dim: int | None = None  # defaults to dim // n_heads

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; give head_dim")

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (first half, second half) of the last dim of x [B, H, T, hd]."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.dim, c.n_heads * c.hd, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.hd, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.hd, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.hd, c.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.n_heads, c.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.n_kv_heads, c.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.n_kv_heads, c.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        group = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c.n_heads * c.hd))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.up_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.down_proj = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.dim)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.dim)
        self.mlp = MLP(c)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    """logits [B, T, vocab] from token ids [B, T] (T <= max_seq_len)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, c.hd, 2).float() / c.hd))
        angles = torch.outer(torch.arange(c.max_seq_len).float(), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len={self.config.max_seq_len}")
        x = self.embed_tokens(idx)
        cos, sin = self.cos[:t], self.sin[:t]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
