"""What one user's clients and jobs can take from everyone else (issue 48, issue 52 items 1 and 4),
tried as real users against one daemon for the module: connections held past the per-user limit
from several processes, idle and half-sent requests, a client sending a byte a second, streams past
the per-user limit, a fork bomb in a job, --on-end under its job's limits."""
from __future__ import annotations

import os
import select
import shutil
import socket
import time
from pathlib import Path

import pytest

from colo import protocol
from colo.client import Client
from harness.daemon import DaemonProc, wait_for
from harness.probes import rss_kib
from harness.users import ensure_users, Peer, run_as, shared_root


CONNS, STREAMS, TASKS = 16, 6, 64  # this daemon's limits: small, so that the attacks are quick


@pytest.fixture(scope="module")
def limited():
    """The module's root daemon, its per-user limits small (CONNS, STREAMS, TASKS), its socket
    other users' to reach."""
    if os.geteuid() != 0:
        pytest.skip("needs root: other users, cgroups")
    root = shared_root("colo-flood-")
    d = DaemonProc(root, config={"max_connections_per_user": CONNS, "max_streams_per_user": STREAMS,
                                 "job_tasks": TASKS, "max_job_tasks": 200}).start()
    os.chmod(d.socket.parent, 0o755)
    yield d
    d.stop()
    shutil.rmtree(root, ignore_errors=True)


def _log_size(d: DaemonProc) -> int:
    return d.log.stat().st_size


def _hold(sock: str, n: int, ready: str, done: str) -> tuple[int, int, int]:
    """n connections that send nothing, held until `done` exists: (how many were told the limit,
    how many the daemon closed without a word (idle too long), how many it left open)."""
    kept = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        kept.append(s)
    Path(ready + str(os.getpid())).touch()
    while not os.path.exists(done):
        time.sleep(0.05)
    told, closed, live = 0, 0, list(kept)
    deadline = time.monotonic() + 120
    while live and time.monotonic() < deadline:  # each one ends: refused at once, or closed as idle
        for s in select.select(live, [], [], 1)[0]:
            data = s.recv(4096)
            told += bool(data)  # (one line: the limit it met)
            closed += not data
            live.remove(s)
    for s in kept:
        s.close()
    return told, closed, len(live)


def test_a_user_holding_connections_past_the_limit_locks_no_one_out(limited, users):
    """Four processes of one user each open 40 connections and hold them: the daemon keeps at most
    CONNS of them open, tells the rest so in one line and closes them at once, and closes the kept
    ones as idle; meanwhile another user submits, lists and cancels, root lists, and the log grows
    by a few lines (logflood: 10 a minute from one place, then counted)."""
    d = limited
    talk = d.root / "talk-conns"
    talk.mkdir()
    os.chown(talk, users[0].pw_uid, users[0].pw_gid)
    ready, done = str(talk / "ready-"), str(talk / "done")
    fds = lambda: len(os.listdir(f"/proc/{d.proc.pid}/fd"))  # noqa: E731
    log0, fd0 = _log_size(d), fds()
    peers = [Peer(users[0], lambda: _hold(str(d.socket), 40, ready, done)) for _ in range(4)]
    for p in peers:
        p.go()
    try:
        wait_for(lambda: len(list(talk.glob("ready-*"))) == 4, 120, "the attacker's connections")
        # once the daemon has taken them from its backlog, it holds CONNS of them (4: its own, e.g. pipes)
        wait_for(lambda: fds() <= fd0 + CONNS + 4, 60, f"the daemon to hold at most {CONNS} of them")

        def work():
            c = Client(d.socket)
            j = c.submit({"argv": ["sleep", "60"], "gpus": 0, "workdir": "/tmp"})["id"]
            seen = [r["id"] for r in c.ls()]
            c.cancel(j)
            return j, seen
        j, seen = run_as(users[1], work)
        assert j in seen
        assert any(r["id"] == j for r in d.client.ls())
        d.wait_state(j, "cancelled")
    finally:
        Path(done).touch()
    results = [p.result() for p in peers]
    told, closed, left = (sum(r[k] for r in results) for k in range(3))
    assert left == 0 and told + closed == 160 and told >= 160 - 4 * CONNS, results
    text = d.log.read_text()[log0:]
    assert text.count("max_connections_per_user") <= 2 * 10 + 2, text[-3000:]
    assert _log_size(d) - log0 < 16 << 10
    assert "Traceback" not in text


