"""A Hugging Face ``Trainer`` run resumed from its checkpoint ends where the uninterrupted run ends,
with each of our optimizers (CPU tier): the Trainer saves ``optimizer.state_dict()`` with
``torch.save`` and loads it into a new optimizer over a new model, so the optimizer's state dict,
its loader and its LR scheduler's state must round-trip through its files."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_factory.optimizers import Adafactor, AdamMini, AdamW, Muon, TurboAdam  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
BUILD = {
    "AdamW": lambda model: AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
    "AdamMini": lambda model: AdamMini(model.named_parameters(), lr=1e-3, dim=32, n_heads=4, n_kv_heads=2),
    "Muon": lambda model: Muon(model.named_parameters(), lr=0.02),
    "TurboAdam": lambda model: TurboAdam(model.parameters(), lr=1e-3, min_m_compress_elements=0,
                                         min_v_compress_elements=0, block_size=32),  # fmt: skip
    "Adafactor": lambda model: Adafactor(model.parameters(), lr=1e-3),
}


class Tokens(torch.utils.data.Dataset):
    """32 fixed random sequences of 16 token ids, each its own label."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, CONFIG["vocab_size"], (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _run(name: str, out: str, resume: str | None = None):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    args = transformers.TrainingArguments(out, max_steps=4, per_device_train_batch_size=4, save_steps=2,
                                          report_to=[], use_cpu=True, disable_tqdm=True, seed=0)  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   optimizers=(BUILD[name](model), None))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    return model


@pytest.mark.parametrize("name", sorted(BUILD))
def test_a_trainer_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(name, tmp_path):
    whole = _run(name, str(tmp_path / "whole"))
    resumed = _run(name, str(tmp_path / "resumed"), resume=str(tmp_path / "whole" / "checkpoint-2"))
    torch.manual_seed(0)
    start = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    assert any(not torch.equal(a, b) for a, b in zip(whole.parameters(), start.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters(), strict=True))
