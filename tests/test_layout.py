"""The tree's rules (CONTRIBUTING.md): each family in its own folder of optimizers/, no family
imports another, and shared/ imports no family."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPTIMIZERS = Path(__file__).resolve().parent.parent / "optimizers"
NOT_FAMILIES = {"shared", "parity"}
FAMILIES = sorted(d.name for d in OPTIMIZERS.iterdir() if (d / "__init__.py").exists() and d.name not in NOT_FAMILIES)


def imported_subpackages(path: Path) -> set[str]:
    """The sub-packages of kernel_factory.optimizers that the module at ``path`` imports."""
    package = path.parent.name
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [f"kernel_factory.optimizers.{package}"]
            elif node.level == 2:
                base = "kernel_factory.optimizers" + (f".{node.module}" if node.module else "")
                names = [base] if node.module else [f"{base}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["kernel_factory", "optimizers"] and len(parts) > 2:
                found.add(parts[2])
    return found


def test_there_are_families_and_each_is_a_folder():
    assert {"adamw", "adam_mini", "muon"} <= set(FAMILIES)
    assert not [p.name for p in OPTIMIZERS.glob("*.py") if p.name not in ("__init__.py", "tune.py")]


def test_no_family_imports_another_and_shared_imports_none():
    offences = []
    for folder in [*FAMILIES, "shared"]:
        for path in (OPTIMIZERS / folder).glob("*.py"):
            others = imported_subpackages(path) & (set(FAMILIES) - {folder})
            if others:
                offences.append(f"{folder}/{path.name} imports {sorted(others)}")
    assert not offences, offences


def test_the_import_scan_sees_relative_and_absolute_imports(tmp_path):
    module = tmp_path / "muon" / "x.py"
    module.parent.mkdir()
    module.write_text("from ..adamw.plan import a\nfrom .. import adam_mini\n"
                      "import kernel_factory.optimizers.shared.buckets\n")
    assert imported_subpackages(module) == {"adamw", "adam_mini", "shared"}


def test_every_package_folder_is_installed():
    """``pip install .`` (not editable) installs the packages pyproject lists, and no others: a
    folder with an ``__init__.py`` left off the list is missing from the wheel, and
    ``kernel_factory.optimizers`` then fails to import."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = OPTIMIZERS.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            sub = init.parent.relative_to(root / folder).parts
            if "__pycache__" not in sub:
                found.add(".".join((name, *sub)))
    assert found == set(setuptools["packages"]), sorted(found ^ set(setuptools["packages"]))
