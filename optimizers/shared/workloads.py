"""Parameter shape sets used by parity, benchmarks and tuning (DESIGN.md, "Measuring")."""

from __future__ import annotations

import math

import torch


def llama_param_shapes(
    dim: int = 768, layers: int = 12, ffn: int = 2048, vocab: int = 32000, n_heads: int = 12,
    n_kv_heads: int | None = None, head_dim: int | None = None, tied: bool = False, qkv_bias: bool = False,
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a Llama-style decoder: 134.1M parameters in 111 tensors by default,
    84 of them hidden matrices (q, k, v, o, gate, up, down per layer); grouped-query
    attention through ``n_kv_heads``, and a ``head_dim`` other than dim // n_heads. ``tied``: the
    output layer is the embedding (no lm_head); ``qkv_bias``: q, k and v have biases (Qwen2)."""
    hd, kv = head_dim or dim // n_heads, n_kv_heads or n_heads
    shapes = [("embed_tokens.weight", (vocab, dim))]
    for i in range(layers):
        pre = f"layers.{i}."
        attn = {"q": (n_heads * hd, dim), "k": (kv * hd, dim), "v": (kv * hd, dim), "o": (dim, n_heads * hd)}
        shapes += [(pre + f"self_attn.{n}_proj.weight", shape) for n, shape in attn.items()]
        if qkv_bias:
            shapes += [(pre + f"self_attn.{n}_proj.bias", (attn[n][0],)) for n in "qkv"]
        shapes += [(pre + "mlp.gate_proj.weight", (ffn, dim)), (pre + "mlp.up_proj.weight", (ffn, dim)),
                   (pre + "mlp.down_proj.weight", (dim, ffn))]  # fmt: skip
        shapes += [(pre + "input_layernorm.weight", (dim,)), (pre + "post_attention_layernorm.weight", (dim,))]
    shapes += [("norm.weight", (dim,))] + ([] if tied else [("lm_head.weight", (vocab, dim))])
    return shapes


# Models users train, from their public configs (config.json on the Hugging Face hub): the keyword
# arguments of llama_param_shapes. Llama-2-7B is cut to 4 of its 32 layers (its matrices, less
# memory and time).
MODELS: dict[str, dict] = {
    "llama134m": dict(dim=768, layers=12, ffn=2048, vocab=32000, n_heads=12),
    # Qwen/Qwen2.5-0.5B: 494,032,768 parameters
    "qwen2_5_0_5b": dict(dim=896, layers=24, ffn=4864, vocab=151936, n_heads=14, n_kv_heads=2, tied=True,
                         qkv_bias=True),
    # meta-llama/Llama-3.2-1B: 1,235,814,400 parameters
    "llama3_2_1b": dict(dim=2048, layers=16, ffn=8192, vocab=128256, n_heads=32, n_kv_heads=8, tied=True),
    # meta-llama/Llama-2-7b-hf (6,738,415,616 parameters at 32 layers)
    "llama2_7b_4layers": dict(dim=4096, layers=4, ffn=11008, vocab=32000, n_heads=32),
}  # fmt: skip


def model_at_bucket(numel: int, hidden: bool = False) -> str | None:
    """The first model of ``MODELS`` whose parameter count falls in size bucket ``numel`` (the tuners'
    workloads at the models' buckets: 134M at 2^27, Qwen2.5-0.5B at 2^29, Llama-2-7B x 4 at 2^30,
    Llama-3.2-1B at 2^31), or None. ``hidden``: count only the hidden matrices (Muon's share: 134M
    at 2^27, Qwen2.5-0.5B at 2^29, Llama-3.2-1B and Llama-2-7B x 4 both at 2^30)."""
    from kernel_factory.generator import size_bucket

    for name, config in MODELS.items():
        shapes = llama_param_shapes(**config)
        if size_bucket(sum(math.prod(s) for _, s in (hidden_matrices(shapes) if hidden else shapes))) == numel:
            return name
    return None


def model_at(family, numel: int, hidden: bool = False) -> str:
    """``model_at_bucket``, or ValueError naming ``family`` (a KernelFamily) whose tune size has no model."""
    model = model_at_bucket(numel, hidden)
    if model is None:
        raise ValueError(f"{family.name} tune size {numel}: no model list has that bucket (workloads.MODELS)")
    return model


SHAPE_SETS: dict[str, list[tuple[str, tuple[int, ...]]]] = {
    # Odd sizes, a scalar-like tensor and a 3-D one: tails, masks, tiny launches.
    "small": [("one", (1,)), ("seven", (7,)), ("thousand", (1000,)), ("cube", (3, 4, 5)),
              ("matrix", (33, 65))],  # fmt: skip
    "single_4096x1024": [("weight", (4096, 1024))],
    **{name: llama_param_shapes(**config) for name, config in MODELS.items()},
    # A Llama-style list small enough for the interpreter: GQA (4 query, 2 key/value heads).
    "llama_tiny": llama_param_shapes(dim=32, layers=2, ffn=48, vocab=40, n_heads=4, n_kv_heads=2),
}


def hidden_matrices(shapes: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """The entries Muon is for: matrices other than embeddings and lm_head."""
    return [(n, s) for n, s in shapes if len(s) == 2 and "embed" not in n and "lm_head" not in n]


# Muon's share of the Llama-style lists (the 134M list has 84 hidden matrices).
SHAPE_SETS["llama_tiny_hidden"] = hidden_matrices(SHAPE_SETS["llama_tiny"])
SHAPE_SETS["llama134m_hidden"] = hidden_matrices(SHAPE_SETS["llama134m"])


INIT_STD = 0.02  # ShapeModel's parameters: N(0, INIT_STD)


class ShapeModel(torch.nn.Module):
    """A module holding one parameter per (name, shape), initialised N(0, INIT_STD)."""

    def __init__(self, shapes, dtype=torch.float32, device="cpu", seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.names = [name for name, _ in shapes]
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter((torch.randn(shape, generator=gen) * INIT_STD).to(device=device, dtype=dtype))
            for _, shape in shapes
        )

    def named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) pairs under the names given, for optimizers that partition by name."""
        return list(zip(self.names, self.params, strict=True))
