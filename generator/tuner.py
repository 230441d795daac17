"""Optuna tuning of a family's launch configs, one study per cache key.

A *task* is one (family, structural variant, dtype, size bucket) with a workload on the
device; it knows how to launch with a config and how to check the result (``TuningTask``).
For each task the tuner runs an Optuna study (TPE sampler, fixed seed, the family default
enqueued first, then the key's config from the existing cache file, whatever template
version it was tuned on, then the family's seed configs) over the family's tunables:

- an illegal config (the family's predicate) is pruned before anything compiles;
- every legal config is compiled, checked against the family's reference on fresh random
  inputs (a wrong result fails the trial: it can never win), then timed (p20/p50/p80);
- failures are typed (compile, out_of_resources, wrong_result, runtime), recorded on the
  trial and never retried: a config seen before is answered from the study, not rerun;
- objectives are always finite (failed trials are FAIL, not NaN);
- a task that can compile configs without switching to them (``precompile(configs)``) gets
  trials asked in batches (1, 2, 4, ... up to PRECOMPILE_BATCH, none larger than the time left
  runs; TPE's constant liar keeps them apart) and their kernels compiled in parallel on
  background threads before the first of them is checked and timed (nothing compiles while one
  is timed): a trial's compile, seconds for AdamMini's and TurboAdam's kernels on one thread, was
  most of its time;
- where a key's time goes is kept per phase (``KeyResult.phases``: building the workload,
  compiling, configuring, checking, timing; ``phase_report``), so a slow study says what to cut;
- at the end the winner and the default are timed again, alternately, and the cache records
  those paired times: a config timed while the GPU was still warming up (the default, timed
  first) or one timed on a lucky run cannot win or lose by it. If the default is as fast in
  the paired timing, the default is the winner.

Studies persist in sqlite (outside git), so an interrupted tune resumes where it stopped.
Results go to the cache file in DESIGN.md's format through ``cache.merge_entries``.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .cache import current_device, merge_entries, prior_configs, size_bucket, trials_on_device
from .family import KernelFamily
from .render import user_cache_dir

FAILURES = ("compile", "out_of_resources", "wrong_result", "runtime")
# Where a key's wall time goes (KeyResult.phases, seconds): the workload's build (a task's
# ensure(), before the first trial), the batches' compiles (precompile), and per trial its
# configure (the first run of a config: its compile where nothing precompiled it), its check
# against the reference (and the restore after it) and its timing; the paired final timing.
PHASES = ("build", "compile", "configure", "check", "time", "final")
# The largest batch of trials asked at once of a task that precompiles (batches grow 1, 2, 4, ...
# to it): one per compile worker (precompile.MAX_THREADS, at most 8), few enough that TPE still
# learns from most trials before it proposes the next.
PRECOMPILE_BATCH = 8
Timer = Callable[["TuningTask"], tuple[float, float, float]]


class WrongResult(Exception):
    """The config computed something else than the reference: it must never win."""


class TuningTask(Protocol):
    """One workload to tune. ``configure`` selects a config (compiling on first use);
    ``run`` launches once; ``restore`` puts in-place tensors back (between timed runs);
    ``check`` runs on fresh random inputs and returns the normwise relative error against
    the family's reference; ``tol`` is the largest acceptable error. A task may also set
    ``graph_replayed = True``: time the replay of a CUDA graph of ``run`` (timing.restoring_timer),
    and define ``allows(config)``: False prunes a config the family allows but the task's user
    cannot run well, ``release()``: called once its study is over, it frees the workload
    (the tasks of a run are built up front; a large one allocates when first used), and
    ``precompile(configs)``: compile these configs' kernels (in parallel, on background threads)
    and return when they are done, staying on its config (``configure`` then finds them compiled)."""

    family: KernelFamily
    variant: str  # the family's tuning key of the structural variant
    dtype: str
    numel: int
    floor_ms: float | None
    tol: float

    def configure(self, config: Mapping[str, int]) -> None: ...
    def run(self) -> None: ...
    def restore(self) -> None: ...
    def check(self) -> float: ...


def classify(exc: BaseException) -> str:
    """The failure type of an exception raised while compiling or running a config."""
    if isinstance(exc, WrongResult):
        return "wrong_result"
    text = f"{type(exc).__name__} {exc}".lower()
    if "outofresources" in text or "out of resource" in text or "shared memory" in text:
        return "out_of_resources"
    if "compil" in text:
        return "compile"
    return "runtime"


@dataclass
class KeyResult:
    task: TuningTask
    best: dict | None = None
    best_times: tuple[float, float, float] | None = None
    default_p50: float | None = None
    trials: int = 0
    failures: Counter = field(default_factory=Counter)
    # the study's starting point (the key's old entry, or the nearest bucket's) never ran: its
    # winner could be slower than what the lookup gave before, so it is not written
    start_not_reached: bool = False
    # seconds by PHASES over this run's trials (a resumed study's earlier trials not included),
    # and the key's whole wall time
    phases: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    wall_s: float = 0.0

    def entry(self) -> dict:
        """The cache entry (DESIGN.md "Cache file") for this key."""
        p20, p50, p80 = self.best_times
        return {
            "family": self.task.family.name, "variant": self.task.variant, "dtype": self.task.dtype,
            "bucket": size_bucket(self.task.numel), "config": self.best, "p20_ms": p20, "p50_ms": p50,
            "p80_ms": p80, "default_p50_ms": self.default_p50, "trials": self.trials,
            "failures": {k: self.failures[k] for k in FAILURES if self.failures[k]}, "method": "optuna-tpe",
        }  # fmt: skip


def cache_key(task: TuningTask) -> tuple:
    """(family, variant, dtype, bucket): the cache key a task's study tunes."""
    return (task.family.name, task.variant, task.dtype, size_bucket(task.numel))


