"""colo shell and colo run (issue 32): a job on a terminal colo made for it, driven through a real
pty as a person types, by real users, against a real root daemon on a simulated GPU.

The client is the real CLI (colo.cli.app) in a child forked onto a pty of its own that drops to
the user's uid (harness.terminal's Term)."""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import threading

import pytest

from colo.client import Client
from colo.node import native
from harness.daemon import DaemonProc, as_user, client_error, gpu_node, local_user, wait_for
from harness.terminal import (PROMPT, SHELL, Term, detached_job, ends_with, job_reason, kept_tail, queued_through_a_kill_9,
                              says, session_job, visit)
from harness.users import Cli


def _root_daemon(n):
    """A root daemon on the node's one simulated 16 GiB GPU, reachable by other users."""
    if os.geteuid() != 0:
        pytest.skip("sessions of real users need a root daemon")
    return n.daemon(home=None)


pytestmark = pytest.mark.node("colo-sessions-", count=1, then=_root_daemon, per="module")


@pytest.fixture(scope="module")
def alice():
    return local_user("colosess1")


@pytest.fixture(scope="module")
def bob():
    return local_user("colosess2")


def _in_the_foreground(pw, command: str) -> None:
    """Until a process of user `pw` running `command` is its terminal's foreground process group
    (a key typed before would reach the shell instead, and flush the line it had not read yet)."""
    def there() -> bool:
        for d in os.listdir("/proc"):
            try:
                if not d.isdigit() or os.stat(f"/proc/{d}").st_uid != pw.pw_uid:
                    continue
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[:-1] != command.encode().split():
                        continue
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if fields[2] == fields[5]:  # pgrp == tpgid
                return True
        return False
    wait_for(there, 60, f"{command} to run in the foreground")


def _interrupt_then_stop(t: Term, pw) -> None:
    """Ctrl-C at a shell's foreground job (a sleep, not the session: the shell says 130), then
    Ctrl-Z at the next (stopped, by the shell's job control: it answers)."""
    t.send("sleep 301")
    _in_the_foreground(pw, "sleep 301")
    t.p.send("\x03")
    t.prompt()
    t.send("echo status=$?")
    t.expect("status=130")
    t.prompt()
    t.send("sleep 302")
    _in_the_foreground(pw, "sleep 302")
    t.p.send("\x1a")
    t.expect("Stopped")
    t.prompt()


def test_a_shell_is_a_job_of_its_user_on_its_own_terminal(node, alice, bob):
    """Its prompt answers, it runs as the user under its budget, its terminal is the user's alone
    (another user can neither open it nor signal the job), and its exit code is the job's."""
    t = Term(node, alice, "shell", "--gpu-mem", "64MiB", *SHELL)
    try:
        t.prompt()
        job = session_job(node, alice)
        assert job["state"] == "running" and job["user"] == alice.pw_name and job["budget"] == 64 << 20
        assert job["spec"]["interactive"] is True and job["spec"]["tty"] is True and job["name"] == "shell"
        t.send("echo job=$COLO_JOB_ID uid=$(id -u) tty=$(tty) owner=$(stat -c %U:%a $(tty))")
        t.expect(r"job=(\d+) uid=(\d+) tty=(\S+) owner=(\S+)\r")
        got = t.p.match.groups()
        assert got[:2] == (str(job["id"]), str(alice.pw_uid))
        tty_path, owner = got[2], got[3]
        assert owner in (f"{alice.pw_name}:620", f"{alice.pw_name}:600")
        t.prompt()
        # held to its budget (the interposer and its ledger): 16 MiB taken, 128 MiB more refused
        burn = native.native_dir() / native.BURN
        t.send(f"{burn} --mem 16MiB --over 128MiB --seconds 0 --quiet; echo burn=$?")
        t.expect(r"burn=(\d+)\r")
        assert t.p.match.group(1) == "0"  # colo-burn: --mem held, --over refused
        t.prompt()
        wait_for(lambda: (node.job(job["id"]).get("refused") or 0) >= 1, 30, "the refusal in the session's ledger")

        def other():
            out = {}
            try:
                os.close(os.open(tty_path, os.O_RDWR | os.O_NOCTTY))
                out["open"] = "opened"
            except OSError as e:
                out["open"] = errno.errorcode[e.errno]
            c = Client(node.socket)
            out["signal"] = client_error(lambda: c.signal(job["id"], signal.SIGINT))
            out["logs"] = client_error(lambda: list(c.logs(job["id"])))
            return out

        kind, out = as_user(bob, other)
        assert kind == "ok", out
        assert out["open"] == "EACCES"
        assert out["signal"][1] == "forbidden" and out["logs"][1] == "forbidden"
        t.send("exit 3")
        assert t.wait() == 3
    finally:
        t.close()
    ended = node.wait_state(job["id"], "failed")
    assert ended["exit_code"] == 3 and "exited with code 3" in ended["reason"]
    hist = node.cli("history", "--json", check=True)
    assert job["id"] in [j["id"] for j in json.loads(hist.stdout)]
    r = node.cli("requeue", str(job["id"]))  # its terminal is gone: a new session is a new `colo shell`
    assert r.returncode == 1 and "start it again with colo shell" in r.stderr


