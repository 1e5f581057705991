"""Only the job's own user may reach colo's MPS control daemon (docs/mps.md "Who may reach the
daemon"). Whoever reaches its control socket can `quit` it (the MPS server under every MPS job on
that GPU goes with it), `terminate_client` any client, or attach outside colo's accounting. A real
daemon on the simulated driver; the users are real Unix users, forked children that setuid() to
them, the way an attacker on a shared server would come.
"""
from __future__ import annotations

import os
import pickle
import shutil
import socket
from pathlib import Path

import pytest

from colo.node import fakegpu, mps
from harness.daemon import DaemonProc, wait_for
from harness.node import SimNode
from harness.users import run_as


def _daemon_and_gates(n: SimNode):
    (n.root / "gates").mkdir(mode=0o777)
    os.chmod(n.root / "gates", 0o777)
    return n.daemon({"profile_dirs": [str(n.prof)], "mps_idle_stop": 600.0}), n.state, n.root / "gates"


pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users"),
              pytest.mark.users(2, prefix="colompsp", root=False),  # alice runs MPS jobs, mallory attacks
              # a light job, known to run under MPS alone (no profile: it would run time-sliced)
              pytest.mark.node("colo-mpsp-", profiles={"light": dict(sm=0.3, mem=256 << 20, membw=0.2, runtime=4.0)},
                               then=_daemon_and_gates)]


def pipe_dir(d: DaemonProc) -> Path:
    [p] = (d.state_dir / "mps").glob("*/pipe")
    return p


def mps_job(d: DaemonProc, pw, gate: Path) -> int:
    """An MPS job of `pw` (a real CUDA client on the simulated driver) that runs until `gate` exists."""
    burn = str(next(d.state_dir.glob("native-*")) / "colo-burn")
    spec = {"argv": ["sh", "-c", f"{burn} --mem 256MiB --seconds 600 --quiet & b=$!; "
                     f"while [ ! -e {gate} ]; do sleep 0.05; done; kill $b; wait $b; exit 0"],
            "gpu_mem": 1 << 30, "workdir": "/tmp", "profile": "light"}
    from colo.client import Client
    job_id = run_as(pw, lambda: Client(d.socket).submit(spec)["id"])
    assert d.wait_state(job_id, "running", timeout=60)["mode"] == "mps"
    return job_id


def clients_of(state: Path, uid: int) -> list[int]:
    """Pids of MPS clients of this uid attached on the simulated GPU (they reached a server)."""
    out = []
    for p in fakegpu.FakeNode(state).read()["devices"][0]["processes"]:
        if p["kind"] == "mps_client":
            try:
                if os.stat(f"/proc/{p['pid']}").st_uid == uid:
                    out.append(p["pid"])
            except FileNotFoundError:
                pass
    return out


def reach(pw, pipe: Path) -> str:
    """As user `pw`: connect to the control daemon's socket. "ok" or the error's name."""
    def go():
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(pipe / "control"))
            return "ok"
        except OSError as e:
            return type(e).__name__
        finally:
            s.close()
    return run_as(pw, go)


