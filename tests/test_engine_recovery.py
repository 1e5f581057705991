"""The Docker engine failing during recovery (after the start-up ping, before recovery is done):
the daemon must still start, and container jobs it could not look at must be found again when
the engine answers, not lost. The fault is real: the daemon reaches its engine through a Unix
socket proxy that cuts the connection of each container listing while armed."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import threading
from pathlib import Path

from harness.daemon import DaemonProc, as_user, wait_for

from colo.client import Client

from colo.runtimes.image import build_local_image

LISTING = re.compile(rb"GET /v[0-9.]+/containers/json")  # what DockerRuntime.adopt sends
REMOVAL = re.compile(rb"DELETE /v[0-9.]+/containers/")
IMAGE_CHECK = re.compile(rb"GET /v[0-9.]+/images/\S+/json")  # DockerRuntime.has_image, at submit
CREATE = re.compile(rb"POST /v[0-9.]+/containers/create")
REASONS = {404: "Not Found", 409: "Conflict", 500: "Internal Server Error"}


def inspect_of(container_id: str) -> re.Pattern:
    """What DockerRuntime sends to look at one container (poll, wait, cleanup)."""
    return re.compile(rb"GET /v[0-9.]+/containers/" + container_id.encode() + rb"/json")


class Answer:
    """A request the proxy answers itself, with an HTTP status and a message in the engine's JSON."""

    def __init__(self, pattern: re.Pattern, status: int, message: str, times: int | None):
        self.pattern, self.status, self.left = pattern, status, times
        body = json.dumps({"message": message}).encode()
        self.response = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                         f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        self.count = 0  # requests answered so far


class Hold:
    """Requests matching `pattern` wait in the proxy until `release` is set (at most `most` s, so
    that a daemon stuck on one is not stuck for ever): an engine that is there but slow."""

    def __init__(self, pattern: re.Pattern, most: float):
        self.pattern, self.most = pattern, most
        self.release = threading.Event()
        self.waiting = 0  # requests held now
        self.held = 0  # requests held so far


class CuttingProxy:
    """Forwards bytes between clients and the engine's socket (real HTTP over real Unix sockets);
    while `armed` is set, a connection that sends a container listing is closed instead (as by an
    engine that went away); a request an `answer()` matches gets that answer instead of the engine's
    (as from an engine that is there but refuses or fails)."""

    def __init__(self, engine_sock: Path):
        self.dir = Path(tempfile.mkdtemp(prefix="px-"))  # short: a socket path has ~100 bytes
        self.path = self.dir / "proxy.sock"
        self.url = f"unix://{self.path}"
        self.engine_sock = str(engine_sock)
        self.armed = threading.Event()
        self.cuts = 0
        self.answers: list[Answer] = []
        self.holds: list[Hold] = []
        self.lock = threading.Lock()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.path))
        self.server.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def answer(self, pattern: re.Pattern, status: int, message: str, times: int | None = None) -> Answer:
        """Answer requests matching `pattern` with `status` (the next `times` of them; None: all)."""
        a = Answer(pattern, status, message, times)
        with self.lock:
            self.answers.append(a)
        return a

    def hold(self, pattern: re.Pattern, most: float = 120.0) -> Hold:
        """Hold requests matching `pattern` until the Hold's `release` is set."""
        h = Hold(pattern, most)
        with self.lock:
            self.holds.append(h)
        return h

    def _held(self, data: bytes) -> None:
        with self.lock:
            h = next((h for h in self.holds if not h.release.is_set() and h.pattern.search(data)), None)
            if h is None:
                return
            h.waiting += 1
            h.held += 1
        h.release.wait(h.most)
        with self.lock:
            h.waiting -= 1

    def stop_answering(self) -> None:
        with self.lock:
            self.answers.clear()

    def _answer_for(self, data: bytes) -> Answer | None:
        with self.lock:
            for a in self.answers:
                if a.left != 0 and a.pattern.search(data):
                    a.count += 1
                    a.left = None if a.left is None else a.left - 1
                    return a
        return None

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
                if requests:
                    self._held(tail + data)
                if requests and (a := self._answer_for(tail + data)) is not None:
                    src.sendall(a.response)  # the engine never sees it
                    break
                # a request line split across two reads is still seen; one whose headers ended is done
                tail = b"" if data.endswith(b"\r\n\r\n") else data[-160:]
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


