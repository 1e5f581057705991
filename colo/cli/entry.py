"""What the `colo` command (bin/colo) runs.

Every command that talks to the daemon runs without importing typer: its options are read by
colo/cli/argv.py from colo/cli/options.py's table, and its function (the same one the typer command
calls) runs at once. A shell's completion request for a job argument is answered the same way
(colo/cli/complete.py). Anything the short parser does not know (--help, an unknown option, a
malformed number, the commands that do not ask the daemon) goes to the typer app in colo/cli/app.py.
"""
from __future__ import annotations

import os
import sys


def main() -> None:
    if "_COLO_COMPLETE" in os.environ:
        from .complete import fast

        if fast():
            sys.exit(0)
    cmd = None
    if len(sys.argv) > 1:
        from .options import BY_NAME

        cmd = BY_NAME.get(sys.argv[1])
    if cmd is not None:
        from .argv import parse

        kw = parse(cmd, sys.argv[2:])
        if kw is not None:
            from .out import run

            module, _, name = cmd.run.partition(":")
            code = run(getattr(__import__(module, fromlist=[name]), name), kw)
            sys.stdout.flush()
            sys.exit(code)
    from .app import main as full

    full()