def send_quit(pw, pipe: Path, control: Path) -> tuple[int, str]:
    """As user `pw`: `echo quit | nvidia-cuda-mps-control`, as anyone on the node can type it."""
    import subprocess

    def go():
        r = subprocess.run([str(control)], input="quit\n", capture_output=True, text=True, timeout=20,
                           env={"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(pipe)})
        return r.returncode, r.stderr.strip()
    return run_as(pw, go)


class Holder:
    """A process of `pw` outside any job that connects to the control socket and keeps the
    connection; on `quit()` it sends `quit` down it and says whether the daemon read it."""

    def __init__(self, pw, pipe: Path):
        r1, self._w = os.pipe()
        self._r, w2 = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - child
            try:
                os.close(self._w)
                os.close(self._r)
                os.setgroups([])
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(pipe / "control"))
                s.settimeout(20)
                os.write(w2, b"c")
                os.read(r1, 1)  # until told
                try:
                    s.sendall(b"quit\n")
                    got = s.recv(100)  # the fake answers a NUL-ended reply, then closes for quit
                    res = "sent" if got else "closed"
                except OSError as e:
                    res = type(e).__name__
            except BaseException as e:  # noqa: BLE001
                res = f"error {e!r}"
            os.write(w2, pickle.dumps(res))
            os._exit(0)
        os.close(r1)
        os.close(w2)
        assert os.read(self._r, 1) == b"c", "the holder could not connect"

    def quit(self) -> str:
        os.write(self._w, b"g")
        data = b""
        while chunk := os.read(self._r, 4096):
            data += chunk
        os.waitpid(self.pid, 0)
        return pickle.loads(data)


def control_binary(d: DaemonProc) -> Path:
    return next(d.state_dir.glob("native-*")) / "fakegpu" / "nvidia-cuda-mps-control"


def daemon_pid(pipe: Path) -> int:
    return int((pipe / mps.PID_FILE).read_text().split()[0])


def test_another_user_cannot_quit_the_daemon_under_my_mps_job(node, users):
    d, state, gates = node
    alice, mallory = users
    job = mps_job(d, alice, gates / "a")
    pipe = pipe_dir(d)
    # alice's job reached the server (which runs as alice and connects back to the control socket)
    wait_for(lambda: clients_of(state, alice.pw_uid), 30, "alice's job to attach as an MPS client")
    before = daemon_pid(pipe)
    assert reach(mallory, pipe) == "PermissionError"
    code, err = send_quit(mallory, pipe, control_binary(d))
    assert code != 0 and "Cannot find MPS control daemon" in err
    assert os.path.exists(f"/proc/{before}") and daemon_pid(pipe) == before  # the daemon still runs
    assert clients_of(state, alice.pw_uid)  # and alice's client is still attached
    assert reach(alice, pipe) == "ok"  # alice herself may (her job's processes must)
    (gates / "a").touch()
    assert d.wait_state(job, "succeeded", "failed", timeout=60)["state"] == "succeeded"


def test_my_access_ends_with_my_last_mps_job(node, users):
    d, state, gates = node
    alice, mallory = users
    first, second = mps_job(d, alice, gates / "1"), mps_job(d, alice, gates / "2")
    pipe = pipe_dir(d)
    assert (reach(alice, pipe), reach(mallory, pipe)) == ("ok", "PermissionError")
    (gates / "1").touch()
    d.wait_state(first, "succeeded", timeout=60)
    assert reach(alice, pipe) == "ok"  # her other MPS job still runs there
    (gates / "2").touch()
    d.wait_state(second, "succeeded", timeout=60)
    wait_for(lambda: reach(alice, pipe) == "PermissionError", 30, "alice's access to end with her last MPS job")
    assert mps.acl_users(pipe) == set()


def test_a_connection_kept_past_my_jobs_is_dropped_before_the_next_user(node, users):
    d, state, gates = node
    alice, mallory = users
    job = mps_job(d, alice, gates / "a")
    pipe = pipe_dir(d)
    held = Holder(alice, pipe)  # made while alice was allowed, from outside her job
    (gates / "a").touch()
    d.wait_state(job, "succeeded", timeout=60)
    wait_for(lambda: reach(alice, pipe) == "PermissionError", 30, "alice's access to end")
    theirs = mps_job(d, mallory, gates / "m")  # the next user's MPS job on that GPU
    wait_for(lambda: clients_of(state, mallory.pw_uid), 30, "the next user's job to attach")
    after = daemon_pid(pipe)
    assert held.quit() != "sent"  # her old connection leads nowhere now
    assert os.path.exists(f"/proc/{after}") and daemon_pid(pipe) == after
    assert clients_of(state, mallory.pw_uid)
    (gates / "m").touch()
    assert d.wait_state(theirs, "succeeded", "failed", timeout=60)["state"] == "succeeded"



def test_a_restarted_colo_sets_access_again_from_the_jobs_it_finds(node, users):
    d, state, gates = node
    alice, mallory = users
    job = mps_job(d, alice, gates / "a")
    pipe = pipe_dir(d)
    wait_for(lambda: clients_of(state, alice.pw_uid), 30, "alice's job to attach")
    d.kill9()
    pipe.chmod(0o755)  # as an older colo left it: open to all
    d.start()
    wait_for(lambda: reach(mallory, pipe) == "PermissionError", 30, "the restarted colo to close the folder")
    assert reach(alice, pipe) == "ok" and clients_of(state, alice.pw_uid)  # her running job keeps its daemon
    (gates / "a").touch()
    assert d.wait_state(job, "succeeded", "failed", timeout=60)["state"] == "succeeded"
    wait_for(lambda: reach(alice, pipe) == "PermissionError", 30, "alice's access to end with her job")

# --- the manager alone: restarts, an older colo's open folder, a filesystem without ACLs -----------

@pytest.fixture
def short_root():
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="cp", dir="/tmp"))  # short: <root>/<gpu>/pipe/control fits a socket path
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_shared_users_keep_their_daemon_and_a_restarted_colo_closes_an_open_folder(fakegpu, short_root):
    import stat
    env = {**os.environ, **fakegpu.env}
    u0 = fakegpu.uuids()[0]
    m = mps.MpsManager(short_root / "mps", fakegpu.mps_control, env, multi_user=True)
    try:
        m.allow(u0, 0, {5001})
        d = m.ensure(u0, 0)
        pid = d.pid
        m.keep_only(u0, set())
        m.allow(u0, 0, {5001})  # the same uid again: the daemon served no other, so no restart
        m.allow(u0, 0, {5001, 5002})  # multi-user: a second uid joins a running one, no restart
        m.keep_only(u0, {5002})       # the first one's jobs ended
        assert d.pid == pid and mps.acl_users(d.pipe_dir) == {5002}
        assert stat.S_IMODE(d.pipe_dir.stat().st_mode) == 0o710  # the group bits show the ACL mask: --x
        m.keep_only(u0, set())
        m.allow(u0, 0, {5003})  # someone new, nobody stays: restarted, old connections dropped
        assert d.pid not in (None, pid) and mps.acl_users(d.pipe_dir) == {5003}

        # an older colo left the folder 0755: a restarted colo closes it on adopting the daemon,
        # then gives access to the uids its store says run there, without restarting it
        pid = d.pid
        d.pipe_dir.chmod(0o755)
        again = mps.MpsManager(short_root / "mps", fakegpu.mps_control, env, multi_user=True)
        assert again.adopt(u0, 0)
        assert stat.S_IMODE(d.pipe_dir.stat().st_mode) in (0o700, 0o710)
        again.allow(u0, 0, {5004}, restart=False)
        assert again.get(u0).pid == pid and mps.acl_users(d.pipe_dir) == {5004}
        again.allow(u0, 0, {5005})  # the next switch restarts: who connected meanwhile is unknown
        assert again.get(u0).pid != pid
        again.stop_all()
    finally:
        m.stop_all()