def _behind_proxy(root, fakegpu, make_dockerd):
    """A private engine with the test image, a daemon that reaches it only through a CuttingProxy.
    `root`: the daemon's folder (one other users can traverse for tests that act as them)."""
    engine = make_dockerd()
    build_local_image(engine.client(), "colo-test/base:1")
    proxy = CuttingProxy(engine.sock)
    d = DaemonProc(root, fakegpu.state, env={"DOCKER_HOST": proxy.url}).start()
    os.chmod(d.socket.parent, 0o755)
    return engine, proxy, d


def _shared_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="colo-engrec-"))
    os.chmod(root, 0o755)
    return root


def _gated_container(d, gates: Path, *lines: str, code: int) -> int:
    """A container job that prints `lines`, the second one and later each after its gate file
    (gates/1, gates/2...) appears, then exits with `code`; once its first line is written."""
    gates.mkdir(exist_ok=True)
    gates.chmod(0o777)
    script = "; ".join([f"echo {lines[0]}"] + [f"while [ ! -e /gate/{i} ]; do sleep 0.05; done; echo {x}"
                                                for i, x in enumerate(lines[1:], 1)] + [f"exit {code}"])
    c = d.submit("--image", "colo-test/base:1", "--gpus", "0", "--mount", f"{gates}:/gate", "--", "sh", "-c", script)
    wait_for(lambda: lines[0] in d.cli("logs", str(c)).stdout, 60, "the container's first line")
    return c


def _listed(engine, container_id: str) -> bool:
    """Does the engine still list this container? (The raw listing: the SDK's list() looks at
    each container it lists, and a 404 when one is removed in between would fail the wait.)"""
    return bool(engine.client().api.containers(all=True, filters={"id": container_id}))


def _container_of(engine, job_id: int) -> str:
    (c,) = engine.client().containers.list(all=True, filters={"label": f"colo.job={job_id}"})
    return c.id