def test_run_prints_the_commands_output_and_exits_with_its_code(node, alice):
    t = Term(node, alice, "run", "--gpus", "0", "--", "sh", "-c", "echo out-$((6*7)); exit 0")
    try:
        t.expect("out-42")
        assert t.wait() == 0
    finally:
        t.close()
    jobs = [j for j in node.client.ls(users=[alice.pw_name]) if j["argv"][0] == "sh"]
    assert jobs and jobs[-1]["state"] == "succeeded" and jobs[-1]["exit_code"] == 0
    t = Term(node, alice, "run", "--gpus", "0", "--", "/no/such/program")  # it ends before it is seen running
    try:
        t.expect("cannot run /no/such/program: No such file")
        assert t.wait() == 127
    finally:
        t.close()


def test_ctrl_c_ctrl_z_and_the_window_size_reach_the_job(node, alice):
    t = Term(node, alice, "shell", *SHELL, rows=30, cols=90)
    try:
        t.prompt()
        t.send("stty size")
        t.expect("30 90")
        t.prompt()
        t.resize(40, 100)
        t.send("stty size")
        t.expect("40 100")
        t.prompt()
        _interrupt_then_stop(t, alice)
        # until bash has reaped it: `exit` with a job it still counts as stopped only warns
        t.send("kill -9 %1; while kill -0 %1 2>/dev/null; do sleep 0.1; done; echo killed")
        t.expect("killed")
        t.prompt()
        job = session_job(node, alice)
        assert job["state"] == "running"
        t.send("exit")
        assert t.wait() == 0
    finally:
        t.close()
    assert node.wait_state(job["id"], "succeeded")["exit_code"] == 0


@pytest.mark.parametrize("sighup", ["default", "ignored", "blocked"])
def test_a_hung_up_client_ends_the_session(node, alice, sighup):
    """Its terminal closes: the client ends as SIGHUP ends it, whatever it inherited for SIGHUP (it
    sees the hang-up on the terminal itself), and the daemon cancels the job."""
    t = Term(node, alice, "shell", *SHELL, sighup=sighup)
    try:
        t.prompt()
        job = session_job(node, alice)
        t.send("sleep 600 & echo started")  # a background job too: it goes with the session
        t.expect("started")
        os.close(t.fd)  # the terminal window closes: the client gets SIGHUP
        assert t.wait() == -signal.SIGHUP
    finally:
        t.close()
    ended = node.wait_state(job["id"], "failed", "cancelled", timeout=60)
    assert ended["state"] in ("failed", "cancelled")
    assert not [j for j in node.client.ls(all=False) if j["uid"] == alice.pw_uid]


