"""Detached host sessions that outlive their daemon (issue 43): each one's terminal is held by a
holder process of its own (colo/daemon/detach.py), which a restarted daemon finds again. Real
users, real ptys, a real root daemon (killed with SIGKILL and started again) on a simulated GPU;
each test waits on what it means (output seen, a state reached), never on the clock."""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
from pathlib import Path

import psutil
import pytest

from harness.daemon import as_user, wait_for
from harness.terminal import (SHELL, detached_job, ends_with, job_reason, kept_tail, lines, queued_through_a_kill_9, replay,
                              says, visit)

SCROLLBACK = 4 << 10  # this daemon's detach_scrollback (the default is 128 KiB)
MOST = 3  # its max_detached_per_user


def _held_daemon(n):
    """A root daemon on one simulated GPU, reachable by other users, with a small scrollback."""
    if os.geteuid() != 0:
        pytest.skip("sessions of real users need a root daemon")
    return n.daemon({"detach_scrollback": "4KiB", "max_detached_per_user": MOST}, home=None)


# alice and bob: colosess1 and colosess2, test_sessions.py's users
pytestmark = [pytest.mark.node("colo-held-", count=1, then=_held_daemon, per="module"),
              pytest.mark.users(2, prefix="colosess")]


def _sock(d, job: int) -> Path:
    return d.state_dir / "holders" / f"{job}.sock"


def _holder(d, job: int) -> psutil.Process:
    """The process listening on the job's holder socket. That none will is a failure at once, in
    the daemon's words: it said it keeps the terminal itself (no holder could be started) or that
    the holder went away, or the job is no longer running."""
    path = str(_sock(d, job))
    none = re.compile(rf"job {job}: its (terminal's holder could not be started|detached session's terminal holder"
                      r" .*went away)")

    def said() -> list[str]:
        return [ln for ln in d.log.read_text(errors="replace").splitlines() if "holder" in ln or f"job {job}" in ln]

    def find():
        for p in psutil.process_iter(["cmdline"]):
            try:
                if "holder_main" in " ".join(p.info["cmdline"] or ()) and any(
                        c.laddr == path for c in p.net_connections("unix")):
                    return p
            except psutil.Error:
                continue
        state = d.job(job)["state"]
        if state != "running" or any(none.search(ln) for ln in said()):
            pytest.fail(f"job {job} ({state}) has no holder; the daemon said: {said()[-10:]}")
        return None
    try:
        return wait_for(find, 60, "the session's holder")
    except AssertionError as e:  # (timed out)
        raise AssertionError(f"{e}; the daemon said: {said()[-10:]}; in holders/: {os.listdir(_sock(d, job).parent)}")


def _end(d, job: int) -> None:
    d.client.cancel(job)
    d.wait_state(job, "cancelled")
    wait_for(lambda: not _sock(d, job).exists(), 60, "the holder's socket to go with its job")


def test_a_detached_host_session_outlives_a_kill_9_of_its_daemon(node, users):
    """Detach, attach, type; kill -9 the daemon; what the shell writes meanwhile is kept; the
    restarted daemon holds the terminal again; attaching shows the screen from before, and a
    command typed now runs; its exit code ends the job, and the holder goes with it."""
    alice, _ = users
    job = detached_job(node, alice, "shell", "--detach", *SHELL)
    node.wait_state(job, "running")
    wait_for(lambda: job_reason(node, job).endswith("; detached"), 60, "ls to say detached")
    holder = _holder(node, job)
    gate = Path(tempfile.mkdtemp(prefix="colo-held-"))
    os.chown(gate, alice.pw_uid, alice.pw_gid)
    try:
        # and a line written while no daemon runs: once the test says go, then marked done
        visit(node, alice, job, ("echo before-$((1+1))", "before-2"),
              (f"(while [ ! -e {gate}/go ]; do sleep 0.1; done; echo while-down-$((3*3)); touch {gate}/done) &", None))
        node.kill9()
        (gate / "go").touch()
        wait_for(lambda: (gate / "done").exists(), 60, "the shell to write while no daemon runs")
        assert holder.is_running()
        node.start()
        os.chmod(node.socket.parent, 0o755)
        wait_for(lambda: job_reason(node, job).endswith("; detached"), 60, "the restarted daemon to hold its terminal")
        assert _holder(node, job).pid == holder.pid  # the same holder: found again, not a new one
        # the screen from before the restart, and what the shell wrote while no daemon ran
        ends_with(node, alice, job, 6, "before-2", "while-down-9")
    finally:
        shutil.rmtree(gate, ignore_errors=True)
    wait_for(lambda: not holder.is_running(), 60, "the holder to end with its job")
    assert not _sock(node, job).exists()