def _serves_another_user(d, other_user) -> None:
    kind, rows = as_user(other_user, lambda: Client(d.socket).ls())
    assert kind == "ok", rows
    spec = {"argv": ["echo", "theirs"], "gpus": 0, "workdir": "/tmp"}
    kind, theirs = as_user(other_user, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", theirs
    assert d.wait_state(theirs, "succeeded", "failed", timeout=60)["state"] == "succeeded"


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
        wait_for(lambda: not engine.client().api.containers(all=True, filters={"label": "colo.managed=1"}),
                 30, "colo's containers to be removed")
    finally:
        if (tmp_path / "gates").is_dir():  # a failed run (a daemon that never came back) leaves no job at a gate
            for g in "abp":
                (tmp_path / "gates" / g).touch()
        d.stop()
        proxy.close()


def test_a_slow_container_listing_holds_up_no_other_jobs_recovery(tmp_path, fakegpu, make_dockerd):
    """After a restart, a process job is found again while the engine sits on the container
    listing (Slurm's jobs likewise): only container jobs wait for the engine's answer."""
    engine, proxy, d = _behind_proxy(tmp_path, fakegpu, make_dockerd)
    gate = tmp_path / "p"
    slow = None
    try:
        p = d.submit("--process", "--gpus", "0", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done")
        d.wait_state(p, "running")
        d.kill9()
        said = len(d.log.read_text().splitlines())
        slow = proxy.hold(LISTING)
        d.start()
        wait_for(lambda: f"job {p} found again after restart" in "\n".join(d.log.read_text().splitlines()[said:]),
                 60, "the process job to be found again")
        slow.release.set()
        gate.touch()
        assert d.wait_state(p, "succeeded", "failed", "lost", timeout=60)["state"] == "succeeded"
    finally:
        gate.touch()
        if slow is not None:
            slow.release.set()
        d.stop()
        proxy.close()


def test_engine_answering_500_about_a_recovered_job_leaves_it_running_and_serves_everyone(
        fakegpu, make_dockerd, other_user):
    root = _shared_root()
    engine, proxy, d = _behind_proxy(root, fakegpu, make_dockerd)
    gates = root / "gates"
    try:
        c = _gated_container(d, gates, "before", "after", code=7)
        d.kill9()
        refused = proxy.answer(inspect_of(_container_of(engine, c)), 500, "driver failed (colo test)")
        d.start()  # recovery's look at the container is answered 500: it must start all the same
        wait_for(lambda: refused.count >= 2 or d.proc.poll() is not None, 60, "recovery, then a look again")
        assert d.proc.poll() is None, d.log.read_text()[-2000:]
        _serves_another_user(d, other_user)
        assert d.job(c)["state"] == "running"  # not lost, not failed: the engine only refused to say
        said = [ln for ln in d.log.read_text().splitlines() if f"job {c}: Docker engine answered 500" in ln]
        assert len(said) == 1 and "driver failed (colo test)" in said[0], said  # one line, the engine's words

        (gates / "1").touch()  # it ends while the engine still refuses to say so
        wait_for(lambda: engine.client().containers.get(_container_of(engine, c)).status == "exited", 60,
                 "the container to end")
        assert d.job(c)["state"] == "running"
        proxy.stop_answering()
        job = d.wait_state(c, "failed", "succeeded", "lost", "cancelled", timeout=90)
        assert job["state"] == "failed" and job["exit_code"] == 7, job
        assert d.cli("logs", str(c), check=True).stdout == "before\nafter\n"
        wait_for(lambda: not engine.client().api.containers(all=True, filters={"label": "colo.managed=1"}),
                 30, "colo's containers to be removed")
    finally:
        (gates / "1").touch()
        d.stop()
        proxy.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_container_gone_while_the_engine_answered_errors_is_lost_with_its_exit_unknown(
        tmp_path, fakegpu, make_dockerd):
    engine, proxy, d = _behind_proxy(tmp_path, fakegpu, make_dockerd)
    gates = tmp_path / "gates"
    try:
        c = _gated_container(d, gates, "before", "after", code=0)
        d.kill9()
        proxy.answer(LISTING, 500, "listing failed (colo test)")
        refused = proxy.answer(inspect_of(_container_of(engine, c)), 500, "driver failed (colo test)")
        d.start()  # recovery's listing of colo's containers, and its look at the job's, are answered 500
        wait_for(lambda: refused.count >= 2 or d.proc.poll() is not None, 60, "recovery, then a look again")
        assert d.proc.poll() is None, d.log.read_text()[-2000:]
        assert d.cli("ls", check=True).returncode == 0
        engine.client().containers.get(_container_of(engine, c)).remove(force=True)  # behind colo's back
        proxy.stop_answering()
        job = d.wait_state(c, "failed", "succeeded", "lost", "cancelled", timeout=90)
        # 404 for a container colo knows: it is over, its exit unknown (not an engine outage, not a retry)
        assert job["state"] == "lost" and job["exit_code"] is None, job
        assert "no longer exists" in job["reason"] and "exit code is unknown" in job["reason"], job
        p = d.submit("--process", "--gpus", "0", "--", "echo", "still scheduling")
        assert d.wait_state(p, "succeeded", "failed", timeout=60)["state"] == "succeeded"
    finally:
        (gates / "1").touch()
        d.stop()
        proxy.close()


def test_a_removal_refused_in_the_sweep_is_retried_with_a_backoff_until_it_is_removed(tmp_path, fakegpu, make_dockerd):
    engine, proxy, d = _behind_proxy(tmp_path, fakegpu, make_dockerd)
    try:
        # A container of colo's whose job no longer exists (as one left when a daemon died between a
        # job's end and its removal): recovery's sweep removes it.
        instance = (d.state_dir / "instance").read_text().strip()
        left = engine.client().containers.create("colo-test/base:1", ["true"], labels={
            "colo.managed": "1", "colo.instance": instance, "colo.job": "999999"})
        d.kill9()
        refused = proxy.answer(REMOVAL, 409, "removal of container is already in progress (colo test)", times=3)
        d.start()  # the sweep's removal is refused three times: it must start all the same
        wait_for(lambda: refused.count >= 1 or d.proc.poll() is not None, 60, "the sweep to try the removal")
        assert d.proc.poll() is None, d.log.read_text()[-2000:]
        assert d.cli("ls", check=True).returncode == 0
        p = d.submit("--process", "--gpus", "0", "--", "echo", "still scheduling")
        assert d.wait_state(p, "succeeded", "failed", timeout=60)["state"] == "succeeded"

        # tried again by the running daemon (no restart), each time after twice as long, then removed
        wait_for(lambda: not _listed(engine, left.id), 60,
                 "the leftover container to be removed")
        assert refused.count == 3
        done = f"container {left.id[:12]} of job 999999 removed after 3 refusals"
        # the daemon logs the removal just after the engine carried it out
        log = wait_for(lambda: done in (x := d.log.read_text()) and x, 60, "the removal to be logged")
        delays = [int(m) for m in re.findall(rf"container {left.id[:12]} of job 999999 not removed "
                                             r"\(refused \d times?\): .*?; trying again in (\d+) s", log)]
        assert delays == [1, 2, 4], delays
        assert "already in progress (colo test)" in log
    finally:
        d.stop()
        proxy.close()


def test_a_stop_and_a_removal_the_engine_refuses_are_tried_again_until_carried_out(tmp_path, fakegpu, make_dockerd):
    engine, proxy, d = _behind_proxy(tmp_path, fakegpu, make_dockerd)
    gates = tmp_path / "gates"
    try:
        c = _gated_container(d, gates, "before", "after", code=0)
        cid = _container_of(engine, c)
        refused = proxy.answer(re.compile(rb"POST /v[0-9.]+/containers/" + cid.encode() + rb"/stop"), 500,
                               "cannot stop container (colo test)", times=2)
        kept = proxy.answer(re.compile(rb"DELETE /v[0-9.]+/containers/" + cid.encode()), 409,
                            "removal of container is already in progress (colo test)", times=2)
        d.cli("cancel", str(c))  # the stop is refused: the cancel is stored, and carried out later
        job = d.wait_state(c, "cancelled", "failed", "succeeded", "lost", timeout=60)
        assert job["state"] == "cancelled", job
        assert refused.count == 2
        assert d.proc.poll() is None
        said = [ln for ln in d.log.read_text().splitlines() if f"job {c}: stopping it was refused" in ln]
        assert said and "cannot stop container (colo test)" in said[0], said
        # its removal as it ended is refused twice: tried again by the running daemon, not at a restart
        wait_for(lambda: not _listed(engine, cid), 60,
                 "the ended job's container to be removed")
        assert kept.count == 2
    finally:
        (gates / "1").touch()
        d.stop()
        proxy.close()


def test_an_image_check_the_engine_fails_is_refused_in_one_line_and_nothing_is_stored(tmp_path, fakegpu, make_dockerd):
    engine, proxy, d = _behind_proxy(tmp_path, fakegpu, make_dockerd)
    try:
        refused = proxy.answer(IMAGE_CHECK, 500, "image store failed (colo test)")
        r = d.cli("submit", "--image", "colo-test/base:1", "--gpus", "0", "--", "true")
        assert r.returncode != 0 and refused.count == 1, r
        assert r.stderr.strip().splitlines() == [
            "colo: Docker engine answered 500 to the image check: image store failed (colo test); try again"], r.stderr
        assert d.cli("ls", "--all", "-q", check=True).stdout == ""  # not queued
        proxy.stop_answering()
        c = d.submit("--image", "colo-test/base:1", "--gpus", "0", "--", "true")  # the same, once it answers
        assert d.wait_state(c, "succeeded", "failed", timeout=60)["state"] == "succeeded"
    finally:
        d.stop()
        proxy.close()


def test_starts_the_engine_fails_are_tried_again_a_few_times_and_a_job_s_own_fault_is_not(
        tmp_path, fakegpu, make_dockerd):
    engine, proxy, d = _behind_proxy(tmp_path, fakegpu, make_dockerd)
    try:
        # twice, then it creates: the job runs (requeued, with a log line and the engine's words)
        twice = proxy.answer(CREATE, 500, "driver failed (colo test)", times=2)
        c = d.submit("--image", "colo-test/base:1", "--gpus", "0", "--", "echo", "made it")
        job = d.wait_state(c, "succeeded", "failed", "cancelled", "lost", timeout=120)
        assert job["state"] == "succeeded" and twice.count == 2, job
        assert d.cli("logs", str(c), check=True).stdout == "made it\n"
        requeued = [e["reason"] for e in job["events"] if e["new"] == "queued" and e["old"] == "starting"]
        said = "requeued: Docker engine answered 500 to the container's creation: driver failed (colo test) as it started"
        assert [x.startswith(said) for x in requeued] == [True, True], requeued
        assert "(1 of 3)" in requeued[0] and "(2 of 3)" in requeued[1], requeued
        log = d.log.read_text()
        assert f"job {c}: Docker engine answered 500 to the container's creation" in log

        # every time: it fails after 3 tries again, with the engine's words; the GPUs it was given go
        proxy.answer(CREATE, 500, "driver failed for good (colo test)")
        f = d.submit("--image", "colo-test/base:1", "--gpus", "2", "--gpu-mem", "16GiB", "--", "true")
        # between tries (1, 2, then 4 s) it waits in the queue, and explain says why
        waits = wait_for(lambda: ((x := d.client.explain(f)["decision"]) and x["action"] == "wait" and x["reason"])
                         or d.job(f)["state"] == "failed", 120, "the job to wait to start again")
        assert str(waits).startswith("waiting to start again: Docker engine answered 500 to the container's "
                                     "creation: driver failed for good (colo test) as it started"), waits
        job = d.wait_state(f, "succeeded", "failed", "cancelled", "lost", timeout=120)
        assert job["state"] == "failed" and job["attempts"] == 4, job
        assert job["reason"] == ("failed to start: Docker engine answered 500 to the container's creation: "
                                 "driver failed for good (colo test) (tried 4 times)"), job
        assert job["reason"] in d.cli("ls", "--all", "-w", "-o", "id,reason", check=True).stdout
        assert sum(e["new"] == "queued" and e["old"] == "starting" for e in job["events"]) == 3, job["events"]
        p = d.submit("--process", "--gpus", "2", "--gpu-mem", "16GiB", "--", "true")  # all of both GPUs: free again
        assert d.wait_state(p, "succeeded", "failed", timeout=60)["state"] == "succeeded"
        proxy.stop_answering()

        # the job's own fault (this engine answers 400 for a missing command) fails at once, not tried again
        m = d.submit("--image", "colo-test/base:1", "--gpus", "0", "--", "no-such-program")
        job = d.wait_state(m, "succeeded", "failed", "cancelled", "lost", timeout=60)
        assert job["state"] == "failed" and job["attempts"] == 1, job
        assert job["reason"] == "failed to start: command 'no-such-program' not found in image 'colo-test/base:1'", job
        assert not any(e["new"] == "queued" and e["old"] == "starting" for e in job["events"]), job["events"]
    finally:
        d.stop()
        proxy.close()


def test_a_slow_removal_of_an_ended_container_holds_up_nobody(fakegpu, make_dockerd, other_user):
    root = _shared_root()
    engine, proxy, d = _behind_proxy(root, fakegpu, make_dockerd)
    gates = root / "gates"
    try:
        c = _gated_container(d, gates, "before", "after", code=0)
        cid = _container_of(engine, c)
        slow = proxy.hold(re.compile(rb"DELETE /v[0-9.]+/containers/" + cid.encode()))
        (gates / "1").touch()
        assert d.wait_state(c, "succeeded", "failed", timeout=60)["state"] == "succeeded"
        wait_for(lambda: slow.waiting, 60, "the removal of its container to reach the engine")
        # while the engine sits on that removal, the daemon serves everyone: another user lists,
        # submits, and their job is placed, run and reaped
        _serves_another_user(d, other_user)
        assert slow.waiting == 1, "the daemon answered only once the held removal was let go"
        slow.release.set()
        wait_for(lambda: not _listed(engine, cid), 60,
                 "the ended job's container to be removed")
        assert slow.held == 1 and d.proc.poll() is None
    finally:
        (gates / "1").touch()
        d.stop()
        proxy.close()
        shutil.rmtree(root, ignore_errors=True)
