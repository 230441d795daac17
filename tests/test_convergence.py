"""The convergence harness: data pipeline, optimizer registry, and a short training run."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks import registry
from benchmarks.convergence.data import CharCorpus, get_batch
from benchmarks.convergence.model import ModelConfig, TinyLlama
from benchmarks.convergence.train import RunConfig, loss_agreement, train_one

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(60))


def test_split_is_a_fixed_90_10_cut_and_encoding_round_trips():
    corpus = CharCorpus.from_text(TEXT, block_size=8)
    assert len(corpus.train) == int(len(TEXT) * 0.9) and len(corpus.train) + len(corpus.val) == len(TEXT)
    assert corpus.decode(torch.cat([corpus.train, corpus.val])) == TEXT
    assert corpus.vocab == "".join(sorted(set(TEXT)))


def test_batches_are_shifted_windows_and_repeat_with_the_seed():
    corpus = CharCorpus.from_text(TEXT, block_size=8)
    x, y = get_batch(corpus.train, 4, 8, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = get_batch(corpus.train, 4, 8, torch.Generator().manual_seed(3))
    assert torch.equal(x, x2)


@pytest.mark.parametrize(
    "content,error,message",
    [
        (b"", ValueError, "is empty"),
        (b"tiny text", ValueError, "too short"),
        ("caf\u00e9 ".encode("latin-1") * 100, ValueError, "not UTF-8"),
    ],
)
def test_bad_corpus_files_give_clear_errors(tmp_path, content, error, message):
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    with pytest.raises(error, match=message):
        CharCorpus.from_file(path, block_size=32)


def test_missing_corpus_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data"):
        CharCorpus.from_file(tmp_path / "nope.txt", block_size=8)


def test_model_has_llama_names_and_grouped_query_attention():
    c = ModelConfig(vocab_size=20, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
    model = TinyLlama(c)
    names = dict(model.named_parameters())
    for n in ("embed_tokens.weight", "layers.1.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight",
              "layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight"):  # fmt: skip
        assert n in names, n
    assert names["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)  # n_kv_heads * head_dim
    assert model(torch.randint(0, 20, (3, 16))).shape == (3, 16, 20)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig(20, 32, 1, 4, 3, 48, 16)


def test_registry_rejects_unknown_names_with_the_known_list():
    with pytest.raises(ValueError, match="known: kernel_factory_adamw"):
        registry.select(["kernel_factory_adamw", "sgd_deluxe"], "cpu")


def test_absent_and_cuda_only_peers_are_skipped_with_a_note(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "adam_mini" else real(name, *a))
    specs, notes = registry.select(["kernel_factory_adamw", "adam_mini", "bnb_adamw8bit"], "cpu")
    assert [s.name for s in specs] == ["kernel_factory_adamw"]
    assert any("adam_mini" in n and "not installed" in n for n in notes)
    assert any(n.startswith("bnb_adamw8bit: skipped") for n in notes)


def test_state_bytes_counts_adamw_moments():
    p = torch.nn.Parameter(torch.randn(1000))
    opt = registry.REGISTRY["kernel_factory_adamw"].build([("p", p)], registry.Shape(8, 1, 1), 1e-3, 0.0)
    p.grad = torch.randn(1000)
    opt.step()
    assert registry.state_bytes(opt) == 1000 * 8 + 4  # exp_avg, exp_avg_sq fp32 and the step


def test_state_bytes_counts_nested_records():
    """A peer that keeps each moment as a record of codes and scales (turboadam) or in a wrapper
    object (flashoptim) is counted whole."""

    class Wrapped:
        def __init__(self):
            self._quantized, self._scales, self._signed = torch.zeros(64, dtype=torch.int8), torch.ones(1), True

    p = torch.nn.Parameter(torch.randn(256))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p] = {"step": 3, "v": {"indices": torch.zeros(128, dtype=torch.uint8), "scales": torch.ones(2),
                                     "n_bits": 4}, "parts": [torch.zeros(4, dtype=torch.bfloat16)],
                    "m": Wrapped()}  # fmt: skip
    assert registry.state_bytes(opt) == 128 + 2 * 4 + 4 * 2 + 64 + 4


def test_ours_and_torch_fused_train_to_the_same_losses():
    corpus = CharCorpus.from_text(TEXT * 3, block_size=16)
    rc = RunConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, block_size=16, batch_size=4,
                   steps=30, lr=3e-3, eval_every=10, eval_batches=2)  # fmt: skip
    specs, _ = registry.select(["kernel_factory_adamw", "torch_adamw_fused"], "cpu")
    results = [train_one(s, corpus, rc, "cpu", progress=False) for s in specs]
    assert loss_agreement(results, "kernel_factory_adamw", "torch_adamw_fused") <= 1e-5
    assert results[0]["rows"][-1]["train_loss"] < results[0]["rows"][0]["train_loss"]
    assert results[0]["state_bytes_per_param"] == pytest.approx(8, abs=0.01)


def test_lr_and_seed_options_keep_their_runs_apart(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.convergence.train import main

    data = tmp_path / "text.txt"
    data.write_text(TEXT * 3)
    args = ["--size", "cpu", "--steps", "2", "--optimizers", "torch_adamw_fused", "--data", str(data),
            "--out", str(tmp_path), "--no-progress"]  # fmt: skip
    assert main(args + ["--lr", "1e-3"]) == 0
    assert main(args) == 0  # the size's own lr: the plain tag
    assert main(args + ["--seed", "1"]) == 0
    swept = json.loads((tmp_path / "convergence_cpu_lr0.001" / "torch_adamw_fused.json").read_text())
    plain = json.loads((tmp_path / "convergence_cpu" / "torch_adamw_fused.json").read_text())
    seeded = json.loads((tmp_path / "convergence_cpu_seed1" / "torch_adamw_fused.json").read_text())
    assert swept["run_config"]["lr"] == 1e-3 and plain["run_config"]["lr"] == 3e-3
    assert plain["run_config"]["seed"] == 0 and seeded["run_config"]["seed"] == 1
    assert seeded["rows"][0]["train_loss"] != plain["rows"][0]["train_loss"]  # another init and batches
    assert "--lr 1e-3" in swept["command"] and (tmp_path / "convergence_cpu_lr0.001.md").exists()
    with pytest.raises(SystemExit):
        main(args + ["--lr", "0"])