def _study_name(task: TuningTask, arch: str) -> str:
    return arch + "/" + "/".join(str(k) for k in cache_key(task))


def _config_key(config: Mapping[str, int]) -> tuple:
    return tuple(sorted(config.items()))


def tune_task(task: TuningTask, arch: str, timer: Timer, *, trials: int, seconds: float, storage: str | None,
              seed: int = 0, progress: Callable[[], None] | None = None, warm_start: Mapping | None = None,
              final_rounds: int = 3) -> KeyResult:  # fmt: skip
    """Run (or resume) the study of one task; returns its best legal, correct config, timed
    ``final_rounds`` times alternately with the default (no paired timing if 0)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    family = task.family
    study = optuna.create_study(
        study_name=_study_name(task, arch), storage=storage, load_if_exists=True, direction="minimize",
        sampler=_sampler(seed),
    )  # fmt: skip
    start = _warm_config(family, warm_start) if warm_start else None  # tried right after the default
    if not study.trials:
        study.enqueue_trial(dict(family.default_config))
        if start is not None and start != family.default_config:
            study.enqueue_trial(start)
        for config in family.seed_configs:  # alternatives the sampler would rarely draw
            study.enqueue_trial(dict(config))
    seen = {_config_key(t.params): t for t in study.trials if _ran(t) and t.params}
    allows = getattr(task, "allows", lambda _: True)
    began, phases = time.monotonic(), dict.fromkeys(PHASES, 0.0)

    def suggest(trial) -> dict:
        return {t.name: trial.suggest_categorical(t.name, list(t.choices)) for t in family.tunables}

    def compiles(config) -> bool:
        return family.is_legal(config) and allows(config)

    def objective(trial) -> float:
        config = suggest(trial)
        earlier = seen.get(_config_key(config))
        if earlier is not None:  # never rerun a config: reuse its outcome
            trial.set_user_attr("repeat_of", earlier.number)
            if earlier.state == optuna.trial.TrialState.COMPLETE:
                for k in ("p20_ms", "p50_ms", "p80_ms"):
                    trial.set_user_attr(k, earlier.user_attrs[k])
                return earlier.value
            raise optuna.TrialPruned(f"repeat of trial {earlier.number} ({earlier.state.name})")
        if not compiles(config):
            trial.set_user_attr("pruned", "illegal")
            raise optuna.TrialPruned("illegal config")
        try:
            with _phase(phases, "configure"):
                task.configure(config)
            with _phase(phases, "check"):
                error = task.check()
                if not error <= task.tol:  # NaN fails too
                    raise WrongResult(f"relative error {error:.3e} > {task.tol:.1e}")
                task.restore()
            with _phase(phases, "time"):
                p20, p50, p80 = timer(task)
        except Exception as exc:  # noqa: BLE001 - typed, recorded, never retried
            trial.set_user_attr("failure", classify(exc))
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:500])
            raise
        for name, value in (("p20_ms", p20), ("p50_ms", p50), ("p80_ms", p80), ("rel_error", error)):
            trial.set_user_attr(name, float(value))
        return float(p50)

    def after(study, trial) -> None:
        if trial.params:
            seen.setdefault(_config_key(trial.params), trial)
        if progress is not None:
            progress()

    remaining = max(0, trials - sum(1 for t in study.trials if _ran(t)))
    if remaining:
        ensure = getattr(task, "ensure", None)  # a model workload builds (and first steps) here
        if ensure is not None:
            with _phase(phases, "build"):
                try:
                    ensure()
                except Exception:  # noqa: BLE001 - the first trial's configure meets it again and records it
                    pass
        prepare = getattr(task, "precompile", None)
        if prepare is not None:
            prepare = _timed(prepare, phases, "compile")

        def fresh(trial) -> dict | None:
            """The config of an asked trial if it would compile: legal, allowed, not seen before."""
            config = suggest(trial)
            return config if _config_key(config) not in seen and compiles(config) else None

        # the build is part of the key's share of the run's time, as it was inside the first trial
        _optimize(study, objective, after, remaining, max(1.0, seconds - phases["build"]),
                  PRECOMPILE_BATCH if prepare is not None else 1, prepare, fresh)  # fmt: skip
    result = _summarise(task, study)
    result.phases = phases
    result.start_not_reached = start is not None and not any(
        _ran(t) and _config_key(t.params) == _config_key(start) for t in study.trials)  # fmt: skip
    if final_rounds and result.best is not None and result.default_p50 is not None:
        with _phase(phases, "final"):
            _paired_timing(task, timer, result, final_rounds)
    result.wall_s = time.monotonic() - began
    return result


@contextmanager
def _phase(phases: dict, name: str):
    """``with _phase(phases, name):`` adds the block's wall seconds to ``phases[name]``, also
    when it raises."""
    start = time.monotonic()
    try:
        yield
    finally:
        phases[name] += time.monotonic() - start


def _timed(fn, phases: dict, name: str):
    """``fn`` with its calls' wall seconds added to ``phases[name]``."""

    def call(*args, **kwargs):
        with _phase(phases, name):
            return fn(*args, **kwargs)

    return call