def test_a_session_waits_in_the_queue_with_its_reason_then_starts(node, alice, bob):
    """Placed by the same policy as any job: while bob's job holds the GPU, alice's shell waits and
    says why on her terminal; Ctrl-C there gives up (its job is cancelled); once bob's job ends,
    the next shell starts."""
    kind, blocker = as_user(bob, lambda: Client(node.socket).submit(
        {"argv": ["sleep", "600"], "gpu_mem": "16GiB", "workdir": "/tmp"})["id"])
    assert kind == "ok", blocker
    node.wait_state(blocker, "running")
    t = Term(node, alice, "shell", "--gpu-mem", "1GiB", *SHELL)
    try:
        t.expect(r"colo: job (\d+) waits: ")
        first = int(t.p.match.group(1))
        t.p.send("\x03")
        assert t.wait() == 130
    finally:
        t.close()
    assert node.wait_state(first, "cancelled")["reason"].startswith("cancelled by")
    t = Term(node, alice, "shell", "--gpu-mem", "1GiB", *SHELL)
    try:
        t.expect(r"colo: job (\d+) waits: ")
        node.client.cancel(blocker)
        t.expect("started")
        t.prompt()
        t.send("exit 0")
        assert t.wait() == 0
    finally:
        t.close()
        if node.job(blocker)["state"] not in ("cancelled", "succeeded", "failed"):
            node.client.cancel(blocker)


def test_what_a_session_may_not_be(node):
    c = node.client
    for spec, words in (({"argv": ["sh"], "gpus": 0, "array": "0-3"}, "--array"),
                        ({"argv": ["sh"], "gpu_mem": "1GiB", "grow": True}, "--grow"),
                        ({"argv": ["sh"], "gpus": 0, "pipe": True, "detach": True}, "with its client")):
        err = client_error(lambda: list(c.stream("session", spec=spec)))
        assert err is not None and words in err[0] and err[1] == "invalid"
    err = client_error(lambda: c.submit({"argv": ["sh"], "gpus": 0, "tty": True}))
    assert err is not None and err[1] == "forbidden"  # a terminal is the daemon's to give
    err = client_error(lambda: c.submit({"argv": ["sh"], "gpus": 0, "detached": True}))
    assert err is not None and err[1] == "forbidden"  # and to keep
    err = client_error(lambda: c.submit({"argv": ["sh"], "gpus": 0, "pipe": True}))
    assert err is not None and err[1] == "forbidden"  # and to leave out
    err = client_error(lambda: c.submit({"argv": ["sh"], "gpus": 0, "interactive": 1}))
    assert err == ("interactive must be true or false", "invalid")


def test_a_session_outlives_a_daemon_restart(alice):
    """The terminal is the client's, not the daemon's: a restart leaves the shell answering; the
    job is found again and ends with the shell's code; the client says it cannot tell how."""
    if os.geteuid() != 0:
        pytest.skip("sessions of real users need a root daemon")
    root, state, _ = gpu_node("colo-sessions-restart-", count=1)
    d = DaemonProc(root, state).start()
    os.chmod(d.socket.parent, 0o755)
    t = Term(d, alice, "shell", *SHELL)
    try:
        t.prompt()
        job = session_job(d, alice)
        d.proc.send_signal(signal.SIGTERM)  # a restart (colo's unit: KillMode=process)
        d.proc.wait(30)
        d.start()
        os.chmod(d.socket.parent, 0o755)
        t.send("echo still-$((40+2))")
        t.expect("still-42")
        t.prompt()
        assert d.job(job["id"])["state"] == "running"
        t.send("exit 4")
        t.expect("how job")
        assert t.wait() == 1
        assert d.wait_state(job["id"], "failed")["exit_code"] == 4
    finally:
        t.close()
        d.stop()


