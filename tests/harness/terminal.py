"""A person at a terminal: `colo ARGS` run by the real CLI (colo.cli.app) in a child forked onto a
pty of its own that drops to the user's uid, driven with pexpect (Term); SHELL, the arguments of a
shell whose prompt Term knows; session_job, a user's open session job; detached_job, a detached
session started as a user, and job_reason, what `colo ls` says of a job.

This interpreter's files may be under /root, which other uids cannot execute, so the child runs the
code already loaded rather than exec'ing Python again (test_sessions.py, test_idle_sessions.py)."""
from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import termios

import pytest

import colo.cli.app  # noqa: F401 - loaded here: the forked clients run it without reading /root
import colo.cli.attach  # noqa: F401
from harness.daemon import DaemonProc, wait_for
from harness.users import cli_main

pexpect = pytest.importorskip("pexpect")
from pexpect import fdpexpect  # noqa: E402

PROMPT = "colo-prompt$ "
SHELL = ["--env", f"PS1={PROMPT}", "--", "/bin/bash", "--norc", "--noprofile"]


class Term:
    """`colo ARGS` on a terminal of its own (rows x cols), as user `pw`, driven with pexpect."""

    def __init__(self, d: DaemonProc, pw, *args: str, rows: int = 24, cols: int = 80, sighup: str = "default"):
        pid, fd = pty.fork()
        if pid == 0:  # pragma: no cover - the client
            try:
                if sighup == "ignored":  # as under nohup, or a CI runner that ignores it
                    signal.signal(signal.SIGHUP, signal.SIG_IGN)
                elif sighup == "blocked":  # inherited through fork and exec as the signal mask
                    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            finally:
                cli_main(d.socket, pw, args, env={"TERM": "xterm"})
        self.pid, self.fd, self.status = pid, fd, None
        self.p = fdpexpect.fdspawn(fd, timeout=60, encoding="utf-8", codec_errors="replace")

    def expect(self, pattern, timeout: float = 60):
        return self.p.expect(pattern, timeout=timeout)

    def prompt(self, timeout: float = 60):
        return self.p.expect_exact(PROMPT, timeout=timeout)

    def send(self, line: str) -> None:
        self.p.send(line + "\r")

    def resize(self, rows: int, cols: int) -> None:
        """As a terminal window does: the kernel sends SIGWINCH to the client."""
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def wait(self, timeout: float = 60) -> int:
        """Its exit code."""
        def ended():
            pid, st = os.waitpid(self.pid, os.WNOHANG)
            return (st,) if pid else None
        (st,) = wait_for(ended, timeout, "the client to exit")
        self.status = os.waitstatus_to_exitcode(st)
        return self.status

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def session_job(d: DaemonProc, pw) -> dict:
    """The user's open session job (one at a time in these tests)."""
    def find():
        mine = [j for j in d.client.ls(all=False) if j["uid"] == pw.pw_uid]
        return mine[0] if mine else None
    return d.job(wait_for(find, 30, "the session's job")["id"])


def detached_job(d: DaemonProc, pw, *args: str) -> int:
    """`colo ARGS --detach ...` as user `pw`: the detached session's job id."""
    t = Term(d, pw, *args)
    try:
        t.expect(r"job (\d+): a detached session")
        assert t.wait() == 0
        return int(t.p.match.group(1))
    finally:
        t.close()


def job_reason(d: DaemonProc, job_id: int) -> str:
    return d.job(job_id)["reason"]
