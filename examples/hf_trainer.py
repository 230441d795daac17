"""Train a Llama model with one of our optimizers through Hugging Face's ``Trainer``, passed as
``optimizers=(optimizer, scheduler)``.

    python examples/hf_trainer.py --optimizer adam_mini       # 85M parameters on the GPU
    python examples/hf_trainer.py --optimizer muon --size tiny --device cpu --steps 20

Returns the training losses the Trainer logged.
"""

from __future__ import annotations

import tempfile

import torch
from llama_setup import arguments, build_optimizer, llama, text_tokens, warmup_cosine
from transformers import Trainer, TrainingArguments


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive windows of ``length`` tokens, each its own labels (the model shifts them)."""

    def __init__(self, tokens: torch.Tensor, length: int) -> None:
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.tokens[i * self.length : (i + 1) * self.length]
        return {"input_ids": x, "labels": x}


def main(argv=None) -> list[float]:
    args = arguments(__doc__).parse_args(argv)

    torch.manual_seed(0)
    model = llama(args.size).to(args.device)  # before the optimizer, which keeps the params' state there
    opt = build_optimizer(args.optimizer, model, args.lr)
    sched = warmup_cosine(opt, args.steps)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            logging_steps=max(1, args.steps // 10), save_strategy="no", report_to="none", seed=0,
            use_cpu=args.device == "cpu", bf16=args.device != "cpu", dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=model, args=training, train_dataset=ByteWindows(text_tokens(args.data), args.length),
                          optimizers=(opt, sched))  # fmt: skip
        trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    print(opt.telemetry.table())
    return losses


if __name__ == "__main__":
    main()
