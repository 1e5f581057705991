"""The Docker engine failing during recovery (after the start-up ping, before recovery is done):
the daemon must still start, and container jobs it could not look at must be found again when
the engine answers, not lost. The fault is real: the daemon reaches its engine through a Unix
socket proxy that cuts the connection of each container listing while armed."""
from __future__ import annotations

import re
import shutil
import socket
import tempfile
import threading
from pathlib import Path

from daemon_util import DaemonProc, wait_for

from colo.runtimes.image import build_local_image

LISTING = re.compile(rb"GET /v[0-9.]+/containers/json")  # what DockerRuntime.adopt sends
REMOVAL = re.compile(rb"DELETE /v[0-9.]+/containers/")
CONFLICT = b'{"message":"removal of container is already in progress"}'


class CuttingProxy:
    """Forwards bytes between clients and the engine's socket; while `armed` is set, a connection
    that sends a container listing is closed instead (as by an engine that went away); while
    `conflict` is set, a container removal is answered 409 as the engine does for one under way."""

    def __init__(self, engine_sock: Path):
        self.dir = Path(tempfile.mkdtemp(prefix="px-"))  # short: a socket path has ~100 bytes
        self.path = self.dir / "proxy.sock"
        self.url = f"unix://{self.path}"
        self.engine_sock = str(engine_sock)
        self.armed, self.conflict = threading.Event(), threading.Event()
        self.cuts = self.conflicts = 0
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.path))
        self.server.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                engine.connect(self.engine_sock)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, engine, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(engine, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        tail = b""
        try:
            while data := src.recv(65536):
                if requests and self.armed.is_set() and LISTING.search(tail + data):
                    self.cuts += 1
                    break
                if requests and self.conflict.is_set() and REMOVAL.search(tail + data):
                    self.conflicts += 1
                    src.sendall(b"HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                b"Content-Length: %d\r\n\r\n%s" % (len(CONFLICT), CONFLICT))
                    break
                tail = data[-64:]  # a request line split across two reads is still seen
                dst.sendall(data)
            else:
                dst.shutdown(socket.SHUT_WR)  # half-close, as the peer did
                return
        except OSError:
            pass
        for s in (src, dst):  # cut, or one side failed: both go
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _behind_proxy(tmp_path, fakegpu, make_dockerd):
    """A private engine with the test image, a daemon that reaches it only through a CuttingProxy."""
    engine = make_dockerd()
    build_local_image(engine.client(), "colo-test/base:1")
    proxy = CuttingProxy(engine.sock)
    return engine, proxy, DaemonProc(tmp_path, fakegpu.state, env={"DOCKER_HOST": proxy.url}).start()


def test_engine_failing_during_recovery_leaves_container_jobs_to_be_found_again(tmp_path, fakegpu, make_dockerd):
    engine, proxy, d = _behind_proxy(tmp_path, fakegpu, make_dockerd)
    try:
        gates = tmp_path / "gates"
        gates.mkdir()
        gates.chmod(0o777)
        c = d.submit("--image", "colo-test/base:1", "--gpus", "0", "--mount", f"{gates}:/gate", "--", "sh", "-c",
                     "echo before; while [ ! -e /gate/a ]; do sleep 0.05; done; echo middle; "
                     "while [ ! -e /gate/b ]; do sleep 0.05; done; echo after; exit 7")
        p = d.submit("--process", "--gpus", "0", "--", "sh", "-c", f"while [ ! -e {gates}/p ]; do sleep 0.05; done; echo p done")
        wait_for(lambda: "before" in d.cli("logs", str(c)).stdout, 60, "container output")
        d.wait_state(p, "running")

        d.kill9()
        (gates / "a").touch()  # written while no daemon follows it
        proxy.armed.set()
        d.start()  # pings the engine, then recovery's listing is cut: it must start all the same
        wait_for(lambda: proxy.cuts >= 2 or d.proc.poll() is not None, 60,
                 "recovery, then a look again, to meet the cut engine")
        assert d.proc.poll() is None, d.log.read_text()[-2000:]
        assert d.cli("ls", check=True).stdout  # it answers
        (gates / "p").touch()
        assert d.wait_state(p, "succeeded", "failed", "lost", timeout=60)["state"] == "succeeded"  # followed
        assert d.cli("logs", str(p), check=True).stdout == "p done\n"
        job = d.job(c)
        assert job["state"] == "running", job  # not lost: the engine was only away

        proxy.armed.clear()
        wait_for(lambda: f"job {c} found again after restart" in d.log.read_text(), 60,
                 "the container job to be found again once the engine answers")
        (gates / "b").touch()
        job = d.wait_state(c, "failed", "succeeded", "lost", "cancelled", timeout=60)
        assert job["state"] == "failed" and job["exit_code"] == 7, job
        assert d.cli("logs", str(c), check=True).stdout == "before\nmiddle\nafter\n"
        wait_for(lambda: not engine.client().containers.list(all=True, filters={"label": "colo.managed=1"}),
                 30, "colo's containers to be removed")
    finally:
        if (tmp_path / "gates").is_dir():  # a failed run (a daemon that never came back) leaves no job at a gate
            for g in "abp":
                (tmp_path / "gates" / g).touch()
        d.stop()
        proxy.close()


def test_a_removal_refused_in_the_sweep_is_left_for_the_next_one(tmp_path, fakegpu, make_dockerd):
    engine, proxy, d = _behind_proxy(tmp_path, fakegpu, make_dockerd)
    try:
        # A container of colo's whose job no longer exists (as one left when a daemon died between a
        # job's end and its removal): recovery's sweep removes it.
        instance = (d.state_dir / "instance").read_text().strip()
        left = engine.client().containers.create("colo-test/base:1", ["true"], labels={
            "colo.managed": "1", "colo.instance": instance, "colo.job": "999999"})
        d.kill9()
        proxy.conflict.set()
        d.start()  # the sweep's removal is refused: it must start all the same
        wait_for(lambda: proxy.conflicts >= 1 or d.proc.poll() is not None, 60, "the sweep to try the removal")
        assert d.proc.poll() is None, d.log.read_text()[-2000:]
        assert d.cli("ls", check=True).returncode == 0
        p = d.submit("--process", "--gpus", "0", "--", "echo", "still scheduling")
        assert d.wait_state(p, "succeeded", "failed", timeout=60)["state"] == "succeeded"
        assert engine.client().containers.get(left.id)  # left for the next sweep

        proxy.conflict.clear()
        d.stop()
        d.start()  # the next sweep
        wait_for(lambda: not engine.client().containers.list(all=True, filters={"id": left.id}), 60,
                 "the leftover container to be removed")
    finally:
        d.stop()
        proxy.close()
