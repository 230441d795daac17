"""The background compile pool (optimizers/shared/precompile.py): tasks run, their errors stay with
the waiter that drops them, no idle thread is left behind, and nothing is compiled ahead on the
CPU."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from kernel_factory.optimizers.shared import precompile


def test_tasks_run_on_a_few_threads_that_exit_when_idle():
    seen = set()

    def task(i):
        seen.add(threading.current_thread().name)
        time.sleep(0.01)
        return i

    futures = [precompile._submit(lambda i=i: task(i)) for i in range(40)]
    assert [f.result(timeout=30) for f in futures] == list(range(40))
    assert seen == {"kf-compile"} and precompile._workers <= precompile.MAX_THREADS
    deadline = time.monotonic() + 10
    while precompile._workers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert precompile._workers == 0  # (a later fork copies no idle compile thread)


def test_a_failed_warmup_is_dropped_by_wait_and_kept_by_its_future():
    def fail():
        raise RuntimeError("compile failed")

    future = precompile._submit(fail)
    with pytest.raises(RuntimeError, match="compile failed"):
        future.result(timeout=30)
    precompile.Warm(future).wait()  # the launch compiles again in the caller and reports there
    precompile.Warm(None).wait()


def test_later_tasks_start_once_every_other_task_has_finished():
    events, lock = [], threading.Lock()

    def task(name, seconds):
        with lock:
            events.append(("start", name))
        time.sleep(seconds)
        with lock:
            events.append(("end", name))

    gate = threading.Event()  # holds one task running until every task is queued (no timing)
    first = [precompile._submit(lambda: (gate.wait(30), task("now-gate", 0.01)))]
    first += [precompile._submit(lambda i=i: task(f"now{i}", 0.01 * (i % 3 + 1))) for i in range(12)]
    later = [precompile._submit(lambda i=i: task(f"later{i}", 0.01), later=True) for i in range(6)]
    more = precompile._submit(lambda: task("now-last", 0.02))  # queued after the later ones
    gate.set()
    for f in [*first, *later, more]:
        f.result(timeout=60)
    position = {e: i for i, e in enumerate(events)}
    last_now_end = max(i for (kind, name), i in position.items() if kind == "end" and name.startswith("now"))
    first_later_start = min(i for (kind, name), i in position.items() if kind == "start" and name.startswith("later"))
    assert first_later_start > last_now_end, events
    _settle(lambda: precompile._workers == 0)
    assert precompile._workers == 0 and precompile._running == 0
    # with nothing else queued, a later task starts at once
    assert precompile._submit(lambda: "alone", later=True).result(timeout=30) == "alone"


def test_waiting_for_a_later_compile_not_started_takes_it_off_the_queue():
    gate = threading.Event()
    blocker = precompile._submit(lambda: gate.wait(30))
    ran = []
    queued = precompile._submit(lambda: ran.append(1), later=True)
    precompile.Warm(queued, later=True).wait()  # returns at once: the launch compiles it itself
    assert queued.cancelled()
    gate.set()
    blocker.result(timeout=30)
    _settle(lambda: precompile._workers == 0)
    assert ran == []
    done = precompile._submit(lambda: ran.append(2), later=True)
    done.result(timeout=30)
    precompile.Warm(done, later=True).wait()  # finished: nothing to take off
    assert ran == [2]


def test_exit_drops_queued_compiles_and_waits_for_the_running_one(monkeypatch):
    # a process's first task queues Triton's set-up ahead of it: let that run first, so that the
    # task counted as running below is this test's
    precompile._submit(lambda: None).result(timeout=120)
    _settle(lambda: precompile._workers == 0)
    monkeypatch.setattr(precompile, "MAX_THREADS", 1)  # the queued tasks find no idle worker
    gate, ran = threading.Event(), []
    running = precompile._submit(lambda: (gate.wait(30), ran.append("running")))
    _settle(lambda: precompile._running == 1)
    queued = [precompile._submit(lambda: ran.append("queued")),
              precompile._submit(lambda: ran.append("later"), later=True)]  # fmt: skip
    threading.Timer(0.2, gate.set).start()  # the running compile ends while the drain waits
    precompile._drain_at_exit()
    assert ran == ["running"] and running.done() and all(f.cancelled() for f in queued)
    assert precompile._workers == 0


def test_a_process_exits_after_its_running_compile_has_finished(tmp_path):
    # without the drain the interpreter stops the daemon worker mid-task (in Triton's C++: an abort)
    done = tmp_path / "done"
    script = (f"import pathlib, threading, time\n"
              f"from kernel_factory.optimizers.shared import precompile\n"
              f"started = threading.Event()\n"
              f"task = lambda: (started.set(), time.sleep(0.5), pathlib.Path({str(done)!r}).write_text('1'))\n"
              f"precompile._submit(task)\n"
              f"started.wait(60)\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert done.read_text() == "1"


def test_a_later_task_that_is_a_process_s_first_still_runs():
    # the first task of a process queues Triton's hash and driver set-up ahead of it: a worker
    # must start for those even when the task itself waits for the rest (``later``)
    script = ("from kernel_factory.optimizers.shared import precompile\n"
              "print(precompile._submit(lambda: 7, later=True).result(timeout=60))\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "7", out.stderr[-2000:]


def test_the_switch_interval_is_short_while_workers_run_and_put_back_after():
    _settle(lambda: precompile._workers == 0 and precompile._saved_switch is None)
    default = sys.getswitchinterval()
    gate = threading.Event()
    task = precompile._submit(lambda: (gate.wait(30), sys.getswitchinterval())[1])
    assert sys.getswitchinterval() == pytest.approx(precompile.FAST_SWITCH_S)
    gate.set()
    assert task.result(timeout=30) == pytest.approx(precompile.FAST_SWITCH_S)
    _settle(lambda: precompile._workers == 0 and precompile._saved_switch is None)
    assert sys.getswitchinterval() == pytest.approx(default)
    # a value the user set meanwhile is theirs to keep
    gate = threading.Event()
    task = precompile._submit(lambda: gate.wait(30))
    try:
        sys.setswitchinterval(0.002)
        gate.set()
        task.result(timeout=30)
        _settle(lambda: precompile._workers == 0 and precompile._saved_switch is None)
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(default)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_a_child_forked_while_a_worker_runs_starts_with_a_pool_of_its_own():
    _settle(lambda: precompile._workers == 0 and precompile._saved_switch is None)
    default = sys.getswitchinterval()
    gate = threading.Event()
    running = precompile._submit(lambda: gate.wait(30))
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker is not here; its own submissions run
        ok = (sys.getswitchinterval() == pytest.approx(default) and precompile._workers == 0
              and precompile._submit(lambda: 7).result(timeout=30) == 7)  # fmt: skip
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    gate.set()
    running.result(timeout=30)
    assert os.waitstatus_to_exitcode(status) == 0


def test_nothing_is_compiled_ahead_on_the_cpu():
    p = torch.zeros(4)
    assert not precompile.enabled(p.device) and not precompile.worth_planning([p])
    assert precompile.warm(object(), (1,), (), {}, p.device)._future is None


def test_plans_ahead_skip_frozen_params_and_drop_a_plan_that_fails(monkeypatch):
    monkeypatch.setattr(precompile, "worth_planning", lambda params: True)
    frozen = torch.zeros(3)
    trained = [torch.zeros(2, requires_grad=True), torch.zeros(4, requires_grad=True)]
    groups = [{"params": [trained[0], frozen]}, {"params": [trained[1]]}]
    built = {}

    class Opt:
        backend, param_groups, _plans = None, groups, built

    def build(index, group, params):
        built[index] = params
        if index == 1:
            raise RuntimeError("cannot plan")

    precompile.plan_ahead(Opt, build)
    assert list(built) == [0] and built[0] == [groups[0]["params"][0]]  # the failed plan is left to the step
    Opt.backend = "torch"
    built.clear()
    precompile.plan_ahead(Opt, build)
    assert not built


@pytest.mark.parametrize("name", ["adam_mini", "muon", "turbo_adam"])
def test_a_constructor_plans_each_group_before_torch_adds_it_and_once(name, monkeypatch):
    # torch.optim's first add_param_group imports torch._dynamo (about 1.5 s): AdamMini's, Muon's
    # and TurboAdam's constructors plan each group (and queue its compiles) before torch adds it,
    # and plan_ahead then finds the plans cached
    from kernel_factory.optimizers import AdamMini, Muon, TurboAdam

    monkeypatch.setattr(precompile, "worth_planning", lambda params: True)
    events = []
    add, plan_group = torch.optim.Optimizer.add_param_group, precompile.plan_group

    def torch_add(self, group):
        events.append(("torch add", len(self.param_groups)))
        return add(self, group)

    def planning(optimizer, build, index, group, params):
        plan_group(optimizer, build, index, group, params)
        events.append(("planned", index, index in optimizer._plans))

    monkeypatch.setattr(torch.optim.Optimizer, "add_param_group", torch_add)
    monkeypatch.setattr(precompile, "plan_group", planning)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    early = [("planned", 0, True), ("torch add", 0), ("planned", 1, True), ("torch add", 1)]
    if name == "adam_mini":  # two groups: the weights (decayed), the biases (not)
        opt = AdamMini(model.named_parameters(), lr=1e-3, weight_decay=0.1, dim=16, n_heads=2)
    elif name == "muon":  # two groups: Muon's matrices, AdamW's biases
        opt = Muon(model.named_parameters(), lr=1e-3)
    else:  # two groups as given, the second's params an iterator: left to torch, planned after
        groups = [{"params": list(model[0].parameters())}, {"params": iter(model[1].parameters()), "lr": 1e-4}]
        opt = TurboAdam(groups, lr=1e-3)
        early = [("planned", 0, True), ("torch add", 0), ("torch add", 1)]
        assert len(opt.param_groups[1]["params"]) == 2
    assert events == early + [("planned", 0, True), ("planned", 1, True)]  # then plan_ahead's
    plans = dict(opt._plans)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt._plans == plans and all(opt._plans[i] is plans[i] for i in plans)  # the constructor's plans


def test_begin_lists_params_and_leaves_iterators_inside_groups_alone():
    p = torch.zeros(3, requires_grad=True)
    assert precompile.begin(iter([p])) == [p]
    assert precompile.begin(p) is p  # torch.optim's TypeError follows
    inner = iter([p])
    groups = precompile.begin([{"params": inner}, {"params": p}, ("name", p)])
    assert len(groups) == 3 and list(inner) == [p]  # not consumed: torch.optim lists it later


def test_launches_of_one_variant_are_warmed_once(monkeypatch):
    compiled = []

    class Kernel:
        def warmup(self, *args, grid, **kwargs):
            compiled.append((args[0].dtype, args[1], kwargs["BLOCK"]))

    monkeypatch.setattr(precompile, "enabled", lambda device: True)
    monkeypatch.setattr(precompile.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(precompile, "_queued", {})
    kernel, a, b = Kernel(), torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16)
    launches = [(kernel, (1,), (a, 32, 0.5), {"BLOCK": 4}), (kernel, (2,), (torch.ones(4), 48, 0.1), {"BLOCK": 4}),
                (kernel, (1,), (b, 32, 0.5), {"BLOCK": 4}), (kernel, (1,), (a, 1, 0.5), {"BLOCK": 4}),
                (kernel, (1,), (a, 32, 0.5), {"BLOCK": 8})]  # fmt: skip
    warms = precompile.warm_launches(launches, a.device)
    assert len(warms) == len(launches) and warms[0]._future is warms[1]._future
    precompile.wait_all(warms)
    # the second launch differs in values only; the others in dtype, an int of 1, a constexpr
    f32, bf16 = torch.float32, torch.bfloat16
    assert sorted(compiled, key=str) == sorted([(f32, 32, 4), (bf16, 32, 4), (f32, 1, 4), (f32, 32, 8)], key=str)


def _settle(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_import_starts_triton_hash_alone_and_only_where_the_kernels_run(monkeypatch):
    calls = []
    for name in ("import_triton", "triton_key", "triton_driver"):
        monkeypatch.setattr(precompile, f"_{name}", lambda name=name: calls.append(name))
    monkeypatch.setattr(precompile, "_hashing", False)
    monkeypatch.setattr(precompile, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(precompile.buckets, "triton_available", lambda: True)
    monkeypatch.delenv("KERNEL_FACTORY_BACKEND", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    precompile.start_hash()  # no GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("KERNEL_FACTORY_PRECOMPILE", "0")
    precompile.start_hash()  # precompiling off
    assert calls == []
    monkeypatch.delenv("KERNEL_FACTORY_PRECOMPILE")
    precompile.start_hash()
    precompile.start_hash()  # once a process
    _settle(lambda: "triton_key" in calls)
    assert calls == ["import_triton", "triton_key"]  # not the driver: it would initialise CUDA
    monkeypatch.setattr(precompile, "_started", False)
    precompile._submit(lambda: None).result(timeout=30)  # an optimizer's first compile
    _settle(lambda: "triton_driver" in calls)
    assert calls.count("triton_key") == 1 and calls.count("triton_driver") == 1


def test_the_timeline_holds_each_background_compile_with_its_variant(monkeypatch):
    class Kernel:
        __name__ = "fake_kernel"

        def warmup(self, *args, grid, **kwargs):
            time.sleep(0.05)
            if kwargs["BLOCK"] == 128:
                raise RuntimeError("compile failed")

    monkeypatch.setattr(precompile, "enabled", lambda device: True)
    monkeypatch.setattr(precompile.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(precompile, "_timeline", [])
    before = time.perf_counter()
    for block in (64, 128):  # a failed compile is in it too
        precompile.warm(Kernel(), (1,), (), {"BLOCK": block, "num_warps": 4}, torch.device("cuda")).wait()
    runs = precompile.timeline()
    assert [label for label, _, _ in runs] == ["fake_kernel {'BLOCK': 64, 'num_warps': 4}",
                                               "fake_kernel {'BLOCK': 128, 'num_warps': 4}"]
    assert all(before <= start and end - start >= 0.05 for _, start, end in runs)


def test_a_variant_s_launcher_builds_beside_its_compile_and_before_its_load(monkeypatch):
    """The launcher (launcher_prebuild: Triton 3.6's C module per signature) is queued ahead of the
    compile and runs beside it; the compiled kernel's load waits for a build that has started."""
    events = []

    class Compiled:
        def _init_handles(self):
            events.append(("load", time.perf_counter()))

    class Kernel:
        __name__ = "fake_kernel"

        def warmup(self, *args, grid, **kwargs):
            events.append(("compile", time.perf_counter()))
            time.sleep(0.05)
            return Compiled()

    def build(kernel, args, kwargs, device):
        events.append(("launcher", time.perf_counter()))
        time.sleep(0.2)  # longer than the compile: the load must wait for it
        events.append(("launcher built", time.perf_counter()))
        return True

    monkeypatch.setattr(precompile, "enabled", lambda device: True)
    monkeypatch.setattr(precompile.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(precompile.launcher_prebuild, "build", build)
    monkeypatch.setattr(precompile, "_timeline", [])
    precompile.warm(Kernel(), (1,), (), {"BLOCK": 32}, torch.device("cuda")).wait()
    at = dict(events)
    assert [name for name, _ in sorted(events, key=lambda e: e[1])] == ["launcher", "compile", "launcher built",
                                                                        "load"]  # fmt: skip
    assert at["compile"] - at["launcher"] < 0.1  # side by side, not one after the other
    labels = [label for label, _, _ in precompile.timeline()]
    assert labels == ["launcher of fake_kernel {'BLOCK': 32}", "fake_kernel {'BLOCK': 32}"]


def test_a_stand_in_variant_reads_ready_once_compiled_and_is_never_waited_for(monkeypatch):
    """``warm_optional``: Muon's two-part kernels compile after the rest; until one has, ``ready``
    says its launch must not be issued (the step takes the one-part launches), and afterwards the
    registry empties, so later checks cost no signature."""
    gate, compiles = threading.Event(), []

    class Kernel:
        def warmup(self, *args, grid, **kwargs):
            compiles.append(kwargs)
            gate.wait()

    monkeypatch.setattr(precompile, "enabled", lambda device: True)
    monkeypatch.setattr(precompile.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(precompile, "_optional", {})
    monkeypatch.setattr(precompile, "_queued", {})
    kernel, x = Kernel(), torch.empty(64)
    pair = (kernel, (4,), (x, 96), {"TWO_PARTS": True})
    warms = precompile.warm_optional([pair, pair], torch.device("cpu"))
    assert warms[0]._future is warms[1]._future  # one compile per variant
    assert not precompile.ready(kernel, (x, 96), {"TWO_PARTS": True}) and precompile.optional_pending()
    assert precompile.ready(kernel, (x, 96), {"TWO_PARTS": False})  # a variant never queued as a stand-in
    gate.set()
    warms[0]._future.result(timeout=60)
    assert precompile.ready(kernel, (x, 96), {"TWO_PARTS": True}) and not precompile.optional_pending()
    assert precompile._optional == {} and compiles == [{"TWO_PARTS": True}]
    _settle(lambda: precompile._workers == 0)


def test_a_variant_queued_twice_compiles_once(monkeypatch):
    """Two plans launching one variant (AdamMini's param groups) share its compile; another
    variant, another device or a later compile cancelled before it started is queued anew."""
    compiles = []

    class Kernel:
        __name__ = "fake_kernel"

        def warmup(self, *args, grid, **kwargs):
            compiles.append((args[1], kwargs["BLOCK"]))
            time.sleep(0.02)

    monkeypatch.setattr(precompile, "enabled", lambda device: True)
    monkeypatch.setattr(precompile.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(precompile, "_queued", {})
    kernel, x = Kernel(), torch.empty(64)
    cuda0, cuda1 = torch.device("cuda:0"), torch.device("cuda:1")
    warms = [precompile.warm(kernel, (1,), (x, 7), {"BLOCK": 64}, cuda0) for _ in range(3)]
    warms.append(precompile.warm(kernel, (9,), (x, 5), {"BLOCK": 64}, cuda0))  # 5, 7: one int kind
    warms.append(precompile.warm(kernel, (1,), (x, 7), {"BLOCK": 128}, cuda0))
    warms.append(precompile.warm(kernel, (1,), (x, 7), {"BLOCK": 64}, cuda1))
    precompile.wait_all(warms)
    assert sorted(compiles) == [(7, 64), (7, 64), (7, 128)]  # cuda:0 and cuda:1 each once, BLOCK 128
    assert all(w.done() for w in warms)

    gate = threading.Event()
    blocker = precompile._submit(gate.wait)  # keeps the later compile below from starting
    first = precompile.warm(kernel, (1,), (x, 3), {"BLOCK": 32}, cuda0, later=True)
    first.wait()  # not started: cancelled, for the launch to compile at once
    again = precompile.warm(kernel, (1,), (x, 3), {"BLOCK": 32}, cuda0, later=True)
    gate.set()
    blocker.result(timeout=30)
    deadline = time.monotonic() + 30
    while not again.done() and time.monotonic() < deadline:  # (wait() would cancel it if not started)
        time.sleep(0.01)
    assert again.done() and compiles.count((3, 32)) == 1


class _Plan:
    """A plan whose configure rebinds its attributes, as the optimizers' plans do."""

    device = torch.device("cpu")

    def __init__(self):
        self.configure({"X": 2})

    def configure(self, config):
        if config["X"] < 1:
            raise ValueError("X must be >= 1")
        self.config, self.items = dict(config), torch.arange(config["X"])

    def launches(self):
        return [("kernel", (1,), (self.items,), dict(self.config))]


def test_warm_config_queues_another_config_and_leaves_the_plan_on_its_own(monkeypatch):
    # The tuner's compile-ahead: the launches of a config not in use are queued, the plan keeps
    # the very objects of its own config, and a config configure refuses queues nothing.
    queued = []
    monkeypatch.setattr(precompile, "warm_launches", lambda launches, device, later=False: queued.extend(launches)
                        or [f"warm {len(queued)}"])  # fmt: skip
    plan = _Plan()
    own = dict(vars(plan))
    assert precompile.warm_config(plan, {"X": 3}, plan.launches) == [] and not queued  # the CPU: nothing ahead
    monkeypatch.setattr(precompile, "enabled", lambda device: True)
    assert precompile.warm_config(plan, {"X": 3}, plan.launches) == ["warm 1"]
    ((_, _, (items,), kwargs),) = queued
    assert items.tolist() == [0, 1, 2] and kwargs == {"X": 3}
    assert vars(plan).keys() == own.keys() and all(vars(plan)[k] is v for k, v in own.items())
    assert precompile.warm_config(plan, {"X": 0}, plan.launches) == [] and len(queued) == 1
    assert all(vars(plan)[k] is v for k, v in own.items())


def test_settle_returns_once_every_task_has_run_the_later_ones_included():
    gate, ran = threading.Event(), []
    precompile._submit(lambda: (gate.wait(30), ran.append("now")))
    precompile._submit(lambda: (time.sleep(0.05), ran.append("later")), later=True)
    assert not precompile.settle(timeout=0.2)  # the gate holds the first task
    gate.set()
    assert precompile.settle(timeout=60)
    assert ran == ["now", "later"] and precompile._workers == 0


def test_a_model_workload_is_built_once_its_background_compiles_have_ended():
    from kernel_factory.optimizers.shared.tuning import ModelWorkloadTask

    ran = []

    class Task(ModelWorkloadTask):
        def allocate(self):
            self.opt = object()
            precompile._submit(lambda: (time.sleep(0.1), ran.append("later")), later=True)

    Task().ensure()
    assert ran == ["later"]  # a trial timed after ensure() runs beside no compile
