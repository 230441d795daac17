"""What every results file records about how it was made."""

from __future__ import annotations

import sys
from pathlib import Path


def nox_command(session: str, argv: list[str] | None) -> str:
    """The nox command line that reproduces this run (``argv`` None: this process's args)."""
    extra = " ".join(sys.argv[1:] if argv is None else argv)
    return f"nox -s {session}" + (f" -- {extra}" if extra else "")


def write_report(path: Path, lines: list[str]) -> None:
    """Write a markdown results file (its folder made if needed) and print it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
