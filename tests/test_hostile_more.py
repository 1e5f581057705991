"""More hostile input, found by a red-team pass (issue: the daemon runs as root for many users).

Each attack is made by a real second Unix user through the daemon's socket; the pure parts are
checked against the simple form they replace.
"""
from __future__ import annotations

import os
import select
import socket
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colo import logtimes, protocol
from colo.client import Client
from colo.daemon import logread
from harness.daemon import client_error, wait_for
from harness.users import Peer, run_as



def _status(pid: int, key: str) -> int:
    """A /proc/PID/status figure in KiB (VmHWM: the peak resident size, VmRSS: now)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


# colo logs --tail/--since/--timestamps: never the whole log in memory -----------------------------
def _old(data: bytes, index, fallback: float, tail, since, stamps: bool):
    """What `logs` sent before logread: the whole log split at once (tail past the line count fixed)."""
    lines = data.splitlines(keepends=True)
    ats = logtimes.stamp(lines, index, fallback)
    keep = [(a, ln) for a, ln in zip(ats, lines) if since is None or a >= since]
    if tail is not None:
        keep = keep[max(0, len(keep) - tail):] if tail else []
    if stamps:
        return [(a, ln.decode(errors="replace")) for a, ln in keep]
    return b"".join(ln for _, ln in keep).decode(errors="replace")


def _new(path: Path, index, fallback: float, tail, since, stamps: bool):
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        start, stop = logread.since_range(fd, size, index, since, fallback) if since is not None else (0, size)
        if tail is not None:
            start = logread.tail_start(fd, start, stop, tail)
        dec = logread.decoder()
        evs = list(logread.pieces(fd, start, stop, index, fallback, stamps, dec))
        rest = dec.decode(b"", final=True)
    finally:
        os.close(fd)
    if not stamps:
        return "".join(e["data"] for e in evs) + rest
    out = []
    for e in evs:
        for at, text in e["lines"]:
            if at is None:  # a piece of a line longer than a read: joined again here
                out[-1] = (out[-1][0], out[-1][1] + text)
            else:
                out.append((at, text))
    if rest:
        out[-1] = (out[-1][0], out[-1][1] + rest)
    return out


@settings(max_examples=int(os.environ.get("LOGREAD_EXAMPLES", 400)), deadline=None, database=None)
@given(data=st.lists(st.sampled_from([b"a", b"bc", b"\n", b"\r", b"\r\n", b"\xe2\x82\xac", b"\xff", b"x" * 40]),
                     max_size=60).map(b"".join),
       cuts=st.lists(st.integers(0, 400), max_size=6), tail=st.none() | st.integers(0, 12),
       since=st.none() | st.integers(0, 8), fallback=st.integers(0, 8), stamps=st.booleans())
def test_logread_sends_what_the_whole_log_split_at_once_gave(tmp_path_factory, data, cuts, tail, since, fallback,
                                                            stamps):
    path = tmp_path_factory.getbasetemp() / "logread-x.log"  # one file, written again for each example
    path.write_bytes(data)
    sizes = sorted({c for c in cuts if c > 0})
    index = (sizes, [float(i + 1) for i in range(len(sizes))])  # noted times grow with the sizes
    old = logread.BLOCK, logread.CHUNK
    logread.BLOCK, logread.CHUNK = 7, 16  # blocks and reads end inside lines, \r\n pairs and characters
    try:
        got = _new(path, index, float(fallback), tail, since, stamps)
    finally:
        logread.BLOCK, logread.CHUNK = old
    assert got == _old(data, index, float(fallback), tail, since, stamps)


def test_tail_of_a_huge_log_does_not_take_the_daemons_memory(shared_daemon, users):
    """A user's job writes 3 MB of empty lines (its cap is 256 MiB by default); the user then asks
    for the last line, in each of the forms that read back. Read whole and split, 3 MB held about
    260 MB of Python objects in the root daemon (8 MB: 700 MB; 256 MiB: more than the node has)."""
    d = shared_daemon
    u = users[0]
    n = 3_000_000
    j = run_as(u, lambda: Client(d.socket).submit(
        {"argv": ["sh", "-c", f"head -c {n} /dev/zero | tr '\\0' '\\n'; printf 'last line\\n'"], "gpus": 0})["id"])
    d.wait_state(j, "succeeded", timeout=120)
    assert os.path.getsize(d.state_dir / "logs" / f"{j}.log") == n + 10
    base = _status(d.proc.pid, "VmRSS")

    def ask():
        c = Client(d.socket, timeout=300)
        return ("".join(c.logs(j, tail=1)), list(c.log_lines(j, tail=2, since=0)),
                "".join(c.logs(j, tail=3, since=0)))

    plain, stamped, since = run_as(u, ask)
    assert plain == "last line\n" and since == "\n\nlast line\n"
    assert [t for _, t in stamped] == ["\n", "last line\n"] and all(a is not None for a, _ in stamped)
    grew = _status(d.proc.pid, "VmHWM") - base
    assert grew < 64 * 1024, f"the daemon's peak grew by {grew} KiB for a {n >> 20} MiB log"
    assert "".join(Client(d.socket).logs(j)).endswith("\n\nlast line\n")  # the whole log still streams


# clients that ask and never read ------------------------------------------------------------------
def _ask_and_never_read(sock: str, gate: str, ready: str, done: str, conns: int) -> tuple:
    """As the attacker: 100 queued jobs with 60 KB commands (an `ls` of them is ~6 MB), then `conns`
    connections that each ask for `ls` and read nothing, held open until `done` exists."""
    import time

    c = Client(Path(sock))
    first = c.submit({"argv": ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.1; done"], "gpus": 0})["id"]
    c.submit({"argv": ["true", "x" * 60000], "gpus": 0, "after": [first], "array": "0-98"})
    held = []
    for _ in range(conns):
        s = socket.socket(socket.AF_UNIX)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(sock)
        s.sendall(protocol.request("ls"))
        select.select([s], [], [], 120)  # answered (in part): the next one is asked after it
        held.append(s)
    Path(ready).touch()
    while not os.path.exists(done):
        time.sleep(0.05)
    last = b""  # the last one asked: its whole answer
    held[-1].settimeout(60)
    while chunk := held[-1].recv(1 << 20):
        last += chunk
    for s in held:
        s.close()
    after = len(Client(Path(sock)).ls())  # with the connections gone, the user is answered again
    return protocol.loads(last.splitlines()[0]), after


def test_clients_that_never_read_cannot_take_the_daemons_memory(shared_daemon, users):
    """Each unread reply was held by the daemon for as long as its connection stayed open: 60
    connections asking for a 6 MB `ls` took 360 MB of the root daemon's memory, and a few hundred
    would take the node's. Now a user's unread replies are bounded (server.MAX_UNREAD, 64 MiB): past
    it their next requests are refused with one line, and every other user is answered as before."""
    d = shared_daemon
    talk = d.root / "talk"  # the attacker's: it says when its connections are open
    talk.mkdir()
    os.chown(talk, users[0].pw_uid, users[0].pw_gid)
    gate, ready, done = (talk / n for n in ("gate", "ready", "done"))
    base = _status(d.proc.pid, "VmRSS")
    attacker = Peer(users[0], lambda: _ask_and_never_read(str(d.socket), str(gate), str(ready),
                                                                      str(done), 60))
    attacker.go()
    try:
        wait_for(lambda: ready.exists() or select.select([attacker._res_r], [], [], 0)[0], 240,
                 "the attacker's connections")  # (or its early end, said below)
        assert ready.exists(), attacker.result()
        grew = _status(d.proc.pid, "VmRSS") - base
        others = run_as(users[1], lambda: len(Client(d.socket).ls()))  # answered while they are held
        assert others == 100 and len(d.client.ls()) == 100
    finally:
        done.touch()
        gate.touch()
    last, after = attacker.result()
    print(f"daemon grew by {grew} KiB while 60 connections left their `ls` unread")
    assert grew < 160 * 1024, f"the daemon grew by {grew} KiB holding unread replies"
    assert last["ok"] is False and last["code"] == protocol.UNAVAILABLE, str(last)[:200]
    assert "still unread" in last["error"], last
    assert after == 100


# what NVIDIA's container runtime reads: colo's to say -------------------------------------------
@pytest.fixture
def cuda_like_image(docker_client, test_image):
    """The test image with what CUDA images say in their ENV (nvidia/cuda: NVIDIA_VISIBLE_DEVICES=all)."""
    c = docker_client.containers.create(test_image, ["true"])
    tag = "colo-test/cuda-like:1"
    try:
        c.commit("colo-test/cuda-like", "1", changes=["ENV NVIDIA_VISIBLE_DEVICES=all",
                                                      "ENV NVIDIA_MIG_MONITOR_DEVICES=all"])
    finally:
        c.remove(force=True)
    yield tag
    docker_client.images.remove(tag, force=True)


def test_a_cpu_only_container_job_is_given_no_gpu_by_the_images_env(shared_daemon, users, cuda_like_image):
    """On an engine whose default runtime is NVIDIA's (nvidia-ctk --set-as-default), its hook gives a
    container the GPUs that NVIDIA_VISIBLE_DEVICES names, from the image's ENV when the job does not
    say: a `--gpus 0` job of a CUDA image got every GPU, outside any budget or ledger. colo now says
    it for every container job ("void": nothing; a GPU job: its own GPUs), and a job may not set the
    hook's other device variables (this engine has no NVIDIA runtime: the container's environment,
    which the hook reads, is what is checked)."""
    d = shared_daemon
    show = ["sh", "-c", "echo NV=$NVIDIA_VISIBLE_DEVICES"]
    cpu = run_as(users[0], lambda: Client(d.socket).submit({"argv": show, "gpus": 0, "image": cuda_like_image})["id"])
    gpu = run_as(users[0], lambda: Client(d.socket).submit(
        {"argv": show, "gpus": 1, "gpu_mem": "64MiB", "image": cuda_like_image})["id"])
    assert d.wait_state(cpu, "succeeded", timeout=120) and d.wait_state(gpu, "succeeded", timeout=120)
    assert "".join(d.client.logs(cpu)) == "NV=void\n"
    assert "".join(d.client.logs(gpu)) == f"NV={','.join(d.job(gpu)['gpus'])}\n"
    for k in ("NVIDIA_MIG_MONITOR_DEVICES", "NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_IMEX_CHANNELS", "NVIDIA_GDS"):
        try:
            run_as(users[0], lambda k=k: Client(d.socket).submit({"argv": ["true"], "gpus": 0, "env": {k: "all"}}))
        except RuntimeError as e:  # the peer's ClientError, as Peer.result says it
            assert "ClientError" in str(e) and f"{k} is set by colo itself" in str(e), e
        else:
            raise AssertionError(f"{k} accepted")
    ok = run_as(users[0], lambda: Client(d.socket).submit(  # the job's own NVIDIA_ settings stay its own
        {"argv": ["sh", "-c", "echo $NVIDIA_TF32_OVERRIDE"], "gpus": 0, "env": {"NVIDIA_TF32_OVERRIDE": "0"}})["id"])
    assert d.wait_state(ok, "succeeded") and "".join(d.client.logs(ok)) == "0\n"


# mount targets are read as Docker reads them ----------------------------------------------------
def test_mount_target_over_colos_own_files_is_refused_however_spelt(shared_daemon, users):
    """colo's own files sit under /opt/colo in a container (the interposer, the job's ledger, the MPS
    pipe): a job may not mount over them. Docker cleans the target, so `/opt//colo/run` (which the
    check took as it was written) is /opt/colo/run."""
    d = shared_daemon
    src = d.root / "src"  # the user's own folder: readable, so only the target can be refused
    src.mkdir()
    os.chown(src, users[0].pw_uid, users[0].pw_gid)
    for target in ("/opt//colo/run", "/opt/./colo/native/libcolo_interpose.so", "/opt/colo/.", "//opt/colo",
                   "/./opt/colo/mps", "/.", "//"):
        spec = {"argv": ["true"], "gpus": 1, "gpu_mem": "64MiB", "image": "colo-none:never",
                "mounts": [f"{src}:{target}"]}
        err = run_as(users[0], lambda spec=spec: client_error(lambda: Client(d.socket).submit(spec)))
        assert err is not None and err[1] == "forbidden" and "is not allowed" in err[0], (target, err)
    assert d.client.ls() == []


