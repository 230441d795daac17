"""The Optuna tuner on CPU: real AdamW tasks under the interpreter, an injected timer."""

from __future__ import annotations

import dataclasses
import json
import math

import optuna
import pytest
import torch

from kernel_factory.generator import ADAMW, interpreter_enabled
from kernel_factory.generator.cache import merge_entries
from kernel_factory.generator.tuner import (
    PHASES,
    PRECOMPILE_BATCH,
    _warm_config,
    classify,
    phase_report,
    report,
    studied_less,
    tune,
)
from kernel_factory.optimizers.adamw.tune import AdamWTuningTask

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tier)")
SHAPES = [(300,), (7,)]


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "triton")


def fake_ms(config) -> float:
    """Fastest at BLOCK=256, CHUNK=1024, 1 warp, 1 stage; the default is slower."""
    return (1.0 + abs(math.log2(config["BLOCK"] / 256)) + abs(math.log2(config["CHUNK"] / 1024))
            + 0.1 * config["num_warps"] + 0.01 * config["num_stages"])  # fmt: skip


class Recorder:
    """Wraps a task: counts configure calls per config; optional sabotage by config."""

    def __init__(self, task, fail=None, corrupt=None):
        self.task, self.fail, self.corrupt = task, fail, corrupt
        self.configured: list[dict] = []
        self.config: dict = {}

    def __getattr__(self, name):
        return getattr(self.task, name)

    def configure(self, config):
        self.configured.append(dict(config))
        self.config = dict(config)
        if self.fail and self.fail(config):
            raise RuntimeError("CompilationError: planted failure")
        self.task.configure(config)

    def check(self):
        error = self.task.check()
        return 1.0 if self.corrupt and self.corrupt(self.config) else error

    def run(self):
        self.task.run()

    def restore(self):
        self.task.restore()


def timer(task):
    t = fake_ms(task.config)
    return t * 0.95, t, t * 1.05


def _tune(task, tmp_path, trials, **kw):
    """Tune one task; without the final paired timing unless asked (it configures again)."""
    return tune([task], "cpu", kw.pop("timer", timer), local_arch="cpu", trials=trials,
                minutes=kw.pop("minutes", 5), output=tmp_path / "cpu.json", study_path=tmp_path / "studies.db",
                show_progress=False, final_rounds=kw.pop("final_rounds", 0), **kw)  # fmt: skip


def test_tuner_beats_the_default_and_writes_a_cache_entry(tmp_path):
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    (result,) = _tune(task, tmp_path, trials=25)
    assert task.configured[0] == dict(ADAMW.default_config)  # the default is enqueued first
    assert all(ADAMW.is_legal(c) for c in task.configured)  # illegal configs never compile
    assert len({tuple(sorted(c.items())) for c in task.configured}) == len(task.configured)  # no reruns
    assert result.best_times[1] <= result.default_p50 == fake_ms(ADAMW.default_config)
    entry = json.loads((tmp_path / "cpu.json").read_text())["entries"][0]
    assert entry["config"] == result.best and entry["default_p50_ms"] == result.default_p50
    assert entry["variant"] == "multi_tensor=False,state_dtype=float32,amsgrad=False" and entry["dtype"] == "float32"
    study = optuna.load_study(study_name=f"cpu/adamw/{entry['variant']}/float32/512",
                              storage=f"sqlite:///{tmp_path / 'studies.db'}")  # fmt: skip
    assert all(math.isfinite(t.value) for t in study.trials if t.value is not None)


def test_configs_a_task_does_not_allow_are_pruned_not_run(tmp_path):
    # The winner (BLOCK 256) is not allowed: no config with it is compiled, and another wins.
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    task.allows = lambda config: config["BLOCK"] != 256
    (result,) = _tune(task, tmp_path, trials=25)
    assert task.configured and all(c["BLOCK"] != 256 for c in task.configured)
    assert result.best["BLOCK"] != 256