def _warm_config(family: KernelFamily, config: Mapping) -> dict | None:
    """A cache entry's config (tuned on any template version) as a starting point under the
    family's tunables now: keys no longer tunable left out, new ones at their defaults; None where
    a value is no longer among its tunable's choices or the result is illegal."""
    warm = {t.name: config.get(t.name, t.default) for t in family.tunables}
    if any(warm[t.name] not in t.choices for t in family.tunables) or not family.is_legal(warm):
        return None
    return warm


def _ran(trial) -> bool:
    """Whether a trial of the study ran to an outcome (not one asked and skipped at the deadline)."""
    return trial.state.is_finished() and "skipped" not in trial.user_attrs


def _sampler(seed: int):
    """TPE with a fixed seed; its constant liar counts trials asked but not yet told (a batch) as
    already bad, so one batch does not propose one config eight times."""
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)


def _optimize(study, objective, after, n_trials: int, seconds: float, batch: int, prepare, fresh) -> None:
    """``study.optimize(objective, n_trials, timeout=seconds, catch=(Exception,), callbacks=[after])``
    in batches of asked trials: ``prepare`` (a task's ``precompile``) gets the configs of a batch
    that ``fresh`` says would compile before the first of them runs. Every asked trial is told, so
    none is left running in storage: those the deadline leaves unrun are pruned as ``skipped``
    (neither counted nor taken for configs seen: a resumed study may run them).

    Batches start at one trial and double up to ``batch``, and none holds more trials than the
    time left runs at the last batch's seconds per compiled trial (its compile included): compiles
    the deadline would leave unrun are not started. (AdamMini's model buckets on an H200 took
    151 s to their first trial with a first batch of eight, where a key had 30 s.)"""
    import optuna

    deadline = time.monotonic() + seconds
    done, size, per_trial = 0, 1, 0.0
    while done < n_trials and time.monotonic() < deadline:
        start = time.monotonic()
        count = min(size, n_trials - done)
        if per_trial > 0:
            count = min(count, int((deadline - start) / per_trial))
            if not count:
                break  # not one more trial's time left: compile nothing the deadline would cut
        asked = [study.ask() for _ in range(count)]
        compiled = len(asked)
        if prepare is not None:
            configs = [c for c in map(fresh, asked) if c is not None]
            compiled = len(configs)
            if configs:
                prepare(configs)
        for trial in asked:
            if time.monotonic() >= deadline:
                trial.set_user_attr("skipped", "time budget")
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            try:
                frozen = study.tell(trial, objective(trial))
            except optuna.TrialPruned:
                frozen = study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            except Exception:  # noqa: BLE001 - recorded on the trial by the objective, as optimize's catch
                frozen = study.tell(trial, state=optuna.trial.TrialState.FAIL)
            after(study, frozen)
        done += len(asked)
        # the pace of a trial that compiles (repeats and illegal configs cost next to nothing)
        per_trial = (time.monotonic() - start) / max(1, compiled)
        size = min(batch, 2 * size)


