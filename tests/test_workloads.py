"""The shape sets of models users train match their published parameter counts, and the bench
selects them by name."""

from __future__ import annotations

import math

import pytest

from benchmarks import bench
from kernel_factory.optimizers.shared.workloads import MODELS, SHAPE_SETS, llama_param_shapes

# Parameter counts of the public checkpoints (the hub's safetensors metadata).
PUBLISHED = {"qwen2_5_0_5b": 494_032_768, "llama3_2_1b": 1_235_814_400}


def _count(shapes) -> int:
    return sum(math.prod(s) for _, s in shapes)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_shapes_have_the_published_parameter_counts(name):
    assert _count(SHAPE_SETS[name]) == PUBLISHED[name]


def test_llama2_7b_slice_is_four_layers_of_the_published_model():
    whole = llama_param_shapes(**{**MODELS["llama2_7b_4layers"], "layers": 32})
    assert _count(whole) == 6_738_415_616
    names = {n for n, _ in SHAPE_SETS["llama2_7b_4layers"]}
    assert "layers.3.mlp.down_proj.weight" in names and "layers.4.mlp.down_proj.weight" not in names
    assert dict(SHAPE_SETS["llama2_7b_4layers"])["layers.0.mlp.down_proj.weight"] == (4096, 11008)


def test_tied_models_have_no_lm_head_and_qwen_has_qkv_biases():
    qwen = dict(SHAPE_SETS["qwen2_5_0_5b"])
    assert "lm_head.weight" not in qwen and "lm_head.weight" not in dict(SHAPE_SETS["llama3_2_1b"])
    assert qwen["layers.0.self_attn.k_proj.weight"] == (128, 896) and qwen["layers.0.self_attn.k_proj.bias"] == (128,)
    assert _count(SHAPE_SETS["llama134m"]) == 134_105_856 and len(SHAPE_SETS["llama134m"]) == 111


def test_bench_takes_every_model_by_name_and_rejects_others(capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)  # checks the arguments, times nothing
    assert set(MODELS) <= set(bench.SHAPES_OF)
    assert bench.main(["--shapes", ",".join(MODELS), "--ns-sizes", ""]) == 0
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "gpt5"])
    assert "unknown shape set" in capsys.readouterr().err


def test_ns_sizes_take_squares_rectangles_and_a_models_large_hidden_matrices(capsys, monkeypatch):
    from benchmarks.bench_newton_schulz import ns_floor_flops, parse_ns_sizes

    assert parse_ns_sizes("4096,3072x8192,@llama2_7b_4layers,4096") == [(4096, 4096), (3072, 8192), (11008, 4096),
                                                                         (4096, 11008)]  # fmt: skip
    assert parse_ns_sizes("@llama3_2_1b") == [(2048, 2048), (8192, 2048), (2048, 8192)]  # K/V are 512 x 2048
    assert parse_ns_sizes("@llama134m") == [] and parse_ns_sizes("") == []
    assert ns_floor_flops(4096, 4096) == 20 * 4096**3 and ns_floor_flops(8192, 2048) == ns_floor_flops(2048, 8192)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    for bad in ("@gpt5", "12x", "0", "3x4x5"):
        with pytest.raises(SystemExit):
            bench.main(["--optimizers", "kernel_factory_adamw", "--ns-sizes", bad])
        assert "--ns-sizes" in capsys.readouterr().err


def test_the_bench_table_has_a_first_step_column_where_it_was_measured(monkeypatch, tmp_path):
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "GPU")
    row = dict(shapes="llama134m", dtype="fp32", optimizer="kernel_factory_adamw", numel=10, state_bytes_per_param=8.0,
               bytes_per_param=28.0, eager_ms=1.0, graph_ms=None, ms=1.0, floor_ms=0.9, pct_of_floor=90.0,
               ours_faster=1.0)  # fmt: skip
    bench.write(3.0, [dict(row, first_step_cold_s=2.345), dict(row, dtype="bf16")], [], tmp_path, "cmd")
    table = (tmp_path / "bench.md").read_text().splitlines()
    assert table[2].endswith("| first step, empty caches (s) |")
    assert table[4].endswith("| 2.35 |") and table[5].endswith("| n/a |")
    assert (tmp_path / "bench.csv").read_text().splitlines()[1].endswith(",2.345")


