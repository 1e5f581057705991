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
from harness.users import cli_main, user_env

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
                cli_main(pw, args, user_env(d.socket, TERM="xterm"))
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


def says(d: DaemonProc, pw, text: str, code: int, *args: str) -> None:
    """`colo ARGS` as user `pw` says `text` on its terminal and exits with `code`."""
    t = Term(d, pw, *args)
    try:
        t.expect(text)
        assert t.wait() == code
    finally:
        t.close()


def replay(d: DaemonProc, pw, job_id: int) -> bytes:
    """The scrollback an attach gets first (op attach, as the client sends it), as user `pw`."""
    import base64

    from colo import protocol
    from colo.cli.attach import _Conn
    from colo.client import Client
    from harness.daemon import as_user

    def first() -> bytes:
        sock = Client(d.socket).connect(None)
        try:
            sock.sendall(protocol.request("attach", id=job_id))
            conn = _Conn(sock)
            conn.next()  # the job
            ev = conn.next()["event"]
            for fd in conn.fds:
                os.close(fd)
            return base64.b64decode(ev["replay"])
        finally:
            sock.close()

    kind, back = as_user(pw, first)
    assert kind == "ok", back
    return back


def queued_through_a_kill_9(d: DaemonProc, pw, *args: str) -> int:
    """`colo ARGS` (a detached session, with a budget) as user `pw`, queued behind root's job that
    holds the GPU while the daemon is killed with SIGKILL and started again, then placed once that
    job is cancelled: its job id, once it runs detached."""
    blocker = d.client.submit({"argv": ["sleep", "600"], "gpu_mem": "16GiB", "workdir": "/tmp"})["id"]
    try:
        d.wait_state(blocker, "running")
        job = detached_job(d, pw, *args)
        assert d.job(job)["state"] == "queued" and d.job(job)["spec"]["detached"] is True
        d.kill9()
        d.start()
        os.chmod(d.socket.parent, 0o755)
    finally:
        d.client.cancel(blocker)
    started = d.wait_state(job, "running", "failed", "cancelled", timeout=240)
    assert started["state"] == "running", started["reason"]
    wait_for(lambda: job_reason(d, job).endswith("; detached"), 60, "ls to say detached")
    return job


def ends_with(d: DaemonProc, pw, job_id: int, code: int, *seen: str) -> None:
    """`colo attach JOB` as user `pw` shows `seen` (its scrollback), runs a command typed, and
    ends the session with exit `code`: its job fails with it."""
    t = Term(d, pw, "attach", str(job_id))
    try:
        for text in seen:
            t.expect(text)
        t.send("echo typed-$((5*5))")
        t.expect("typed-25")
        t.send(f"exit {code}")
        assert t.wait() == code
    finally:
        t.close()
    assert d.wait_state(job_id, "failed")["exit_code"] == code


def lines(tag: str, n: int) -> str:
    """A shell loop writing n numbered lines of about 50 bytes (TAG-I-of-...)."""
    return f"i=0; while [ $i -lt {n} ]; do echo {tag}-$i-of-an-output-longer-than-the-scrollback; i=$((i+1)); done"


def kept_tail(d: DaemonProc, pw, bound: int, n: int, *args: str) -> int:
    """`colo ARGS -- sh -c ...` (a detached session) as user `pw`, writing `n` numbered lines, more
    than `bound` bytes, then END: once it has all, its scrollback is its last `bound` bytes at most,
    the first lines gone. Its job id (it sleeps on)."""
    job = detached_job(d, pw, *args, "--", "sh", "-c", f"{lines('line', n)}; echo END; exec sleep 600")
    back = wait_for(lambda: b"END" in (b := replay(d, pw, job)) and b, 120, "the whole output in the scrollback")
    assert len(back) <= bound and back.endswith(b"END\r\n"), len(back)
    assert f"line-{n - 1}-".encode() in back and b"line-0-" not in back
    return job


def visit(d: DaemonProc, pw, job_id: int, *typed: tuple[str, str | None], rows: int = 24, cols: int = 80,
          attached=None) -> None:
    """`colo attach JOB` as user `pw`: at its prompt, each (command, what it shows: None, nothing
    waited for) typed and seen, then the detach keys (Ctrl-\\ d), which leave the session running:
    the client exits 0. `attached`: called once it is attached (at its first prompt)."""
    t = Term(d, pw, "attach", str(job_id), rows=rows, cols=cols)
    try:
        t.prompt()
        if attached is not None:
            attached()
        for line, shown in typed:
            t.send(line)
            if shown is not None:
                t.expect(shown)
            t.prompt()
        t.p.send("\x1cd")  # Ctrl-\ d
        t.expect("detached from job")
        assert t.wait() == 0
    finally:
        t.close()