def _paired_timing(task: TuningTask, timer: Timer, result: KeyResult, rounds: int) -> None:
    """Time the default and the winner alternately ``rounds`` times each and keep, per config,
    the round with the median p50; the default wins ties."""
    default = dict(task.family.default_config)
    times: dict[str, list] = {"default": [], "best": []}
    for _ in range(rounds):
        for name, config in (("default", default), ("best", result.best)):
            task.configure(config)
            task.restore()
            times[name].append(timer(task))
    task.restore()
    median = {name: sorted(ts, key=lambda t: t[1])[len(ts) // 2] for name, ts in times.items()}
    result.default_p50 = median["default"][1]
    if median["default"][1] <= median["best"][1]:
        result.best, result.best_times = default, median["default"]
    else:
        result.best_times = median["best"]


def _summarise(task: TuningTask, study) -> KeyResult:
    import optuna

    result = KeyResult(task)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and math.isfinite(t.value)]
    result.trials = sum(1 for t in study.trials if _ran(t))
    result.failures = Counter(t.user_attrs["failure"] for t in study.trials if "failure" in t.user_attrs)
    default = _config_key(task.family.default_config)
    for t in complete:
        if _config_key(t.params) == default:
            result.default_p50 = t.user_attrs["p50_ms"]
            break
    if complete:
        best = min(complete, key=lambda t: t.value)
        result.best = dict(best.params)
        result.best_times = tuple(best.user_attrs[k] for k in ("p20_ms", "p50_ms", "p80_ms"))
    return result


def tune(tasks: Sequence[TuningTask], arch: str, timer: Timer, *, local_arch: str, trials: int = 40,
         minutes: float = 8.0, output: Path | None = None, study_path: Path | None = None,
         resume: bool = True, show_progress: bool = True, final_rounds: int = 3) -> list[KeyResult]:  # fmt: skip
    """Tune every task within ``minutes`` (shared out over the tasks still to run), write each
    key's winner to ``output`` (default: the user overlay) as soon as its study ends (a run cut
    short keeps the keys it finished) and return the per-key results."""
    if arch != local_arch:
        raise RuntimeError(f"cannot tune {arch} here: this machine's device is {local_arch} "
                           f"(timings must come from the architecture they are cached for)")  # fmt: skip
    study_path = study_path or user_cache_dir() / "studies" / f"{arch}.db"
    study_path.parent.mkdir(parents=True, exist_ok=True)
    if not resume and study_path.exists():
        study_path.unlink()
    storage = f"sqlite:///{study_path}"
    output = output or user_cache_dir() / f"{arch}.json"
    prior = prior_configs(output, current_device())  # this GPU's own entries first
    deadline = time.monotonic() + 60.0 * minutes
    bar = _bar(trials * len(tasks)) if show_progress else None
    results = []
    for i, task in enumerate(tasks):
        seconds = (deadline - time.monotonic()) / (len(tasks) - i)
        result = tune_task(task, arch, timer, trials=trials, seconds=seconds, storage=storage,
                           progress=bar.update if bar else None, warm_start=_starting_point(prior, cache_key(task)),
                           final_rounds=final_rounds)  # fmt: skip
        results.append(result)
        if result.best is not None and not result.start_not_reached:
            merge_entries(output, arch, [result.entry()])
        release = getattr(task, "release", None)  # a task may free its workload once studied
        if release is not None:
            release()
    if bar is not None:
        bar.close()
    return results


def studied_less(tasks: Sequence[TuningTask], files: Sequence[Path], arch: str, device: str | None,
                 n: int) -> list[TuningTask]:  # fmt: skip
    """The tasks whose key has no entry tuned on ``device`` in ``files``, or one from a study of
    fewer than ``n`` trials: the studies a run should go on with first."""
    studied = trials_on_device(files, arch, device)
    return [t for t in tasks if studied.get(cache_key(t), 0) < n]


def _starting_point(prior: Mapping[tuple, dict], key: tuple) -> dict | None:
    """The config a key's study tries after the default: its own entry in the output file, else
    the entry of the nearest bucket of the same family, variant and dtype (what the lookup gives
    the key until it is tuned, so a short study of a new bucket starts from there); None if neither."""
    if key in prior:
        return prior[key]
    same = [k for k in prior if k[:3] == key[:3]]
    if not same:
        return None
    return prior[min(same, key=lambda k: (abs(math.log2(k[3]) - math.log2(key[3])), k[3]))]


def _bar(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="tuning", unit="trial")


def phase_report(results: Sequence[KeyResult]) -> str:
    """Per key: its wall seconds in this run and the seconds of each of PHASES (what is left,
    "other", is the sampler, the study's storage and the paired timing's configures)."""
    head = f"{'key':<62} {'trials':>6} {'wall s':>7} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'other':>6}"
    lines = [head]
    for r in results:
        other = r.wall_s - sum(r.phases.values())
        lines.append(f"{key_name(r.task):<62} {r.trials:>6} {r.wall_s:>7.1f} "
                     + " ".join(f"{r.phases[p]:>9.1f}" for p in PHASES) + f" {other:>6.1f}")  # fmt: skip
    return "\n".join(lines)


def key_name(task: TuningTask) -> str:
    """The cache key a task tunes, as the report prints it: family, variant, dtype, bucket."""
    return " ".join(str(k) for k in cache_key(task))


def report(results: Sequence[KeyResult]) -> str:
    """Per key: default vs tuned p50 (ms), % of floor, speedup, trials and failures."""
    lines = [f"{'key':<62} {'default ms':>10} {'tuned ms':>9} {'% floor':>8} {'speedup':>8} {'trials':>6}  failures"]
    for r in results:
        t = r.task
        key = key_name(t)
        if r.best is None:
            dashes = " ".join(f"{'-':>{w}}" for w in (10, 9, 8, 8))
            lines.append(f"{key:<62} {dashes} {r.trials:>6}  {dict(r.failures)} (no winner)")
            continue
        tuned = r.best_times[1]
        floor = f"{100 * t.floor_ms / tuned:.1f}" if t.floor_ms else "-"
        default = f"{r.default_p50:.4f}" if r.default_p50 else "-"
        speedup = f"{r.default_p50 / tuned:.3f}x" if r.default_p50 else "-"
        kept = " (not written: the starting point did not run)" if r.start_not_reached else ""
        lines.append(f"{key:<62} {default:>10} {tuned:>9.4f} {floor:>8} {speedup:>8} {r.trials:>6}  "
                     f"{dict(r.failures)}{kept}")  # fmt: skip
    return "\n".join(lines)