def test_without_acls_there_is_no_mps_rather_than_an_open_daemon(fakegpu, short_root, caplog):
    import subprocess
    where = short_root / "ramfs"  # ramfs keeps no extended attributes, so no ACL
    where.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a ramfs here")
    try:
        with caplog.at_level("WARNING", logger="colo.node.mps"):
            m = mps.MpsManager(where / "mps", fakegpu.mps_control, {**os.environ, **fakegpu.env})
        assert not m.available()
        lines = [r.getMessage() for r in caplog.records if r.name == "colo.node.mps"]
        assert len(lines) == 1 and "MPS unavailable" in lines[0] and "takes no POSIX ACL" in lines[0]
        assert "all jobs run time-sliced" in lines[0]
        with pytest.raises(mps.MpsError, match="takes no POSIX ACL"):
            m.ensure(fakegpu.uuids()[0], 0)
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.docker
def test_a_container_job_reaches_its_daemon_through_the_bind_mount(node, users, test_image):
    """Docker bind-mounts the pipe directory: the same inode, so the same ACL, and the job runs as
    its submitter's uid inside. Her container's client attaches; the other user still cannot."""
    from colo.client import Client
    d, state, gates = node
    alice, mallory = users
    spec = {"argv": ["/opt/colo/native/colo-burn", "--mem", "256MiB", "--seconds", "2", "--quiet"],
            "image": test_image, "gpu_mem": 1 << 30, "profile": "light"}
    job = run_as(alice, lambda: Client(d.socket).submit(spec)["id"])
    end = d.wait_state(job, "succeeded", "failed", timeout=120)
    assert (end["state"], end["mode"]) == ("succeeded", "mps"), end
    log = next((d.state_dir / "mps").glob("*/log/control.log")).read_text()
    assert f"(uid {alice.pw_uid}) attached" in log, log[-2000:]  # an MPS client, not an ordinary context
    wait_for(lambda: reach(alice, pipe_dir(d)) == "PermissionError", 30, "alice's access to end")
    assert reach(mallory, pipe_dir(d)) == "PermissionError"