def test_a_detached_host_session_queued_through_a_kill_9_starts_when_placed(node, users):
    """A detached shell waits in the queue (root's job holds the GPU) while the daemon is killed
    with SIGKILL, its terminal's slave end with it; the restarted daemon places it once the GPU is
    free, on a terminal made again and held, and its owner attaches to it and ends it."""
    alice, _ = users
    job = queued_through_a_kill_9(node, alice, "shell", "--detach", "--gpu-mem", "1GiB", *SHELL)
    holder = _holder(node, job)
    ends_with(node, alice, job, 8)
    wait_for(lambda: not holder.is_running(), 60, "the holder to end with its job")


def test_no_one_but_the_owner_reaches_a_held_session(node, users):
    """Bob cannot attach; neither he nor alice can reach the holder's socket (a root-only folder,
    0600) or signal the holder (root's, in a session of its own, with no controlling terminal);
    and the holder takes no connection of another user's even where the folder lets one in."""
    alice, bob = users
    job = detached_job(node, alice, "shell", "--detach", *SHELL)
    node.wait_state(job, "running")
    holder = _holder(node, job)
    says(node, bob, "only its owner may attach", 1, "attach", str(job))
    path = _sock(node, job)
    folder = os.stat(path.parent)
    assert (folder.st_uid, stat.S_IMODE(folder.st_mode)) == (0, 0o700)
    st = os.lstat(path)
    assert stat.S_ISSOCK(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
    assert holder.uids().real == 0 and holder.uids().effective == 0
    assert os.getsid(holder.pid) == holder.pid and holder.terminal() is None

    def reach():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(str(path))
            return s.recv(4096)
        finally:
            s.close()

    for pw in (alice, bob):
        kind, err = as_user(pw, lambda: _refused(reach))
        assert kind == "ok" and err == "PermissionError", (pw.pw_name, kind, err)
        kind, err = as_user(pw, lambda: _refused(lambda: os.kill(holder.pid, signal.SIGKILL)))
        assert kind == "ok" and err == "PermissionError", (pw.pw_name, kind, err)
    os.chmod(path.parent, 0o711)  # the holder's own check, with the folder's taken away
    os.chmod(path, 0o666)
    try:
        kind, said = as_user(alice, reach)
        assert kind == "ok" and said == b"", said  # closed at once, nothing said
    finally:
        os.chmod(path, 0o600)
        os.chmod(path.parent, 0o700)
    assert job_reason(node, job).endswith("; detached")  # the daemon's own connection is untouched
    _end(node, job)
    wait_for(lambda: not holder.is_running(), 60, "the holder to end with its job")


def _refused(fn):
    try:
        fn()
    except OSError as e:
        return type(e).__name__
    return None


# A session that outlives its terminal's hang-up (a shell would end on it, with its own code): what
# colo must end itself when its holder is gone.
DEAF = ["run", "--detach", "--", "sh", "-c", "trap '' HUP; echo deaf; exec sleep 600"]


def test_a_held_session_whose_holder_is_killed_ends_saying_so(node, users):
    """A session whose terminal's holder is killed is cancelled, and the reason names the holder."""
    alice, _ = users
    job = detached_job(node, alice, *DEAF)
    node.wait_state(job, "running")
    _holder(node, job).kill()
    ended = node.wait_state(job, "cancelled")
    assert "terminal holder went away" in ended["reason"], ended["reason"]
    wait_for(lambda: not _sock(node, job).exists(), 60, "the holder's socket to go")


def test_after_a_restart_a_gone_holder_ends_its_session_and_an_ended_sessions_holder_goes(node, users):
    """While no daemon runs: one session's holder is killed, another session's shell exits. The
    restarted daemon cancels the first, saying why, and tells the second's holder to end (the job
    ended with its own code, found by recovery); neither holder nor socket is left."""
    alice, _ = users
    gate = Path(tempfile.mkdtemp(prefix="colo-held-"))
    os.chown(gate, alice.pw_uid, alice.pw_gid)
    try:
        lost = detached_job(node, alice, *DEAF)
        ends = detached_job(node, alice, "run", "--detach", "--", "sh", "-c",
                            f"while [ ! -e {gate}/go ]; do sleep 0.1; done; exit 3")
        node.wait_state(lost, "running")
        node.wait_state(ends, "running")
        lost_holder, ends_holder = _holder(node, lost), _holder(node, ends)
        node.kill9()
        lost_holder.kill()
        (gate / "go").touch()
        wait_for(lambda: not psutil.pid_exists(lost_holder.pid) or lost_holder.status() == psutil.STATUS_ZOMBIE,
                 60, "the holder to be gone")
        node.start()
        os.chmod(node.socket.parent, 0o755)
    finally:
        shutil.rmtree(gate, ignore_errors=True)
    ended = node.wait_state(lost, "cancelled")
    assert "terminal holder went away while colo was restarting" in ended["reason"], ended["reason"]
    assert node.wait_state(ends, "failed")["exit_code"] == 3
    wait_for(lambda: not ends_holder.is_running(), 60, "the ended session's holder to end")
    wait_for(lambda: not _sock(node, lost).exists() and not _sock(node, ends).exists(), 60, "their sockets to go")


def test_the_detach_keys_of_the_config_take_effect(node, users):
    """detach_scrollback = 4KiB: a held session's scrollback is its last 4 KiB (its holder's);
    max_detached_per_user = 3: a fourth detached session is refused in one line."""
    alice, _ = users
    job = kept_tail(node, alice, SCROLLBACK, 300, "run", "--detach")  # ~15 KiB
    more = [detached_job(node, alice, "shell", "--detach", *SHELL) for _ in range(MOST - 1)]
    says(node, alice, f"you have {MOST} detached sessions, the most allowed", 1, "shell", "--detach", *SHELL)
    for j in (job, *more):
        _end(node, j)


@pytest.mark.docker
def test_queued_detached_sessions_count_toward_the_limit_through_a_kill_9(node, users, session_image):
    """max_detached_per_user = 3, three detached container sessions queued behind root's job that
    holds the GPU: a fourth is refused in one line (exit 1), and still so once the daemon was
    killed with SIGKILL and started again (their terminals went with it: they count as the queued
    jobs they are); the three stay queued, none lost."""
    alice, _ = users
    refused = f"you have {MOST} detached sessions, the most allowed"
    blocker = node.client.submit({"argv": ["sleep", "600"], "gpu_mem": "16GiB", "workdir": "/tmp"})["id"]
    jobs = []
    try:
        node.wait_state(blocker, "running")
        jobs += [detached_job(node, alice, "run", "--detach", "--image", session_image, "--gpu-mem", "1GiB", "--",
                              "sleep", "600") for _ in range(MOST)]
        says(node, alice, refused, 1, "run", "--detach", "--", "true")
        node.kill9()
        node.start()
        os.chmod(node.socket.parent, 0o755)
        says(node, alice, refused, 1, "run", "--detach", "--", "true")
        assert [node.job(j)["state"] for j in jobs] == ["queued"] * MOST
    finally:
        for j in (blocker, *jobs):
            node.client.cancel(j)
            node.wait_state(j, "cancelled")


def test_a_reload_gives_running_sessions_the_new_detach_keys(node, users):
    """SIGHUP with detach_scrollback 4KiB -> 16KiB and max_detached_per_user 3 -> 4: a held session
    that runs already keeps up to 16 KiB of what it writes from then on (its holder was told), and
    a fourth detached session is let in, a fifth refused."""
    alice, _ = users
    gate = Path(tempfile.mkdtemp(prefix="colo-held-"))
    os.chown(gate, alice.pw_uid, alice.pw_gid)
    base = node.config_path.read_text()
    jobs, applied = [], node.log.read_text().count("config reloaded: applied detach_scrollback")
    try:
        jobs.append(detached_job(node, alice, "run", "--detach", "--", "sh", "-c",
                                 f"{lines('first', 300)}; echo MID; while [ ! -e {gate}/go ]; do sleep 0.1; done; "
                                 f"{lines('second', 300)}; echo END; exec sleep 600"))
        back = wait_for(lambda: b"MID" in (b := replay(node, alice, jobs[0])) and b, 120, "the first lines")
        assert len(back) <= SCROLLBACK
        node.config_path.write_text(base.replace('detach_scrollback = "4KiB"', 'detach_scrollback = "16KiB"')
                                    .replace("max_detached_per_user = 3", "max_detached_per_user = 4"))
        node.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "config reloaded: applied detach_scrollback, max_detached_per_user" in node.log.read_text(),
                 120, "the daemon to apply the new keys")
        (gate / "go").touch()
        back = wait_for(lambda: b"END" in (b := replay(node, alice, jobs[0])) and b, 120, "the last lines")
        assert SCROLLBACK < len(back) <= 16 << 10 and back.endswith(b"END\r\n"), len(back)
        assert b"second-0-" in back and b"second-299-" in back
        jobs += [detached_job(node, alice, "shell", "--detach", *SHELL) for _ in range(3)]  # four in all
        says(node, alice, "you have 4 detached sessions, the most allowed", 1, "shell", "--detach", *SHELL)
    finally:
        shutil.rmtree(gate, ignore_errors=True)
        if node.config_path.read_text() != base:
            node.config_path.write_text(base)
            node.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: node.log.read_text().count("config reloaded: applied detach_scrollback") == applied + 2,
                     120, "the daemon to apply the module's keys again")
        for j in jobs:
            _end(node, j)