def test_failures_are_typed_and_never_retried(tmp_path):
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"), fail=lambda c: c["num_warps"] == 1)
    (result,) = _tune(task, tmp_path, trials=30)
    failed = [c for c in task.configured if c["num_warps"] == 1]
    assert failed and result.failures["compile"] == len(failed)
    assert len({tuple(sorted(c.items())) for c in failed}) == len(failed)
    assert result.best["num_warps"] != 1


def test_parity_gate_rejects_a_wrong_config_even_when_fastest(tmp_path):
    wrong = lambda c: c["BLOCK"] == 256  # noqa: E731  (the fake timer's favourite block)
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"), corrupt=wrong)
    (result,) = _tune(task, tmp_path, trials=30)
    assert result.failures["wrong_result"] >= 1
    assert result.best["BLOCK"] != 256


def test_real_check_catches_a_real_error():
    task = AdamWTuningTask(SHAPES, torch.float32, "cpu")
    task.configure(dict(ADAMW.default_config))
    assert task.check() <= task.tol
    task.hyper.beta1 = 0.5  # the kernel now computes another update than the reference...
    real_run = task.run
    task.run = lambda: (setattr(task.hyper, "beta1", 0.5), real_run())  # ...for the kernel only
    task.hyper.beta1 = 0.9
    assert task.check() > task.tol


def test_resume_continues_the_study_without_rerunning(tmp_path):
    first = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    (r1,) = _tune(first, tmp_path, trials=5)
    assert r1.trials == 5
    second = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    (r2,) = _tune(second, tmp_path, trials=10)
    assert r2.trials == 10
    done = {tuple(sorted(c.items())) for c in first.configured}
    assert not done & {tuple(sorted(c.items())) for c in second.configured}
    assert dict(ADAMW.default_config) not in second.configured  # not enqueued again


def _tuned_after_an_old_entry(tmp_path, config: dict) -> Recorder:
    """A study of one AdamW key whose output file holds ``config``, tuned on another template."""
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    entry = {"family": "adamw", "variant": task.variant, "dtype": task.dtype, "bucket": 512, "config": config}
    (tmp_path / "cpu.json").write_text(json.dumps({"schema": 1, "template_hashes": {"adamw": "old"},
                                                   "entries": [entry]}))  # fmt: skip
    _tune(task, tmp_path, trials=3)
    return task


def test_previous_cache_config_is_tried_second_whatever_its_template_version(tmp_path):
    prior = {"BLOCK": 1024, "CHUNK": 2048, "num_warps": 2, "num_stages": 2}
    task = _tuned_after_an_old_entry(tmp_path, prior)
    assert task.configured[:2] == [dict(ADAMW.default_config), prior]


def test_a_previous_config_of_other_tunables_is_tried_second_on_the_tunables_now(tmp_path):
    """A tunable added since (num_stages here) takes its default, one dropped since is left out; a
    value that is no longer a choice, or a config the family no longer allows, makes no starting
    point."""
    prior = {"BLOCK": 1024, "CHUNK": 2048, "num_warps": 2, "BAND": 64}
    task = _tuned_after_an_old_entry(tmp_path, prior)
    warm = {"BLOCK": 1024, "CHUNK": 2048, "num_warps": 2, "num_stages": ADAMW.default_config["num_stages"]}
    assert task.configured[:2] == [dict(ADAMW.default_config), warm]
    assert _warm_config(ADAMW, {**prior, "BLOCK": 3}) is None  # not a BLOCK the family offers
    assert _warm_config(ADAMW, {**prior, "BLOCK": 4096, "num_warps": 1}) is None  # illegal: 128 elements a thread


def test_family_seed_configs_are_tried_right_after_the_default(tmp_path):
    seed = {"BLOCK": 2048, "CHUNK": 65536, "num_warps": 16, "num_stages": 3}  # far from the fake timer's optimum
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    task.family = dataclasses.replace(ADAMW, seed_configs=(seed,))
    _tune(task, tmp_path, trials=3)
    assert task.configured[:2] == [dict(ADAMW.default_config), seed]
    with pytest.raises(ValueError, match="illegal"):
        dataclasses.replace(ADAMW, seed_configs=({**seed, "BLOCK": 256, "CHUNK": 128},))