def test_the_cold_start_table_has_a_column_for_each_run(monkeypatch, tmp_path, capsys):
    from benchmarks import cold_start

    keys = ("build_cold_s", "first_step_cold_s", "first_step_cold_later_s", "build_warm_s", "first_step_warm_s",
            "first_step_warm_later_s", "steady_step_s")  # fmt: skip
    compiles = [["short {}", 0.0, 0.1], ["long {'B': 1}", -0.5, 1.25]]  # (variant, start, end)
    monkeypatch.setattr(cold_start, "measure", lambda name, shapes, dtype, gap: dict(
        optimizer=name, compiles_cold=compiles, **{k: i + 0.5 for i, k in enumerate(keys)}))  # fmt: skip
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "GPU")
    assert cold_start.main(["--optimizers", "kernel_factory_adamw", "--gap", "2", "--out", str(tmp_path / "c")]) == 0
    table = (tmp_path / "c" / "cold_start.md").read_text().splitlines()
    assert "first step 2 s after build, warm caches" in table[2] and table[2].count("|") == 9
    assert table[4] == "| kernel_factory_adamw | 0.500 | 1.500 | 2.500 | 3.500 | 4.500 | 5.500 | 6.5000 |"
    assert table[4] in capsys.readouterr().out
    longest = (tmp_path / "c" / "first_step_compiles.md").read_text().splitlines()[4:]
    assert longest == ["| kernel_factory_adamw | `long {'B': 1}` | -0.50 | 1.25 | 1.75 | 1.50 |",
                       "| kernel_factory_adamw | `short {}` | 0.00 | 0.10 | 0.10 | 1.50 |"]

    def second_fails(name, shapes, dtype, gap):  # a run cut short keeps the rows measured before
        if name != "kernel_factory_adamw":
            raise RuntimeError("child failed")
        return dict(optimizer=name, compiles_cold=[], **{k: i + 0.5 for i, k in enumerate(keys)})

    monkeypatch.setattr(cold_start, "measure", second_fails)
    with pytest.raises(RuntimeError):
        cold_start.main(["--optimizers", "kernel_factory_adamw,kernel_factory_muon", "--out", str(tmp_path / "d")])
    table = (tmp_path / "d" / "cold_start.md").read_text().splitlines()
    assert "(cut short after 1 of them)" in table[0] and table[4].startswith("| kernel_factory_adamw |")
    assert len(table) == 5


def test_a_muon_steps_floor_is_ns_over_the_hidden_matrices():
    # 48 attention matrices 768^2 and 36 MLP ones 768 x 2048: five iterations of X Xᵀ (s² L),
    # A A (s³) and B X (2 s² L) each, at 1 TFLOP/s
    flops = 48 * 5 * 4 * 768**3 + 36 * 5 * (3 * 768**2 * 2048 + 768**3)
    assert bench.ns_floor_ms("llama134m", 1.0) == pytest.approx(flops / 1e12 * 1e3, rel=1e-12)
    from benchmarks.registry import REGISTRY

    assert {n for n, s in REGISTRY.items() if s.ns_floor} == {"torch_muon", "kernel_factory_muon"}


def test_a_muon_row_s_note_gives_the_share_of_its_ns_floor_its_bytes_leave():
    # 100 x floor / (floor + bytes / copy rate): 1 ms of NS and 1e9 B at 4 TB/s (0.25 ms) -> 80%
    row = dict(shapes="llama134m", dtype="bf16", optimizer="kernel_factory_muon", numel=10**8, bytes_per_param=10.0,
               floor_ms=1.0, pct_of_floor=60.0)  # fmt: skip
    adamw = dict(row, optimizer="kernel_factory_adamw")
    (note,) = bench.ns_ceiling_notes([row, adamw], {"kernel_factory_muon"}, 4.0)
    assert "0.250 ms" in note and "at most 80.0% of the NS floor" in note and "(60.0% measured)" in note
