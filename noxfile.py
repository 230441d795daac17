"""nox sessions: tests (CPU tier), tests_gpu, parity, bench, convergence, tune, lint.

Every session also runs with ``nox --no-venv`` (the GPU machine has torch and triton and no
network): then nothing is downloaded, and the package is installed without dependencies
only if it is not importable yet. In a virtualenv, the system's torch is reused when there
is one (``--system-site-packages``); otherwise ``torch==2.13.0`` is pinned, which is the CPU
wheel on the CPU machines this project's CI uses.
"""

from __future__ import annotations

import importlib.util

import nox

nox.options.sessions = ["lint", "tests", "parity"]
nox.options.default_venv_backend = "venv"
VENV = ["--system-site-packages"]
TORCH_PIN = "torch==2.13.0"


def _install(session: nox.Session, *extras: str) -> None:
    if session.venv_backend == "none":
        try:
            session.run("python", "-c", "import kernel_factory.optimizers", silent=True)
        except Exception:  # noqa: BLE001 - nox raises its own CommandFailed
            session.run("python", "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", ".")
        return
    if importlib.util.find_spec("torch") is None:
        session.install(TORCH_PIN)
    session.install("-e", f".[{','.join(('dev', *extras))}]")


def _run_module(session: nox.Session, module: str, *extras: str) -> None:
    _install(session, *extras)
    session.run("python", "-m", module, *session.posargs)


@nox.session(venv_params=VENV)
def tests(session: nox.Session) -> None:
    """CPU tier: torch's CPU kernels, and the generated Triton kernels under the interpreter.

    In a virtualenv (pytest-xdist from the dev extra) two workers share the tests: the
    interpreter's tests are single-threaded Python, so a 2-core CI machine runs the tier in about
    12 minutes instead of 17. Two, not one per core: a distributed test forks up to 4 ranks.
    ``nox -s tests -- -n 0`` runs them in one process. The bench extra too: the convergence
    harness's test writes its plots (matplotlib)."""
    _install(session, "bench")
    workers = [] if session.venv_backend == "none" else ["-n", "2"]
    session.run("python", "-m", "pytest", "-m", "not gpu", *workers, *session.posargs,
                env={"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip


@nox.session(venv_params=VENV)
def tests_gpu(session: nox.Session) -> None:
    """GPU tier (-m gpu): multi-tensor kernels, bf16, graph capture, checkpoint interchange."""
    _install(session)
    session.run("python", "-m", "pytest", "-m", "gpu", *session.posargs)


@nox.session(venv_params=VENV)
def parity(session: nox.Session) -> None:
    """Parity matrix (optimizer x dtype x shape set); non-zero exit on any failure."""
    _run_module(session, "kernel_factory.optimizers.parity.matrix")


@nox.session(venv_params=VENV)
def bench(session: nox.Session) -> None:
    """The benchmark matrix (every registered optimizer vs the HBM floor); benchmarks/results/bench.*"""
    _run_module(session, "benchmarks.bench", "bench")


@nox.session(venv_params=VENV)
def convergence(session: nox.Session) -> None:
    """Train the small Llama-style model on text with every optimizer; benchmarks/results/convergence_*"""
    _run_module(session, "benchmarks.convergence", "bench")


@nox.session(venv_params=VENV)
def tune(session: nox.Session) -> None:
    """Optuna-tune the kernels on this GPU: nox -s tune -- --arch sm90 [--output autotune_cache/sm90.json]"""
    _run_module(session, "kernel_factory.optimizers.tune", "bench")


@nox.session(venv_params=VENV)
def lint(session: nox.Session) -> None:
    if session.venv_backend != "none":
        session.install("ruff")
    session.run("ruff", "check", ".")
