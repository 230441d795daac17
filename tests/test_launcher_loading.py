"""Triton's launchers are C extension modules sharing one name; loading them from several threads
(precompile's workers) must give each caller its own file's functions (launcher_loading)."""

import shutil
import sys
import threading

import pytest

from kernel_factory.optimizers.shared import launcher_loading, precompile

build = pytest.importorskip("triton.runtime.build")
pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="needs a C compiler to build the extension modules")  # fmt: skip

NAME = "__kf_launcher_loading_test"  # one name for every module, as Triton's launchers have
SOURCE = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject* value(PyObject* self, PyObject* args) { return PyLong_FromLong(%d); }
static PyMethodDef methods[] = {{"value", value, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "%s", NULL, -1, methods};
PyMODINIT_FUNC PyInit_%s(void) { return PyModule_Create(&def); }
"""


def _cpython_loader():
    """Triton's loader as it is without ``launcher_loading``'s wrapper."""
    return getattr(build._load_module_from_path, "__wrapped__", build._load_module_from_path)


@pytest.fixture(scope="module")
def paths():
    """Files of four single-phase modules named NAME whose value() returns 0, 1, 2, 3."""
    raw = _cpython_loader()
    original, build._load_module_from_path = build._load_module_from_path, raw
    try:
        return [build.compile_module_from_src(SOURCE % (i, NAME, NAME), NAME).__file__ for i in range(4)]
    finally:
        build._load_module_from_path = original


def test_a_second_load_of_one_file_changes_the_module_another_load_returned(paths):
    # The failure the wrapper exists for, with CPython's own loading: if this stops holding, the
    # wrapper is no longer needed (and this test says so).
    raw = _cpython_loader()
    raw(NAME, paths[0])
    b = raw(NAME, paths[1])
    raw(NAME, paths[0])  # a second load of the first file
    assert b.value() == 0


def test_the_private_loader_keeps_what_each_load_returned(paths):
    raw = _cpython_loader()
    load = launcher_loading.private_loader(raw)
    a, b = load(NAME, paths[0]), load(NAME, paths[1])
    load(NAME, paths[0])
    load(NAME, paths[2])
    assert (a.value(), b.value()) == (0, 1)


def test_threads_loading_at_once_each_get_their_own_file(paths):
    raw = _cpython_loader()
    load = launcher_loading.private_loader(raw)
    got, start = {}, threading.Barrier(8)

    def worker(t):
        start.wait()
        for i in range(200):
            k = (t + i) % len(paths)
            got[t, i] = (k, load(NAME, paths[k]).value())

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(precompile.FAST_SWITCH_S)  # as while precompile's workers run
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(got) == 1600 and all(k == v for k, v in got.values())


def test_install_wraps_tritons_loader_once():
    launcher_loading.install()
    first = build._load_module_from_path
    launcher_loading.install()
    assert build._load_module_from_path is first and hasattr(first, "__wrapped__")
