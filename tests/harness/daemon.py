"""A real colo daemon in a temporary directory, driven through the real CLI and client."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

from colo.client import Client, ClientError


def gpu_node(prefix: str, count: int = 1, mem: int = 16 * 1024**3) -> tuple[Path, Path, Path]:
    """A world-traversable temporary root (MPS servers and other users' jobs reach it) with `count`
    simulated GPUs and an empty profiles folder: (root, fakegpu state, profiles)."""
    import tempfile

    from colo.node import fakegpu
    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(root, 0o755)
    state = root / "fakegpu" / "state"
    state.parent.mkdir(mode=0o777)
    os.chmod(state.parent, 0o777)
    fakegpu.create(state, count=count, mem=mem)
    prof = root / "profiles"
    prof.mkdir()
    return root, state, prof


def burn_path(d: "DaemonProc") -> str:
    """colo-burn (the simulated load tool) as the daemon's world-readable copy: other users' jobs run it."""
    return str(next(d.state_dir.glob("native-*")) / "colo-burn")


def burn(d: "DaemonProc", *args: str) -> list[str]:
    """`colo submit`'s command part that runs colo-burn with `args`."""
    return ["--", burn_path(d), *args]


# The least any wait gives its event: a test waits on what it means, and on a busy 2-core machine
# (CI beside stress-ng) a daemon's answer can take tens of seconds; a longer limit costs nothing
# when the event comes, so no caller's shorter figure may turn load into a failure.
WAIT_FLOOR = 120.0


def wait_for(cond, timeout: float = WAIT_FLOOR, what: str = "condition", interval: float = 0.05):
    """Poll `cond` until it returns something truthy; fail with `what` after `timeout` (at least
    WAIT_FLOOR)."""
    timeout = max(timeout, WAIT_FLOOR)
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class DaemonProc:
    def __init__(self, root: Path, fake_state: Path | None = None, config: dict | None = None,
                 env: dict | None = None):
        self.root = root
        self.extra_env = env or {}
        self.state_dir = root / "state"
        self.socket = root / "run" / "colo.sock"
        self.fake_state = fake_state
        self.config_path = root / "colo.toml"
        # unprofiled_share: most daemon tests are about memory, with jobs that have no profile;
        # test_placement.py turns it off to test the placement of jobs without one. check_alone
        # off likewise: a profile's first run alone on a node has its own test there.
        cfg = {"stop_grace": 3.0, "sample_interval": 0.5, "reserve": "0", "unprofiled_share": True,
               "check_alone": False, **(config or {})}
        self.config_path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in cfg.items()) + "\n")
        self.proc: subprocess.Popen | None = None
        self.client = Client(self.socket, timeout=30)
        self.log = root / "daemon.log"

    def env(self) -> dict:
        e = dict(os.environ)
        e["COLO_SOCKET"] = str(self.socket)
        e.pop("COLO_FAKEGPU_STATE", None)
        e.update(self.extra_env)
        return e

    def argv(self) -> list[str]:
        """How the daemon is started: `colo daemon` by this interpreter (a bench may run it under a watcher)."""
        args = [sys.executable, "-m", "colo", "daemon", "-v", "--state-dir", str(self.state_dir),
                "--socket", str(self.socket), "--config", str(self.config_path)]
        if self.fake_state:
            args += ["--fake-gpus", str(self.fake_state)]
        return args

    def start(self, cwd: str | None = None) -> "DaemonProc":
        self.proc = subprocess.Popen(self.argv(), stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=self.env(),
                                     cwd=cwd)

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                return self.client.hello()
            except ClientError:
                return None

        wait_for(up, 60, "daemon to answer")
        return self

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """Cancel what still runs (jobs outlive their daemon by design), then stop the daemon."""
        if self.proc and self.proc.poll() is None:
            try:
                open_jobs = [j["id"] for j in self.client.ls(all=False)]
                for j in open_jobs:
                    try:
                        self.client.cancel(j)
                    except ClientError:
                        pass
                wait_for(lambda: not self.client.ls(all=False), 60, "jobs to stop at teardown")
            except (ClientError, AssertionError):
                pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cli_args(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "colo", *args]

    def cli(self, *args: str, check: bool = False, input: str | None = None, user: int | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        kw = {}
        if user is not None:
            kw.update(user=user, group=user)
        r = subprocess.run([sys.executable, "-m", "colo", *args], capture_output=True, text=True, env=self.env(),
                           input=input, timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"colo {' '.join(args)} failed ({r.returncode}): {r.stderr}")
        return r

    def submit(self, *args: str, user: int | None = None) -> int:
        r = self.cli("submit", *args, user=user)
        assert r.returncode == 0, r.stderr
        return int(r.stdout.strip())

    def job(self, job_id: int) -> dict:
        return self.client.show(job_id)

    def wait_state(self, job_id: int, *states: str, timeout: float = 60) -> dict:
        return wait_for(lambda: (j := self.job(job_id))["state"] in states and j, timeout,
                        f"job {job_id} to reach {states}")


def on_tty(d: "DaemonProc", *args: str) -> list[str]:
    """`colo ARGS` printing to a terminal (a pty): its lines."""
    import pty

    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "colo", *args], stdout=slave, stderr=subprocess.PIPE, env=d.env())
    os.close(slave)
    out = []
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: it closed the terminal
            break
        if not chunk:
            break
        out.append(chunk)
    assert p.wait(60) == 0, p.stderr.read()
    os.close(master)
    return b"".join(out).decode().replace("\r\n", "\n").splitlines()


