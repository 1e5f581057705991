"""The `colo` console script. `colo submit` takes a short path that does not import typer (see
colo/submitspec.py); every other command, and any submit the short path does not know, goes to
the typer app in colo/cli.py."""
from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["submit"]:
        from .submitspec import run_fast

        code = run_fast(sys.argv[2:])
        if code is not None:
            sys.stdout.flush()
            sys.exit(code)
    from .cli import main as full

    full()
