"""What both examples share: a Llama model from transformers' ``LlamaConfig`` (randomly
initialised), batches of a text file read as bytes, our optimizers built for that model, and a
warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kernel_factory.optimizers import AdamMini, AdamW, Muon, format_table

OPTIMIZERS = ("adamw", "adam_mini", "muon")
# "tiny" runs in seconds on a CPU (the test tier runs it); "real" is a 85M-parameter GQA Llama.
SIZES = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "real": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4),
}  # fmt: skip
VOCAB = 256  # bytes
# The corpus beside this project's checkout, when there is one; any UTF-8 text file works.
DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def llama(size: str) -> LlamaForCausalLM:
    """A randomly initialised LlamaForCausalLM of ``SIZES[size]`` over byte tokens."""
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, max_position_embeddings=512, **SIZES[size]))


def text_tokens(path: Path | None) -> torch.Tensor:
    """The bytes of ``path`` (default ``DEFAULT_TEXT``) as int64 tokens; a made-up text where the
    file is missing, so that the examples run anywhere."""
    path = path or DEFAULT_TEXT
    data = path.read_bytes() if path.exists() else b"".join(
        f"step {i}: the quick brown fox jumps over the lazy dog {i * i % 97}.\n".encode() for i in range(4000))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def random_windows(tokens: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """(batch, length) windows of ``tokens`` at random offsets."""
    starts = torch.randint(0, len(tokens) - length, (batch,), generator=gen)
    return torch.stack([tokens[s : s + length] for s in starts.tolist()])


def build_optimizer(name: str, model: LlamaForCausalLM, lr: float) -> torch.optim.Optimizer:
    """Our ``name`` optimizer for ``model`` (on its device already): decoupled weight decay 0.1,
    betas (0.9, 0.95). Muon takes the hidden matrices with an update scaled to AdamW's RMS (so the
    same lr), AdamW the embeddings, lm_head and norms, by their names."""
    if name == "adamw":
        return AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    named = list(model.named_parameters())
    if name == "adam_mini":
        cfg = model.config
        opt = AdamMini(named, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, dim=cfg.hidden_size,
                       n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads)  # fmt: skip
        print(format_table(opt.partition_table()))  # the blocks, from the model's own module names
        return opt
    if name == "muon":
        return Muon(named, lr=lr, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", adamw_lr=lr,
                    adamw_betas=(0.9, 0.95), adamw_weight_decay=0.1)  # fmt: skip
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def warmup_cosine(opt: torch.optim.Optimizer, steps: int, warmup: int | None = None):
    """LambdaLR: linear warm-up over ``warmup`` steps (default a tenth), then cosine to zero."""
    warmup = max(1, steps // 10) if warmup is None else warmup

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def arguments(doc: str) -> argparse.ArgumentParser:
    """The examples' command line: optimizer, model size, steps, batch, sequence length, lr, data,
    device."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    ap.add_argument("--size", choices=sorted(SIZES), default="real")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--length", type=int, default=256, help="tokens (bytes) per sequence")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--data", type=Path, default=None, help="a text file (default: the shared corpus)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return ap
