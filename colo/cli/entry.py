"""What the `colo` command (bin/colo) runs. `colo submit` and `colo ls` take short paths that do
not import typer (see colo/cli/submitspec.py, colo/cli/lsview.py); every other command, and any submit or
ls the short path does not know, goes to the typer app in colo/cli/app.py."""
from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:2] == ["submit"]:
        from .submitspec import run_fast

        code = run_fast(sys.argv[2:])
        if code is not None:
            sys.stdout.flush()
            sys.exit(code)
    if sys.argv[1:2] == ["ls"]:  # the same short path for `colo ls` (colo/cli/lsview.py)
        from .lsview import run_fast

        code = run_fast(sys.argv[2:])
        if code is not None:
            sys.exit(code)
    from .app import main as full

    full()