def _slow(sock: str, flag: str) -> bytes:
    """A hello sent a byte a second; says when it is under way; what the daemon answered."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.settimeout(120)
    req = protocol.request("hello")
    try:
        for k, b in enumerate(req):
            s.send(bytes([b]))
            if k == 2:
                Path(flag).touch()
            time.sleep(1)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        return s.recv(4096)
    finally:
        s.close()


def test_a_client_sending_a_byte_a_second_holds_no_one_up(limited, users):
    """While one user's request trickles in a byte a second, another user's requests are answered
    (the daemon reads everyone as their bytes come); the slow one is closed after REQUEST_TIMEOUT
    (15 s) unanswered, the whole request not having come."""
    d = limited
    talk = d.root / "talk-slow"
    talk.mkdir()
    os.chown(talk, users[0].pw_uid, users[0].pw_gid)
    flag = talk / "under-way"
    slow = Peer(users[0], lambda: _slow(str(d.socket), str(flag)))
    slow.go()
    wait_for(flag.exists, 60, "the slow request to be under way")

    def work():
        c = Client(d.socket)
        j = c.submit({"argv": ["true"], "gpus": 0, "workdir": "/tmp"})["id"]
        return c.wait([j])[0]["state"], len(c.ls())
    state, _ = run_as(users[1], work)
    assert state == "succeeded"
    assert slow.result() == b""  # closed by the daemon before its request was whole


def _half_sent(sock: str, n: int, size: int, done: str) -> tuple[int, list[str]]:
    """n connections each sending `size` bytes of a submit without its end, held until `done`
    exists: how many the daemon took, and what it said to the ones it refused."""
    conns, said = [], []
    head = b'{"v":1,"op":"submit","args":{"spec":{"argv":["'
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        s.settimeout(60)
        try:
            s.sendall(head + b"x" * (size - len(head)))
            conns.append(s)
        except (BrokenPipeError, ConnectionResetError):
            said.append(s.recv(4096).decode(errors="replace"))
            s.close()
    Path(done + ".ready").touch()
    while not os.path.exists(done):
        time.sleep(0.05)
    return len(conns), said


def test_half_sent_requests_are_bounded_per_user(limited, users):
    """One user's connections each send 1 MiB of a submit and never its end: the daemon keeps at
    most MAX_PENDING (8 MiB) of them for the user and refuses the rest with one line. An `ls`
    longer than a small op's 128 KiB is refused too. (The memory given back: bench/flood_bench.py.)"""
    d = limited
    from colo.daemon import server

    talk = d.root / "talk-half"
    talk.mkdir()
    os.chown(talk, users[0].pw_uid, users[0].pw_gid)
    done = talk / "done"
    base = rss_kib(d.proc.pid)
    p = Peer(users[0], lambda: _half_sent(str(d.socket), 12, 1 << 20, str(done)))
    p.go()
    try:
        wait_for(lambda: Path(str(done) + ".ready").exists(), 120, "the half-sent requests")
        grew = rss_kib(d.proc.pid) - base
    finally:
        done.touch()
    taken, said = p.result()
    assert taken <= server.MAX_PENDING >> 20 and said, (taken, said)
    assert all("unfinished requests" in s for s in said), said
    assert grew < 48 << 10, grew
    big = b'{"v":1,"op":"ls",' + b" " * (150 << 10) + b'"args":{}}\n'  # (JSON, padded: no ls is this long)
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(d.socket))
    s.settimeout(60)
    try:
        s.sendall(big)
    except (BrokenPipeError, ConnectionResetError):
        pass
    reply = protocol.loads(s.recv(4096).splitlines()[0])
    s.close()
    assert reply["ok"] is False and "larger than 131072" in reply["error"], reply


