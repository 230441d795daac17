"""What every results file records about how it was made."""

from __future__ import annotations

import sys


def nox_command(session: str, argv: list[str] | None) -> str:
    """The nox command line that reproduces this run (``argv`` None: this process's args)."""
    extra = " ".join(sys.argv[1:] if argv is None else argv)
    return f"nox -s {session}" + (f" -- {extra}" if extra else "")