def test_an_orphaned_session_ends_after_a_daemon_restart(node, alice):
    """`colo run` of a program that ignores SIGHUP; the daemon restarts (its connection is gone);
    then the client is killed: the job's terminal hangs up with no one on it, and the restarted
    daemon, which has no connection to see close, ends the job all the same."""
    t = Term(node, alice, "run", "--gpus", "0", "--", "sh", "-c", "trap '' HUP; echo ready; while :; do sleep 1; done")
    try:
        t.expect("ready")
        job = session_job(node, alice)
        node.proc.send_signal(signal.SIGTERM)  # a restart (colo's unit: KillMode=process)
        node.proc.wait(30)
        node.start()
        os.chmod(node.socket.parent, 0o755)
        assert node.job(job["id"])["state"] == "running"
        os.kill(t.pid, signal.SIGKILL)  # the client goes: the only holder of the job's terminal
        assert t.wait() == -signal.SIGKILL
    finally:
        t.close()
    ended = node.wait_state(job["id"], "cancelled", "failed", "succeeded", timeout=60)
    assert ended["state"] == "cancelled" and "the session's client went away" in ended["reason"], ended


@pytest.mark.docker
def test_a_container_shell_is_the_same_session(node, alice, session_image):
    """colo shell --image: the job is a container of alice's uid on the terminal the engine
    allocated, queued and budgeted as a host session; keys, Ctrl-C, Ctrl-Z and the window size
    reach it, an allocation past its budget is refused inside it (the shell lives on), and its
    exit code is the session's."""
    t = Term(node, alice, "shell", "--image", session_image, "--gpu-mem", "1GiB", "--env", f"PS1={PROMPT}",
             "--", "/bin/sh", "-i", rows=30, cols=90)
    try:
        t.prompt(timeout=240)  # a container's start: seconds, more on a loaded engine
        job = session_job(node, alice)
        assert job["spec"]["image"] == session_image and job["spec"]["tty"] is True and job["budget"] == 1 << 30
        t.send("echo uid=$(id -u) size=$(stty size)")
        t.expect(r"uid=(\d+) size=30 90\r")
        assert t.p.match.group(1) == str(alice.pw_uid)
        t.prompt()
        t.resize(40, 100)
        wait_for(lambda: (t.send("stty size"), t.expect(["40 100", re.escape(PROMPT)]) == 0)[1], 60, "the new size inside")
        t.send("/opt/colo/native/colo-burn --mem 768MiB --over 512MiB --seconds 0 --quiet; echo burn=$?")
        t.expect(r"burn=(\d+)\r")
        assert t.p.match.group(1) == "0"  # colo-burn: --mem held, --over refused, as it expected
        t.prompt()
        wait_for(lambda: (node.job(job["id"]).get("refused") or 0) >= 1, 60, "the refusal in the session's ledger")
        _interrupt_then_stop(t, alice)  # (the container's shell's job control)
        # until dash has reaped it (`wait` returns at once for a stopped job): `exit` while dash
        # still counts a stopped job only says "You have stopped jobs." and the shell lives on (a
        # loaded machine may not have run the killed sleep's exit by the next prompt, or by `jobs`)
        t.send("kill -9 %1; while kill -0 %1 2>/dev/null; do sleep 0.1; done; echo killed")
        t.expect("killed")
        t.prompt()
        t.send("jobs; echo listed")  # (dash forgets the job only once it has said it was killed)
        t.expect("listed")
        t.prompt()
        t.send("exit 7")
        assert t.wait() == 7
    finally:
        t.close()
    ended = node.wait_state(job["id"], "failed")
    assert ended["exit_code"] == 7


def _fed(node, pw, data: bytes, *args: str) -> tuple[bytes, bytes, int]:
    """`colo ARGS` as user `pw` fed `data` from a pipe (written as it is taken): its (stdout, stderr, exit code)."""
    c = Cli(node.socket, pw, *args)
    feeder = threading.Thread(target=c.feed, args=(data,))
    try:
        feeder.start()
        return c.output()
    finally:
        feeder.join()
        c.close()