def _timer_with_bias(bias):
    """The fake timer, plus ``bias(config, nth)`` ms on the nth (0-based) timing of a config."""
    counts: dict = {}

    def biased(task):
        key = tuple(sorted(task.config.items()))
        t = fake_ms(task.config) + bias(task.config, counts.get(key, 0))
        counts[key] = counts.get(key, 0) + 1
        return t * 0.95, t, t * 1.05

    return biased


def test_paired_timing_corrects_a_slow_first_timing_of_the_default(tmp_path):
    is_default = lambda c: c == dict(ADAMW.default_config)  # noqa: E731
    slow_start = _timer_with_bias(lambda c, n: 5.0 if is_default(c) and n == 0 else 0.0)
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    (result,) = _tune(task, tmp_path, trials=10, timer=slow_start, final_rounds=3)
    assert result.default_p50 == fake_ms(ADAMW.default_config)  # not the warm-up timing
    assert result.best_times[1] == fake_ms(result.best) < result.default_p50


def test_a_winner_that_was_only_lucky_loses_to_the_default(tmp_path):
    # Every config but the default looks 100 ms faster the first time it is timed, slower after.
    lucky = _timer_with_bias(lambda c, n: 0.0 if c == dict(ADAMW.default_config) else (-100.0 if n == 0 else 100.0))
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    (result,) = _tune(task, tmp_path, trials=5, timer=lucky, final_rounds=3)
    assert result.best == dict(ADAMW.default_config)
    assert result.best_times[1] == result.default_p50 == fake_ms(ADAMW.default_config)
    entry = json.loads((tmp_path / "cpu.json").read_text())["entries"][0]
    assert entry["config"] == dict(ADAMW.default_config)


class Precompiling(Recorder):
    """A task that can compile configs ahead: records each batch it is given."""

    def __init__(self, task):
        super().__init__(task)
        self.batches: list[list[dict]] = []

    def precompile(self, configs):
        assert all(c not in self.configured for c in configs), "a config compiled again"
        self.batches.append([dict(c) for c in configs])


