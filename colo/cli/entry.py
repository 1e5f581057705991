"""What the `colo` command (bin/colo) runs.

Every command that talks to the daemon runs without importing typer: its options are read by
colo/cli/argv.py from colo/cli/options.py's table, and its function (the same one the typer command
calls) runs at once. A shell's completion request for a job argument is answered the same way
(colo/cli/complete.py). Anything the short parser does not know (--help, an unknown option, a
malformed number, the commands that do not ask the daemon) goes to the typer app in colo/cli/app.py.

`colo` (bin/colo, `python -m colo`) runs command(): main(), then an exit without the interpreter's
teardown (end()).
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


def command() -> None:
    """What bin/colo and `python -m colo` run: main(), then end() with its exit code."""
    try:
        main()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            end(e.code or 0)
        raise


def end(code: int) -> None:
    """Exit now, once stdout and stderr are flushed, without the interpreter's teardown: freeing
    every module and object one by one, a seventh of `colo ls` (~3 ms of ~20; bench/peers_bench.py)
    for nothing, as the process ends. Only where nothing waits for the exit: no atexit hook (a
    library's cleanup) and no thread but this one; else (and where a flush fails: the usual exit
    says so) it returns, and the caller exits the usual way."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    import atexit

    threading = sys.modules.get("threading")
    if getattr(atexit, "_ncallbacks", lambda: 1)() == 0 and (threading is None or threading.active_count() == 1):
        os._exit(code)
