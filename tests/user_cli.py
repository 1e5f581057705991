"""`colo ARGS` as another real user, in this test process's interpreter (forked, then setuid)."""
from __future__ import annotations

import os
import tempfile

from harness.users import cli_main


class Ran:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def colo_as(pw, args: list[str], env: dict) -> Ran:
    """`colo ARGS` as the real user pw, in a forked child (the interpreter's own files are root's
    alone here: the CLI's modules are loaded before the child drops its uid)."""
    import colo.cli.entry  # noqa: F401
    from colo.cli import argv, doctor, lsview, out, submitspec  # noqa: F401
    import pwd  # noqa: F401
    import urllib.request  # noqa: F401
    files = [tempfile.TemporaryFile() for _ in range(2)]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        cli_main(pw, args, env, cwd="/", main=colo.cli.entry.main)
    _, status = os.waitpid(pid, 0)
    got = []
    for f in files:
        f.seek(0)
        got.append(f.read().decode())
        f.close()
    return Ran(os.waitstatus_to_exitcode(status), *got)