def test_a_precompiling_task_gets_each_batch_of_configs_before_they_run(tmp_path):
    task = Precompiling(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    task.allows = lambda config: config["num_warps"] != 2
    (result,) = _tune(task, tmp_path, trials=20)
    assert task.batches and all(1 <= len(b) <= PRECOMPILE_BATCH for b in task.batches)
    assert task.batches[0][0] == dict(ADAMW.default_config)  # the enqueued trials come first
    queued = [c for b in task.batches for c in b]
    assert all(ADAMW.is_legal(c) and c["num_warps"] != 2 for c in queued)  # only configs that would compile
    # every config run was handed to precompile first, in an earlier or the same batch
    assert task.configured and all(c in queued for c in task.configured)
    assert len({tuple(sorted(c.items())) for c in task.configured}) == len(task.configured)  # no reruns
    assert result.trials == 20 and result.best_times[1] <= result.default_p50
    study = optuna.load_study(study_name=f"cpu/adamw/{task.variant}/float32/512",
                              storage=f"sqlite:///{tmp_path / 'studies.db'}")  # fmt: skip
    assert all(t.state.is_finished() for t in study.trials)  # no asked trial left running


class FakeClock:
    """The tuner's ``time``: ``monotonic()`` moves only when a fake task's work says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    from kernel_factory.generator import tuner

    fake = FakeClock()
    monkeypatch.setattr(tuner, "time", fake)
    return fake


class TimedPrecompiling(Precompiling):
    """Precompiling, with a compile of ``compile_s`` a config (as if one after the other) and a
    timed run of ``run_s(n)`` for the n-th run, on the fake clock."""

    def __init__(self, task, clock: FakeClock, compile_s: float, run_s) -> None:
        super().__init__(task)
        self.clock, self.compile_s, self.run_s = clock, compile_s, run_s

    def precompile(self, configs):
        super().precompile(configs)
        self.clock.now += self.compile_s * len(configs)

    def timer(self, task):
        self.clock.now += self.run_s(len(self.configured))
        return timer(task)


def _study(task, tmp_path):
    return optuna.load_study(study_name=f"cpu/adamw/{task.variant}/float32/512",
                             storage=f"sqlite:///{tmp_path / 'studies.db'}")  # fmt: skip


def test_batches_double_from_one_and_hold_no_more_trials_than_the_time_left_runs(tmp_path, clock):
    # 1 s to compile a config, 0.1 s to time one, 9 s for the key: batch i asks at most 2^i trials
    # (some are repeats or illegal, which compile nothing), the last ones fit the time left, and
    # nothing compiled is left unrun.
    task = TimedPrecompiling(AdamWTuningTask(SHAPES, torch.float32, "cpu"), clock, 1.0, lambda n: 0.1)
    (result,) = _tune(task, tmp_path, trials=40, minutes=9 / 60, timer=task.timer)
    sizes = [len(b) for b in task.batches]
    assert sizes[0] == 1 and all(1 <= n <= min(2**i, PRECOMPILE_BATCH) for i, n in enumerate(sizes))
    assert task.batches[0] == [dict(ADAMW.default_config)]
    queued = [c for b in task.batches for c in b]
    assert sorted(map(str, queued)) == sorted(map(str, task.configured))  # every compiled config ran
    assert not [t for t in _study(task, tmp_path).trials if "skipped" in t.user_attrs]
    assert clock.now <= 9.0 + 1e-9 and result.trials >= len(task.configured)


def test_the_budget_stops_a_batch_too_and_leaves_its_rest_for_a_resume(tmp_path, clock):
    # Trials that slow down (0.1 s, then 5 s from the sixth): a batch sized on the last one's pace
    # overruns the 6 s budget, its unrun trials are told as skipped (not counted, not taken as
    # seen), none is left running, and a resumed study runs on.
    task = TimedPrecompiling(AdamWTuningTask(SHAPES, torch.float32, "cpu"), clock, 0.0,
                             lambda n: 0.1 if n < 6 else 5.0)  # fmt: skip
    (result,) = _tune(task, tmp_path, trials=30, minutes=6 / 60, timer=task.timer)
    skipped = [t for t in _study(task, tmp_path).trials if "skipped" in t.user_attrs]
    assert skipped and 1 <= len(task.configured) <= result.trials < 30  # illegal configs count, unconfigured
    assert all(t.state.is_finished() for t in _study(task, tmp_path).trials)
    (again,) = _tune(task, tmp_path, trials=30, minutes=60 / 60, timer=task.timer)
    assert again.trials > result.trials


def test_a_keys_seconds_are_kept_by_phase_and_add_up_to_its_wall_time(tmp_path, clock):
    # On the fake clock only compiles (1 s a config) and timed runs (0.25 s each) take time: the
    # phases hold exactly those, and nothing else of the key's wall time is left unaccounted.
    task = TimedPrecompiling(AdamWTuningTask(SHAPES, torch.float32, "cpu"), clock, 1.0, lambda n: 0.25)
    (result,) = _tune(task, tmp_path, trials=12, timer=task.timer)
    compiled = sum(len(b) for b in task.batches)
    assert compiled > 1 and task.configured
    assert result.phases["compile"] == pytest.approx(1.0 * compiled)
    assert result.phases["time"] == pytest.approx(0.25 * len(task.configured))
    assert all(result.phases[p] == 0.0 for p in ("build", "configure", "check", "final"))
    assert result.wall_s == pytest.approx(clock.now) and clock.now > 0
    table = phase_report([result]).splitlines()
    assert table[0].split()[-len(PHASES) - 1 :] == [*PHASES, "other"]
    row = table[1].split()
    assert float(row[-1]) == pytest.approx(0.0, abs=0.05)  # "other"
    assert float(row[-len(PHASES) - 1 + PHASES.index("compile")]) == pytest.approx(compiled, abs=0.05)


def test_budget_stops_the_study(tmp_path):
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    (result,) = _tune(task, tmp_path, trials=500, minutes=0.02)
    assert 1 <= result.trials < 500


def test_tuning_another_arch_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="cannot tune sm90 here"):
        tune([], "sm90", timer, local_arch="cpu", output=tmp_path / "x.json", study_path=tmp_path / "s.db")


def test_failure_types():
    assert classify(RuntimeError("CompilationError: bad")) == "compile"
    assert classify(Exception("OutOfResources: out of resource: shared memory")) == "out_of_resources"
    assert classify(ValueError("boom")) == "runtime"


def test_an_adamw_task_knows_its_key_before_it_allocates_and_frees_its_workload(tmp_path):
    from kernel_factory.generator.tuner import key_name
    from kernel_factory.optimizers.adamw.tune import shapes_for

    task = AdamWTuningTask(SHAPES, torch.bfloat16, "cpu", state_dtype="fp32")
    key = key_name(task)
    assert task.bucket is None and key == "adamw multi_tensor=False,state_dtype=float32,amsgrad=False bfloat16 512"
    results = _tune(Recorder(task), tmp_path, trials=2)  # builds it (its variant checked), then releases it
    assert results[0].best is not None and task.bucket is None and not task.params
    assert task.check() <= task.tol and key_name(task) == key  # a later use allocates again
    assert task.looked_up_config() == dict(ADAMW.default_config)  # nothing is tuned for the interpreter
    # the model lists are the workloads of their buckets
    assert len(shapes_for(1 << 27)) == 111 and len(shapes_for(1 << 31)) == 16 * 9 + 2
    assert shapes_for(1 << 22) == [(4096, 1024)]


def test_adam_mini_tasks_are_the_models_at_their_buckets_and_allocate_when_first_used():
    from kernel_factory.generator.tuner import key_name
    from kernel_factory.optimizers.adam_mini.tune import adam_mini_tasks
    from kernel_factory.optimizers.shared.workloads import model_at_bucket

    assert [model_at_bucket(1 << b) for b in (27, 29, 30, 31)] == [
        "llama134m", "qwen2_5_0_5b", "llama2_7b_4layers", "llama3_2_1b"]  # fmt: skip
    assert model_at_bucket(1 << 28) is None
    tasks = adam_mini_tasks(["fp32", "bf16"], "cpu", None)
    names = [key_name(t) for t in tasks]
    assert len(names) == 4 * 3 and len(set(names)) == len(names)  # fp32: FP8 and fp32 momentum; bf16: FP8
    assert "adam_mini multi_tensor=False,momentum=float8e4nv bfloat16 2147483648" in names
    assert all(t.opt is None and t.floor_ms is None for t in tasks)  # nothing allocated yet


def test_the_tuner_has_a_task_for_every_key_the_models_look_up():
    """For each model of the bench (fp32 and bf16 params), every family's lookup (as in
    test_cache's every-model check) is a key some tuner task tunes; building the tasks allocates
    nothing (a model is allocated when its task is first used)."""
    from model_lookups import elementwise_lookups

    from kernel_factory.generator import size_bucket
    from kernel_factory.generator.tuner import key_name
    from kernel_factory.optimizers.tune import FAMILY_TASKS

    tasks = [t for family in ("adamw", "adam_mini", "muon", "turbo_adam", "adafactor")
             for t in FAMILY_TASKS[family](["fp32", "bf16"], "cpu", None)]  # fmt: skip
    assert all(t.opt is None for t in tasks)
    # CPU tasks name the single-tensor variant where the family has one for the interpreter
    tuned = {key_name(t).replace("multi_tensor=False", "multi_tensor=True") for t in tasks}
    for model, family, variant, dtype, n in elementwise_lookups():
        key = f"{family.name} {family.tuning_key(variant)} {dtype} {size_bucket(n)}"
        assert key in tuned, (model, key)


def test_a_new_bucket_starts_from_the_nearest_buckets_entry(tmp_path):
    """A key without an entry tries, after the default, the config of the nearest bucket of the same
    family, variant and dtype in the output file (the one its lookup gives until it is tuned)."""
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    near, far = ({"BLOCK": b, "CHUNK": 2048, "num_warps": 2, "num_stages": 2} for b in (1024, 256))
    entries = [{"family": "adamw", "variant": task.variant, "dtype": task.dtype, "bucket": bucket, "config": c}
               for bucket, c in ((2048, near), (1 << 20, far))]  # fmt: skip
    other = {"family": "adamw", "variant": task.variant, "dtype": "bfloat16", "bucket": 512,
             "config": dict(far, num_warps=4)}  # fmt: skip
    (tmp_path / "cpu.json").write_text(json.dumps({"schema": 1, "template_hashes": {}, "entries": [*entries, other]}))
    _tune(task, tmp_path, trials=3)
    assert task.configured[:2] == [dict(ADAMW.default_config), near]


def test_a_study_that_never_ran_its_starting_point_writes_no_entry(tmp_path):
    """Cut after the default alone, a new bucket's study could only write the default, maybe slower
    than the nearest bucket's config its lookup gives now: nothing is written (the report says so);
    once the starting point ran, the winner is."""
    task = Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu"))
    near = {"BLOCK": 1024, "CHUNK": 2048, "num_warps": 2, "num_stages": 2}
    entry = {"family": "adamw", "variant": task.variant, "dtype": task.dtype, "bucket": 2048, "config": near}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"schema": 1, "template_hashes": {}, "entries": [entry]}))
    (cut,) = _tune(task, tmp_path, trials=1)
    assert cut.best == dict(ADAMW.default_config) and cut.start_not_reached
    assert [e["bucket"] for e in json.loads(path.read_text())["entries"]] == [2048]
    assert "not written" in report([cut])
    (done,) = _tune(Recorder(AdamWTuningTask(SHAPES, torch.float32, "cpu")), tmp_path, trials=2)  # resumes: one more
    assert not done.start_not_reached and done.trials == 2
    assert 512 in [e["bucket"] for e in json.loads(path.read_text())["entries"]]


def test_a_workload_whose_build_fails_is_left_unbuilt(monkeypatch):
    from kernel_factory.optimizers.turbo_adam.tune import TurboAdamTuningTask

    monkeypatch.setenv("KERNEL_FACTORY_BACKEND", "torch")  # the reference step: no fused launch to tune
    task = TurboAdamTuningTask(torch.float32, "default", "cpu", model="single_4096x1024")
    with pytest.raises(RuntimeError, match="fused path"):
        task.ensure()
    assert task.opt is None and not task.params  # the next use builds it again


def test_fewer_trials_than_keeps_the_keys_this_gpu_studied_less_or_not_at_all(tmp_path):
    """``tune --fewer-trials-than N``: a key whose entry for this GPU came from fewer than N trials,
    or that has only another GPU's entry, or none, is tuned; one studied N times or more is not."""
    tasks = {n: AdamWTuningTask([(n,)], torch.float32, "cpu") for n in (300, 5000, 70000, 900000)}
    config = dict(ADAMW.default_config)

    def entry(task, trials, device):
        return {"family": "adamw", "variant": task.variant, "dtype": task.dtype, "bucket": task.numel,
                "config": config, "trials": trials, "device": device}  # fmt: skip

    path = tmp_path / "cpu.json"
    merge_entries(path, "cpu", [entry(tasks[300], 2, "GPU A"), entry(tasks[5000], 12, "GPU A"),
                                entry(tasks[70000], 30, "GPU B")])  # fmt: skip
    other = tmp_path / "other.json"  # a second file (the packaged cache) can hold the longer study
    merge_entries(other, "cpu", [entry(tasks[300], 8, "GPU A")])
    keep = studied_less(list(tasks.values()), [path], "cpu", "GPU A", 6)
    assert keep == [tasks[300], tasks[70000], tasks[900000]]
    assert studied_less(list(tasks.values()), [other, path], "cpu", "GPU A", 6) == [tasks[70000], tasks[900000]]