def test_a_run_fed_from_a_pipe_has_no_terminal(node, alice):
    """`printf 'a\nb\n' | colo run -- sh -c '...'`, as ssh without a terminal: the input reaches
    the job and ends there, stdout comes back exactly (no echo, no \r), stderr apart, and the exit
    code is the client's; the job's stdin, stdout and stderr are pipes of its user's (it opens
    /dev/stdin) and it has no controlling terminal."""
    script = ("cat; echo err >&2; test -p /dev/stdout && test -p /dev/stderr && echo pipes; "
              "tty >/dev/null 2>&1 || echo no-tty; exit 3")
    out, err, code = _fed(node, alice, b"a\nb\n", "run", "--gpus", "0", "--", "sh", "-c", script)
    assert (out, code) == (b"a\nb\npipes\nno-tty\n", 3), (out, err, code)
    assert [ln for ln in err.splitlines() if not ln.startswith(b"colo: ")] == [b"err"], err
    # past the pipes' buffers: it flows as it is taken, to its end
    out, err, code = _fed(node, alice, b"x" * 300_000, "run", "--gpus", "0", "--", "sh", "-c", "cat /dev/stdin")
    assert (len(out), out.strip(b"x"), code) == (300_000, b"", 0), (len(out), err, code)


def test_a_run_fed_from_a_pipe_outlives_a_daemon_restart(node, alice):
    """The pipes are the client's, not the daemon's: after a restart what alice feeds still reaches
    the job and its answers still come back; the end of her input ends the job, with its own code
    on its record (the client, whose connection went with the old daemon, cannot tell it)."""
    c = Cli(node.socket, alice, "run", "--gpus", "0", "--", "sh", "-c",
            'echo ready; while read l; do echo "got $l"; done; exit 5')
    try:
        c.feed(b"", end=False)
        c.read_until(c.stdout, b"ready\n")
        job = session_job(node, alice)
        node.proc.send_signal(signal.SIGTERM)  # a restart (colo's unit: KillMode=process)
        node.proc.wait(30)
        node.start()
        os.chmod(node.socket.parent, 0o755)
        assert node.job(job["id"])["state"] == "running"
        c.feed(b"after\n", end=False)
        c.read_until(c.stdout, b"got after\n")
        c.feed(b"", end=True)
        out, err, code = c.output()
    finally:
        c.close()
    assert code != 0, (out, err)  # the client cannot say the job's code: not a success it did not see
    ended = node.wait_state(job["id"], "cancelled", "failed", "succeeded", timeout=60)
    assert (ended["state"], ended["exit_code"]) == ("failed", 5), ended


@pytest.mark.docker
def test_a_container_run_fed_from_a_pipe_has_no_terminal(node, alice, session_image):
    """`printf 'a\nb\n' | colo run --image IMG -- sh -c '...'`, as `docker run -i`: the input
    reaches the container and ends there, stdout comes back exactly (no echo of the input, no \r),
    stderr apart, and the exit code is the client's."""
    out, err, code = _fed(node, alice, b"a\nb\n", "run", "--image", session_image, "--", "sh", "-c",
                          "cat; echo err >&2; exit 3")
    assert (out, code) == (b"a\nb\n", 3), (out, err, code)
    assert b"err\n" in err and b"a" not in err, err


@pytest.mark.docker
def test_ctrl_c_cancels_a_container_run_fed_from_a_pipe(node, alice, session_image):
    """SIGINT to the client of a piped container session ends it, and its job is cancelled."""
    c = Cli(node.socket, alice, "run", "--image", session_image, "--", "sh", "-c", "echo ready; exec sleep 600")
    try:
        c.feed(b"", end=False)
        c.read_until(c.stdout, b"ready\n")
        job = session_job(node, alice)
        assert job["state"] == "running" and job["spec"]["tty"] is True
        os.kill(c.pid, signal.SIGINT)
        _, err, code = c.output()
    finally:
        c.close()
    assert code == 130 and b"cancelled" in err, (code, err)
    assert node.wait_state(job["id"], "cancelled")["reason"].startswith("cancelled by")