def _streams(sock: str, job: int, n: int) -> tuple[list[str], int]:
    """n waits on a running job held open, then an ls: what the refused ones were told, how many rows."""
    held, told = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock)
        s.settimeout(60)
        s.sendall(protocol.request("wait", ids=[job]))
        line = b""
        while not line.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            line += chunk
        msg = protocol.loads(line)
        if msg.get("ok") is False:
            told.append(msg["error"])
            s.close()
        else:
            held.append(s)
    rows = len(Client(Path(sock)).ls())  # the user can still ask while at the stream limit
    for s in held:
        s.close()
    return told, rows


def test_streams_per_user_are_bounded_and_end_with_their_client(limited, users):
    d = limited
    gate = d.root / "gate-streams"
    j = run_as(users[0], lambda: Client(d.socket).submit(
        {"argv": ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.1; done"], "gpus": 0, "workdir": "/tmp"})["id"])
    d.wait_state(j, "running")
    try:
        told, rows = run_as(users[0], lambda: _streams(str(d.socket), j, STREAMS + 3))
        assert len(told) == 3 and all("max_streams_per_user" in t for t in told), told
        assert rows >= 1
        # their clients gone, the waits end: the user has all of them again
        told, _ = run_as(users[0], lambda: _streams(str(d.socket), j, STREAMS))
        assert told == []
    finally:
        gate.touch()
    d.wait_state(j, "succeeded")


def _has_pids(d: DaemonProc) -> bool:
    """Whether this daemon's jobs get a pids.max here (the pids controller in v1, or in v2 below it)."""
    instance = (d.state_dir / "instance").read_text().strip()
    for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        for found in base.rglob(f"colo-{instance}") if base.is_dir() else ():
            ctl = found / "cgroup.subtree_control"
            if base.name == "pids" or (ctl.exists() and "pids" in ctl.read_text().split()):
                return True
    return False


def test_a_fork_bomb_fails_inside_its_own_job(limited, users):
    """A job that forks without end meets its own pids.max (job_tasks, here 64): its forks fail
    there, while another user's job that forks 30 runs to its end; an --on-end command runs in a
    leaf of its own under the job's limits, not in the daemon's cgroup."""
    d = limited
    import psutil

    bomb = "(while :; do sleep 120 & done) 2>/dev/null; echo full; exec sleep 120"
    b = run_as(users[0], lambda: Client(d.socket).submit(
        {"argv": ["sh", "-c", bomb], "gpus": 0, "workdir": "/tmp",
         # written aside, then renamed: the name appears only once its text is whole (the shell
         # creates a redirect's file before cat writes it; a busy machine showed the gap)
         "on_end": "cat /proc/self/cgroup > /tmp/colo-flood-onend-$COLO_JOB_ID.part && "
                   "mv /tmp/colo-flood-onend-$COLO_JOB_ID.part /tmp/colo-flood-onend-$COLO_JOB_ID"})["id"])
    d.wait_state(b, "running")
    if not _has_pids(d):
        d.client.cancel(b)
        pytest.skip("no pids cgroup controller here")
    wait_for(lambda: "full" in "".join(d.client.logs(b)), 120, "the bomb to meet its bound")
    sleeps = [p for p in psutil.process_iter(["uids", "cmdline"])
              if p.info["uids"] and p.info["uids"].real == users[0].pw_uid and p.info["cmdline"] == ["sleep", "120"]]
    print(f"the bomb holds {len(sleeps)} sleeps")
    assert 0 < len(sleeps) <= TASKS, len(sleeps)
    ok = run_as(users[1], lambda: Client(d.socket).submit(
        {"argv": ["sh", "-c", "for i in $(seq 30); do sleep 1 & done; wait; echo all"], "gpus": 0,
         "workdir": "/tmp"})["id"])
    assert d.wait_state(ok, "succeeded", timeout=120)
    assert "all" in "".join(d.client.logs(ok))
    d.client.cancel(b)
    d.wait_state(b, "cancelled", timeout=60)
    out = Path(f"/tmp/colo-flood-onend-{b}")
    wait_for(out.exists, 120, "the --on-end command")
    text = out.read_text()
    out.unlink()
    assert f"onend-{b}-" in text, text


def test_tasks_option_is_checked_and_capped(limited, users):
    d = limited
    spec = {"argv": ["true"], "gpus": 0, "workdir": "/tmp"}
    from harness.daemon import client_error

    err = run_as(users[0], lambda: client_error(lambda: Client(d.socket).submit({**spec, "tasks": 500})))
    assert err is not None and "max_job_tasks" in err[0], err
    err = run_as(users[0], lambda: client_error(lambda: Client(d.socket).submit({**spec, "tasks": 0})))
    assert err is not None and "--tasks must be" in err[0], err
    j = d.client.submit({**spec, "tasks": 500})["id"]  # root may ask for more
    d.wait_state(j, "succeeded")
    r = d.cli("submit", "--process", "--gpus", "0", "--tasks", "0", "--", "true")  # the option, through the CLI
    assert r.returncode != 0 and "--tasks must be" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_the_daemon_stays_reachable_at_its_descriptor_limit(limited, users):
    """With the daemon's descriptor limit lowered to 360 (prlimit), four users holding connections
    get at most the limit less the share kept for root and admins, and root is answered; root's
    own flood then meets EMFILE: the daemon says so a few times (not once per attempt) and serves
    everyone again once it ends."""
    d = limited
    import resource

    from colo.daemon import server

    users4 = ensure_users(4)
    soft, hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)
    fds = lambda: len(os.listdir(f"/proc/{d.proc.pid}/fd"))  # noqa: E731
    limit = 360
    room = limit - server.RESERVED_FDS - 64  # 40: less than the 4 x CONNS asked for
    talk = d.root / "talk-fds"
    talk.mkdir(mode=0o777)
    os.chmod(talk, 0o777)
    ready, done = str(talk / "ready-"), str(talk / "done")
    log0 = _log_size(d)
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (limit, hard))
    flood = []
    try:
        base = fds()
        peers = [Peer(u, lambda: _hold(str(d.socket), CONNS, ready, done)) for u in users4]
        for p in peers:
            p.go()
        wait_for(lambda: len(list(talk.glob("ready-*"))) == 4, 120, "the users' connections")
        wait_for(lambda: fds() <= base + room + 4, 60, f"the daemon to hold at most {room} of theirs")
        assert d.client.hello()["uid"] == 0  # root: from the share kept for it
        Path(done).touch()
        results = [p.result() for p in peers]
        assert sum(r[0] for r in results) >= 4 * CONNS - room, results  # told, at once
        text = d.log.read_text()[log0:]
        assert "near the daemon's descriptor limit" in text
        # root's own flood, past the limit
        for _ in range(limit + 40):
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect(str(d.socket))
            except BlockingIOError:  # the backlog is full: the daemon accepts no more now
                s.close()
                break
            flood.append(s)
        wait_for(lambda: "out of descriptors" in d.log.read_text()[log0:], 60, "the daemon to meet EMFILE")
    finally:
        for s in flood:
            s.close()
        Path(done).touch()
        resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert run_as(users[1], lambda: len(Client(d.socket, timeout=60).ls())) >= 0
    text = d.log.read_text()[log0:]
    print(f"EMFILE said {text.count('out of descriptors')} times")
    assert text.count("out of descriptors") <= 2 * 10 + 2, text[-3000:]
    assert "Traceback" not in text