@pytest.mark.docker
def test_a_reload_gives_running_container_relays_the_new_read_rate(node, users, session_image):
    """detach_read_rate 4KiB, then the default (4MiB) by SIGHUP, while a detached container session
    writes 16 MiB: at the first rate its relay reads a buffer (64 KiB at most) a second, four
    minutes for it all; the reload gives the running relay the new rate, and its last line is in
    the scrollback well within the backstop (two minutes)."""
    alice, _ = users
    base = node.config_path.read_text()

    def reloaded(text: str, n: int) -> None:
        node.config_path.write_text(text)
        node.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: node.log.read_text().count("config reloaded: applied detach_read_rate") == n, 120,
                 "the daemon to apply detach_read_rate")

    applied, job = node.log.read_text().count("config reloaded: applied detach_read_rate"), None
    try:
        reloaded(base + 'detach_read_rate = "4KiB"\n', applied + 1)
        job = detached_job(node, alice, "run", "--detach", "--image", session_image, "--", "sh", "-c",
                           "head -c 16777216 /dev/zero; echo; echo END; exec sleep 600")
        wait_for(lambda: b"\0" in replay(node, alice, job), 120, "the relay to read its first bytes")
        reloaded(base, applied + 2)
        wait_for(lambda: b"END" in replay(node, alice, job), 120, "its last line, at the new rate")
    finally:
        if node.config_path.read_text() != base:
            reloaded(base, applied + 2)
        if job is not None:
            node.client.cancel(job)
            node.wait_state(job, "cancelled")