def test_a_detached_session_is_attached_left_and_taken_over_by_its_owner_only(node, alice, bob):
    """colo shell --detach runs on with no client; bob cannot attach; alice attaches (ls says so),
    leaves it with the detach keys, attaches again and sees what it wrote; a second attach takes
    the terminal from the first; the exit code comes to the client attached at the end."""
    job = detached_job(node, alice, "shell", "--detach", *SHELL)
    assert node.wait_state(job, "running")
    wait_for(lambda: job_reason(node, job).endswith("; detached"), 60, "ls to say detached")
    says(node, bob, "only its owner may attach", 1, "attach", str(job))
    def attached():
        assert job_reason(node, job).endswith("; attached")
    visit(node, alice, job, ("echo marker-$((6*7)) size=$(stty size)", "marker-42 size=30 90"), rows=30, cols=90,
          attached=attached)
    wait_for(lambda: job_reason(node, job).endswith("; detached"), 60, "ls to say detached again")
    first = Term(node, alice, "attach", str(job))
    try:
        first.expect("marker-42")  # the scrollback
        first.prompt()
        second = Term(node, alice, "attach", str(job))
        try:
            first.expect("another colo attach took its terminal over")
            assert first.wait() == 0
            second.expect("marker-42")
            second.send("exit 5")
            assert second.wait() == 5
        finally:
            second.close()
    finally:
        first.close()
    assert node.wait_state(job, "failed")["exit_code"] == 5
    kind, err = as_user(alice, lambda: client_error(lambda: list(Client(node.socket).stream("attach", id=job))))
    assert kind == "ok" and err is not None and "has ended" in err[0], err


@pytest.mark.docker
def test_a_detached_container_sessions_scrollback_is_bounded(node, alice, session_image):
    """Its output while no client is attached is kept, the last SCROLLBACK bytes of it only."""
    from colo.daemon.detach import SCROLLBACK

    job = kept_tail(node, alice, SCROLLBACK, 3000, "run", "--detach", "--image", session_image)  # ~170 KiB
    node.client.cancel(job)
    node.wait_state(job, "cancelled")


@pytest.mark.docker
def test_a_detached_container_session_outlives_a_daemon_restart(node, alice, session_image):
    """Its container runs on through a restart (the engine keeps its terminal); the restarted
    daemon takes that terminal again, with what it showed last (the engine's log of it), and its
    owner attaches to it as before."""
    job = detached_job(node, alice, "shell", "--detach", "--image", session_image, "--env", f"PS1={PROMPT}",
                       "--", "/bin/sh", "-i")
    visit(node, alice, job, ("echo before-$((1+1))", "before-2"))
    node.proc.send_signal(signal.SIGTERM)  # a restart (colo's unit: KillMode=process)
    node.proc.wait(30)
    node.start()
    os.chmod(node.socket.parent, 0o755)
    wait_for(lambda: job_reason(node, job).endswith("; detached"), 60, "the restarted daemon to keep its terminal")
    ends_with(node, alice, job, 6, "before-2")  # its last screen, from the engine


@pytest.mark.docker
def test_a_detached_container_session_queued_through_a_kill_9_starts_when_placed(node, alice, session_image):
    """A detached container shell waits in the queue (root's job holds the GPU) while the daemon is
    killed with SIGKILL, the terminal it made with it; the restarted daemon places it once the GPU
    is free, on a terminal made again, and its owner attaches to it and ends it."""
    job = queued_through_a_kill_9(node, alice, "shell", "--detach", "--image", session_image, "--gpu-mem", "1GiB",
                                  "--env", f"PS1={PROMPT}", "--", "/bin/sh", "-i")
    ends_with(node, alice, job, 8)


def test_signal_takes_a_running_jobs_own_signals_only(node):
    c = node.client
    running = c.submit({"argv": ["sleep", "600"], "gpus": 0, "workdir": "/tmp"})["id"]
    queued = c.submit({"argv": ["true"], "gpus": 0, "workdir": "/tmp", "after": [running]})["id"]
    node.wait_state(running, "running")
    assert client_error(lambda: c.signal(queued, signal.SIGINT))[1] == "invalid"  # not running
    assert client_error(lambda: c.signal(running, signal.SIGKILL))[1] == "invalid"  # not one it passes on
    c.signal(running, signal.SIGTERM)  # to its main process, through its shim
    assert node.wait_state(running, "failed")["exit_code"] == 128 + signal.SIGTERM
    node.wait_state(queued, "failed")  # (its dependency failed)
