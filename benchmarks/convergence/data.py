"""Character-level corpus: read, validate, encode, split 90/10, and batch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

TRAIN_FRACTION = 0.9
DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "tinyshakespeare.txt"


@dataclass(frozen=True)
class CharCorpus:
    """A text as int64 token ids over its sorted character vocabulary, split in a fixed way:
    the first 90% of characters train, the last 10% validate."""

    vocab: str
    train: Tensor  # int64 [n_train]
    val: Tensor  # int64 [n_val]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @classmethod
    def from_text(cls, text: str, block_size: int, source: str = "text") -> CharCorpus:
        """Encode ``text``; both splits must hold at least one window of ``block_size`` + 1."""
        if not text:
            raise ValueError(f"{source} is empty: the corpus needs text to train on")
        vocab = "".join(sorted(set(text)))
        index = {ch: i for i, ch in enumerate(vocab)}
        ids = torch.tensor([index[ch] for ch in text], dtype=torch.int64)
        n_train = int(len(ids) * TRAIN_FRACTION)
        train, val = ids[:n_train], ids[n_train:]
        need = block_size + 1
        if len(val) < need:
            raise ValueError(
                f"{source} is too short: {len(text)} characters give a validation split of "
                f"{len(val)}, but a window of block_size + 1 = {need} is needed "
                f"(at least {int(need / (1 - TRAIN_FRACTION)) + 1} characters, or a smaller --block-size)"
            )
        return cls(vocab, train, val)

    @classmethod
    def from_file(cls, path: str | Path, block_size: int) -> CharCorpus:
        """Read a UTF-8 text file; a missing, empty, too short or non-UTF-8 file raises a
        ValueError (FileNotFoundError when missing) that names the file and the problem."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"corpus {path} not found: pass --data PATH to any UTF-8 text file")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not UTF-8 text (invalid byte at offset {exc.start})") from None
        return cls.from_text(text, block_size, source=str(path))

    def decode(self, ids: Tensor) -> str:
        return "".join(self.vocab[i] for i in ids.tolist())


def get_batch(data: Tensor, batch_size: int, block_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch_size`` random windows of ``data``: inputs x [B, T] and next-character targets
    y [B, T] (int64, on ``data``'s device), drawn with ``generator`` so runs repeat."""
    if len(data) < block_size + 1:
        raise ValueError(f"split of {len(data)} tokens is shorter than block_size + 1 = {block_size + 1}")
    starts = torch.randint(0, len(data) - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    windows = data[(starts[:, None] + offsets).to(data.device)]
    return windows[:, :-1], windows[:, 1:]
