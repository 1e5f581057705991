"""The `colo` command's short path (colo/cli/entry.py: no typer, and an exit without the
interpreter's teardown) answers as the full typer command does: the same stdout, stderr and exit
code, on a real daemon on simulated GPUs."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from colo.cli.argv import parse
from colo.cli.options import BY_NAME


def _typer(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colo.cli.app", *args], capture_output=True, text=True,
                          env=daemon.env(), timeout=60)


def _no_age(out: str) -> list[list[str]]:
    """A table's cells, less the AGE column (whole seconds since submission: the second may turn
    between the two commands)."""
    rows = [re.split(r"\s{2,}", ln) for ln in out.splitlines()]
    if not rows or "AGE" not in rows[0]:
        return rows
    i = rows[0].index("AGE")
    return [r[:i] + r[i + 1:] for r in rows]


def test_the_short_path_and_the_typer_command_answer_alike(daemon):
    done = daemon.submit("--process", "--gpus", "0", "--name", "done", "--", "sh", "-c", "echo hi; exit 3")
    daemon.wait_state(done, "failed")
    held = daemon.submit("--hold", "--process", "--gpus", "0", "--name", "held", "--", "true")
    daemon.submit("--process", "--gpu-mem", "1GiB", "--after", "held", "--name", "next", "--", "true")
    daemon.submit("--hold", "--process", "--gpus", "0", "--array", "0-3", "--name", "sweep", "--", "true")
    cases = [
        ["ls"], ["ls", "--json"], ["ls", "-a"], ["ls", "-a", "--json"], ["ls", "-r", "-n", "sweep"],
        ["ls", "-s", "bogus"],  # refused: one line on stderr
        ["show", str(done)], ["show", "held", "--json"], ["logs", str(done)], ["wait", str(done)],
        ["cancel", "99999"],  # no such job
        ["submit", "--process", "--gpu-mem", "12XB", "--", "true"],  # a malformed size
    ]
    outs = []
    for args in cases:
        assert parse(BY_NAME[args[0]], args[1:]) is not None, f"{args}: not the short path"  # (what entry.main asks)
        short, full = daemon.cli(*args), _typer(daemon, *args)
        assert short.returncode == full.returncode, (args, short, full)
        assert short.stderr == full.stderr, (args, short.stderr, full.stderr)
        assert _no_age(short.stdout) == _no_age(full.stdout), (args, short.stdout, full.stdout)
        assert short.stdout.count("\n") == full.stdout.count("\n") and short.stdout[-1:] == full.stdout[-1:]
        outs.append(short)
    assert all(r.stdout for r in outs[:5]) and all(r.returncode for r in outs[5:6] + outs[9:])  # (not all empty)
    assert outs[9].returncode == 3 and outs[8].stdout == "hi\n"  # wait: the job's exit code; logs: its output
    assert daemon.job(held)["state"] == "queued"  # nothing above changed a job


def test_the_quick_exit_leaves_an_atexit_hook_and_a_thread_their_exit(tmp_path):
    """entry.end skips the interpreter's teardown (here: an object's __del__ left for it) only where
    nothing waits for the exit: an atexit hook runs, a thread still going ends, as they would."""
    env = {**os.environ, "COLO_SOCKET": str(tmp_path / "none.sock")}
    head = ("import sys\nsys.argv = ['colo', 'ls']\n"
            "class Left:\n    def __del__(self):\n        print('teardown')\nleft = Left()\n")
    run = "from colo.cli.entry import command\ncommand()\n"
    hook = "import atexit\natexit.register(lambda: print('hook ran'))\n"
    # (it waits for the main thread's end, which only the usual exit marks)
    thread = "import threading\nthreading.Thread(target=lambda: (threading.main_thread().join(), print('thread ended'))).start()\n"
    for probe, said in (("", ""), (hook, "hook ran\nteardown\n"), (thread, "thread ended\nteardown\n")):
        r = subprocess.run([sys.executable, "-c", head + probe + run], capture_output=True, text=True, env=env,
                           timeout=60)
        assert r.returncode == 1 and "colo daemon is not running" in r.stderr, r
        assert r.stdout == said, (probe, r.stdout)