def test_an_attach_replays_the_last_bytes_of_a_holders_larger_scrollback(tmp_path):
    """A holder that keeps more than the daemon's bound (one whose bound was not made smaller with
    the daemon's): the replay is the last detach_scrollback bytes of what it sent, not the first.
    A real holder process, on a real pty written with more than either bound."""
    from colo.daemon.detach import Terminals

    data = "".join(f"line-{i}-of-an-output-longer-than-the-scrollback\n" for i in range(1000)).encode() + b"END\n"

    def write(fd: int) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    async def replay() -> bytes:
        t = Terminals(scrollback=64 << 10, holders=tmp_path)
        master, slave = os.openpty()
        try:
            t.hold(1, os.getuid(), master)
            await asyncio.to_thread(write, slave)  # (the holder reads it as it comes)
            t.scrollback = 4 << 10  # the daemon's bound now: smaller than its holder's
            for _ in range(1200):  # until the holder has read it all (a take each time: the last one's is let go)
                _, screen, mine, _ = await t.take(1)
                os.close(mine)
                if screen.endswith(b"END\r\n"):
                    break
                await asyncio.sleep(0.05)  # (60 s in all: a backstop only)
            return screen
        finally:
            t.drop(1)
            os.close(slave)

    screen = asyncio.run(replay())
    assert len(screen) == 4 << 10 and b"line-999-" in screen and b"line-0-" not in screen


def test_a_session_detached_before_the_look_for_earlier_holders_keeps_its_own(tmp_path, caplog):
    """The daemon serves requests before it looks for the holders an earlier daemon left: a
    session detached in between has a holder of its own (in `held`), which refuses a second
    connection. The look leaves it be; it took it for a lost holder, cancelled the job and removed
    its socket (seen under load, as the first session of a fresh daemon)."""
    from colo.daemon.detach import Held, Terminals

    async def cancel(job_id: int, by: str) -> None:
        pass

    t = Terminals(holders=tmp_path, cancel=cancel)
    own = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    own.bind(str(tmp_path / "1.sock"))  # (not listening: refuses any connection, as a busy holder does)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        t.held[1] = Held(1, 1000, mine, 0, None)
        asyncio.run(t.recover({1: 1000}))
        assert (tmp_path / "1.sock").exists()
        assert "went away" not in caplog.text
    finally:
        for s in (own, mine, theirs):
            s.close()