def local_user(name: str):
    """A local user of that name (made when missing, without a home; needs root): its passwd entry."""
    import pwd

    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
        return pwd.getpwnam(name)


def as_user(pw, fn):
    """Run fn in a forked child with another uid: a real second peer on the socket."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            try:
                os.setgroups([])
                os.setgid(pw.pw_gid)
                os.setuid(pw.pw_uid)
                res = ("ok", fn())
            except Exception as e:  # noqa: BLE001
                res = ("err", (type(e).__name__, str(e), getattr(e, "code", None)))
            os.write(w, pickle.dumps(res))
        finally:  # a Ctrl-C of the suite included: the child never goes on to run pytest's session
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        kind, value = pickle.loads(f.read())
    os.waitpid(pid, 0)
    return (kind, value)


class PrivateDockerd:
    """A Docker engine of the test's own (data root, socket, bridge), which a test may stop and
    start again without touching the host's engine. Needs root and the dockerd binary.

    It gets a bridge of its own: an engine started with --bridge=none deletes the host's docker0."""

    def __init__(self, live_restore: bool = False):
        import secrets
        import shutil
        import tempfile

        if os.geteuid() != 0 or not shutil.which("dockerd") or not shutil.which("ip"):
            raise RuntimeError("a private Docker engine needs root, dockerd and ip")
        self.root = Path(tempfile.mkdtemp(prefix="cd-"))  # short: containerd's socket lives under it
        self.sock = self.root / "docker.sock"
        self.url = f"unix://{self.sock}"
        self.bridge = f"colo{secrets.token_hex(3)}"
        self.live_restore = live_restore
        self.proc: subprocess.Popen | None = None
        net = 100 + int(self.bridge[-2:], 16) % 100
        for cmd in (["ip", "link", "add", self.bridge, "type", "bridge"],
                    ["ip", "addr", "add", f"10.213.{net}.1/24", "dev", self.bridge],
                    ["ip", "link", "set", self.bridge, "up"]):
            subprocess.run(cmd, check=True, capture_output=True)

    def client(self):
        import docker

        return docker.DockerClient(base_url=self.url, timeout=60)

    def start(self) -> "PrivateDockerd":
        args = ["dockerd", "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "x"),
                "--pidfile", str(self.root / "pid"), "-H", self.url, "--bridge", self.bridge,
                "--iptables=false", "--ip-masq=false"]
        if self.live_restore:
            args.append("--live-restore")
        self.proc = subprocess.Popen(args, stdout=open(self.root / "dockerd.log", "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"dockerd exited: {(self.root / 'dockerd.log').read_text()[-2000:]}")
            try:
                return self.client().ping()
            except Exception:  # noqa: BLE001 - not up yet
                return False

        wait_for(up, 60, "the private dockerd to answer", interval=0.1)
        return self

    def stop(self) -> None:
        """What `systemctl stop docker` does: SIGTERM, and wait until it has gone."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(90)

    def close(self) -> None:
        import shutil

        try:
            if self.proc and self.proc.poll() is None:
                c = self.client()
                for ct in c.containers.list(all=True):
                    ct.remove(force=True)
            self.stop()
        finally:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            shutil.rmtree(self.root, ignore_errors=True)



def invoke_as(pw, d: "DaemonProc", *args: str) -> tuple[int, str]:
    """`colo ARGS` run in-process (typer's CliRunner) by another user: (exit code, output)."""
    from typer.testing import CliRunner

    from colo.cli.app import app

    def run():
        r = CliRunner().invoke(app, [*args, "--socket", str(d.socket)])
        return r.exit_code, r.output
    kind, out = as_user(pw, run)
    assert kind == "ok", out
    return out

def client_error(fn):
    """(message, code) of the ClientError that fn() raised, or None: what a refused call said."""
    try:
        fn()
    except ClientError as e:
        return (str(e), e.code)
    return None
