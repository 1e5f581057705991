"""The Docker runtime: one container per job, found again after a restart by its labels.

Output goes to the job's log file while it runs (a follower thread per container: dockerlogs.py), so it
survives the container's removal and `colo logs -f` can read it live. Where the follower got to
is kept in a sidecar cursor file, so a follower started after a daemon restart continues
exactly there: no line lost, none written twice.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import uuid
from pathlib import Path

import docker
import docker.errors
import docker.types
import requests
import urllib3

from ..node.cgroup import places
from ..node.devices import GpuNodes
from . import nvidia, preload, ttyrelay
from .base import EngineError, Gone, Launch, StartError, Unavailable
from .dockerlogs import Follower, cursor_path, write_cursor

LABEL_JOB = "colo.job"
LABEL_MANAGED = "colo.managed"
LABEL_INSTANCE = "colo.instance"  # which colo daemon (state dir) owns it: never adopt another's
LABEL_LOG = "colo.log"  # where the job's output goes; lets a restarted daemon re-attach a follower
LABEL_KEPT = "colo.kept"  # a detached session's container: a restarted daemon takes its terminal again
JOIN_TIMEOUT = 30.0  # how long wait() gives the follower to drain what the container wrote last

# The engine not answering at all (stopped, restarting, socket gone), unlike an API error.
ENGINE_DOWN = (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError,
               urllib3.exceptions.ProtocolError)
ENGINE_POLL = 1.0  # seconds between pings while the engine is away
# The engine's attach stream detaches on this sequence (its default, Ctrl-P Ctrl-Q, would take
# readline's Ctrl-P from a session): keys no terminal program binds. colo's own detach key is
# the client's (colo/cli/attach.py), never the engine's.
ENGINE_DETACH_KEYS = "ctrl-^,ctrl-@,ctrl-^,ctrl-@,ctrl-^"

log = logging.getLogger(__name__)


class DockerRuntime:
    """Jobs as containers of the local engine. Thread-safe; every method may block on the engine."""

    name = "docker"
    cleanup_in_background = True  # an ended job's container has exited: only its remains are removed
    stop_reaches_all = True  # the engine stops the container, every process in it

    def __init__(self, client=None, gpu_access: nvidia.GpuAccess | None = None, init: bool = False,
                 instance: str = "default"):
        # Each running job holds two long requests (wait, log follow): a pool much larger than
        # the SDK's default 10 avoids churning connections with many jobs.
        self.client = client if client is not None else docker.from_env(max_pool_size=128)
        self.api = self.client.api
        self._gpu_access = gpu_access  # fixed (tests), or None: asked of the engine at each GPU start
        # init=True puts docker-init (tini) as pid 1 so SIGTERM reaches programs without a handler;
        # off by default because then a missing command is a job exit 127, not a StartError.
        self.init = init
        self.instance = instance
        self._followers: dict[str, Follower] = {}
        self._relays: dict[str, ttyrelay.Relay] = {}  # container sessions' terminals (handle -> relay)
        self._lock = threading.Lock()
        self.down: str | None = None  # why the engine does not answer now; None while it does
        self._notes: dict[str, str] = {}  # handle -> what wait() saw happen to the engine
        self._loader: dict[str, str] = {}  # handle -> what the loader said of the interposer (preload.py)
        self._closed = threading.Event()
        self.log_cap, self.log_reserve, self.tty_rate = 0, 0, ttyrelay.RATE  # set by the daemon from its config
        self.gpu_gid: int | None = None  # gpu_group's gid (a gated node), set by the daemon
        self.gpu_nodes: GpuNodes | None = None  # the GPUs' device files (the simulation's: given as devices)

    @classmethod
    def from_env(cls, instance: str = "default") -> "DockerRuntime":
        return cls(docker.from_env(max_pool_size=128), instance=instance)

    def gpu_access(self) -> nvidia.GpuAccess:
        """How GPUs reach containers on this engine now: CDI, the nvidia runtime, or nothing (why)."""
        return self._gpu_access or nvidia.detect(self.client)

    def gpu_refusal(self) -> str | None:
        """Why a container job on real GPUs cannot get them here (for a refusal at submit); None
        when the engine can hand them over. Jobs on simulated GPUs need nothing of the engine."""
        access = self.gpu_access()
        return None if access.via else f"container jobs get no GPU here: {access.detail}"

    # -- the engine itself ------------------------------------------------------------------

    def _engine_down(self, e: BaseException) -> Unavailable:
        with self._lock:
            first = self.down is None
            self.down = f"Docker engine not reachable ({e.__class__.__name__})"
        if first:
            log.warning("%s: container jobs wait for it; running ones are followed again when it answers",
                        self.down)
        return Unavailable(self.down)

    def check(self) -> bool:
        """Ping the engine; True when it answers (and note that it is back)."""
        try:
            self.api.ping()
        except ENGINE_DOWN as e:
            self._engine_down(e)
            return False
        except docker.errors.APIError:
            pass  # answering, if unhappy: not "down"
        with self._lock:
            was, self.down = self.down, None
        if was is not None:
            log.warning("Docker engine answers again")
        return True

    def _await_engine(self) -> None:
        """Block until the engine answers again; Unavailable if colo stops meanwhile."""
        while not self.check():
            if self._closed.wait(ENGINE_POLL):
                raise Unavailable(self.down or "Docker engine not reachable")

    def has_image(self, image: str) -> bool:
        """Is this image here already? colo never pulls. Unavailable when the engine is away,
        EngineError when it fails the look (500...)."""
        try:
            self.api.inspect_image(image)
            return True
        except docker.errors.ImageNotFound:
            return False
        except ENGINE_DOWN as e:
            raise self._engine_down(e) from None
        except docker.errors.APIError as e:  # a malformed reference is "not found" to the submitter
            if e.status_code in (400, 404):
                return False
            raise _refused(e, None, "the image check") from None  # the engine's trouble (500...)

    # -- start -------------------------------------------------------------------------------

    def _host_config(self, launch: Launch) -> dict:
        mounts = [
            docker.types.Mount(m.target, m.source, type="bind", read_only=m.read_only)
            for m in launch.mounts
        ]
        if launch.share_host_shm:
            # MPS clients talk to their server through files in /dev/shm: share the host's.
            mounts.append(docker.types.Mount("/dev/shm", "/dev/shm", type="bind"))
        device_requests = None
        if launch.gpus and not launch.simulated_gpus:
            # by CDI or the nvidia runtime; a job the engine could give no GPU fails with the reason
            device_requests = self.gpu_access().device_requests(launch.gpus)
        return self.api.create_host_config(
            mounts=mounts,
            device_requests=device_requests,
            devices=self._simulated_devices(launch) or None,
            # a gated node (docs/gating.md): the group that may open the GPUs' files, for a GPU job only
            group_add=[str(self.gpu_gid)] if launch.gpus and self.gpu_gid is not None else None,
            # Docker's default capability set stays (ordinary programs need it, and it grants a
            # non-root uid nothing); no-new-privileges stops setuid binaries raising privileges.
            security_opt=["no-new-privileges"],
            privileged=False,
            init=self.init or None,
            # json-file can be read back by `logs` whatever the engine's default log driver is;
            # rotated, so a chatty job cannot fill the engine's disk either (colo's copy is capped).
            log_config=docker.types.LogConfig(type="json-file", config={"max-size": "64m", "max-file": "2"}),
            nano_cpus=int(launch.cpus * 1e9) if launch.cpus else None,
            mem_limit=launch.mem or None,
            memswap_limit=launch.mem or None,  # the limit is on memory, not memory + swap
            pids_limit=launch.tasks or None,
        )

    def _simulated_devices(self, launch: Launch) -> list[str]:
        """The simulated driver's files a job may open, when they are character devices (a gated
        simulation, as root made them): through the engine's device list, as CDI hands over real
        GPUs, so that its device rules refuse the others. They lie in the mounted state folder, at
        `<state>.dev` of the job's own COLO_FAKEGPU_STATE."""
        if not launch.gpus or not launch.simulated_gpus or self.gpu_nodes is None:
            return []
        try:
            allow, _ = self.gpu_nodes.split(launch.gpus)
        except LookupError as e:
            raise StartError(str(e)) from None
        inside = launch.env["COLO_FAKEGPU_STATE"] + ".dev"
        return [f"{n.path}:{inside}/{n.name}:rwm" for n in allow if n.char is not None]

    def start(self, launch: Launch) -> str:
        try:
            return self._start(launch)
        finally:
            # A started container holds its own copy of each bind mount: the staging mounts of
            # pinned sources (colo/daemon/pin.py) can go now, whether it started or not.
            if launch.release is not None:
                launch.release()

    def _start(self, launch: Launch) -> str:
        try:
            return self._create_and_start(launch)
        finally:
            if launch.tty is not None:  # it did not start (a relay owns it once it did): it hangs up
                os.close(launch.tty)
                launch.tty = None

    def _create_and_start(self, launch: Launch) -> str:
        if not launch.image:
            raise StartError("a docker job needs an image")
        if not launch.argv:
            raise StartError("missing command")
        labels = {
            **launch.labels,
            LABEL_JOB: str(launch.job_id),
            LABEL_MANAGED: "1",
            LABEL_INSTANCE: self.instance,
            LABEL_LOG: str(launch.log_path),
            **({LABEL_KEPT: "1"} if launch.kept else {}),
        }
        try:
            created = self.api.create_container(
                launch.image,
                command=list(launch.argv),
                environment=[f"{k}={v}" for k, v in launch.env.items()],
                working_dir=launch.workdir,
                user=f"{launch.uid}:{launch.gid}",
                labels=labels,
                name=f"colo-{launch.job_id}-{uuid.uuid4().hex[:6]}",
                host_config=self._host_config(launch),
                # a session: a terminal the engine allocates, its input open (ttyrelay.py); fed
                # from a pipe, no terminal (docker run -i). (docker-py sets StdinOnce with it: the
                # input closes at the end of the attach stream's.)
                tty=launch.tty is not None and not launch.pipe,
                stdin_open=launch.tty is not None,
            )
        except docker.errors.ImageNotFound:
            raise StartError(
                f"image {launch.image!r} not found locally "
                "(colo does not pull; build or load it first)"
            ) from None
        except docker.errors.APIError as e:
            if _engine_fault(e):  # the engine failed, not the job: the daemon tries again later
                raise _refused(e, None, "the container's creation") from None
            raise StartError(f"cannot create the container: {_reason(e)}") from None
        except ENGINE_DOWN as e:
            raise self._engine_down(e) from None
        handle = created["Id"]
        # A fresh cursor: this container's output is appended after what an earlier attempt left.
        log = Path(launch.log_path)
        log.parent.mkdir(parents=True, exist_ok=True)
        write_cursor(cursor_path(log), "", 0, log.stat().st_size if log.exists() else 0)
        sock = None
        try:
            # a session's stream is attached before the start, so nothing it writes first is lost
            sock = self._attach(handle) if launch.tty is not None else None
            self.api.start(handle)
        except docker.errors.APIError as e:
            if sock is not None:
                sock.close()
            try:
                self._remove(handle)
            except EngineError as r:  # the job fails (or is requeued) all the same; the sweep removes it
                log.warning("container %s of job %d not removed after its failed start: %s",
                            handle[:12], launch.job_id, r)
            if _engine_fault(e):
                raise _refused(e, handle, "the container's start") from None
            raise StartError(_start_reason(e, launch)) from None
        except ENGINE_DOWN as e:
            # It may or may not have started: the daemon's sweep removes it once the engine is back.
            raise self._engine_down(e) from None
        if sock is not None:
            self._relay(handle, f"{launch.job_id}", launch.tty, sock, launch.pipe)
            launch.tty = None  # the relay's now
        else:  # (a session's output is its terminal's, as a host session's is: not colo's log)
            self.follow_logs(handle, launch.log_path)
        return handle

    def _relay(self, handle: str, name: str, tty_fd: int, sock, pipe: bool = False) -> None:
        resize = None if pipe else lambda r, c: self.api.resize(handle, r, c)
        relay = ttyrelay.Relay(name, tty_fd, sock, resize, self.tty_rate)
        with self._lock:
            self._relays[handle] = relay
        relay.start()

    def set_tty_rate(self, rate: int) -> None:
        """Container sessions' output rate (detach_read_rate), for the relays running too (each
        reads its own at each turn)."""
        self.tty_rate = rate
        with self._lock:
            for relay in self._relays.values():
                relay.rate = rate

    def reattach(self, handle: str, limit: int) -> tuple[int, bytes] | None:
        """A detached session's container that no relay serves (after a restart): its terminal
        relayed again to a new pty, whose master is returned with the last `limit` bytes the
        engine logged of its terminal (what it showed last); None for any other container."""
        try:
            labels = self.api.inspect_container(handle)["Config"].get("Labels") or {}
            if labels.get(LABEL_KEPT) != "1":
                return None
            screen = self.api.logs(handle, stdout=True, stderr=True, tail=2000)[-limit:]
            sock = self._attach(handle)
        except (docker.errors.DockerException, *ENGINE_DOWN) as e:
            log.warning("container %s: its session's terminal could not be taken again: %s", handle[:12], e)
            return None
        master, slave = os.openpty()
        self._relay(handle, handle[:12], slave, sock)
        return master, screen

    def _attach(self, handle: str):
        """The container's attach stream (stdin, and its terminal's output) as a plain socket of
        this process: a copy of the engine connection's descriptor, which after the upgrade carries
        only this container's bytes (the engine reads no further request from it)."""
        io = self.api.attach_socket(handle, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1,
                                                    "detachKeys": ENGINE_DETACH_KEYS})
        raw = getattr(io, "_sock", io)
        sock = raw.dup()
        for s in (io, raw):
            try:
                s.close()
            except OSError:
                pass
        return sock

    def lost_terminal(self, handle: str) -> bool:
        """A container session's terminal is relayed by the daemon that started it (or the one it
        was attached to): one that has no relay for it (after a restart), or whose relay ended,
        has lost it."""
        with self._lock:
            relay = self._relays.get(handle)
        return relay is None or not relay.is_alive()

    # -- output ------------------------------------------------------------------------------

    def follow_logs(self, handle: str, log_path: Path) -> None:
        """Copy the container's output into log_path, from where the last follower stopped.

        Idempotent; the daemon calls it for every container adopt() returns."""
        with self._lock:
            f = self._followers.get(handle)
            if f is not None and f.is_alive():
                return
            f = self._followers[handle] = Follower(self.api, handle, Path(log_path), self.log_cap, self.log_reserve)
            f.start()

    def _drain(self, handle: str, timeout: float = JOIN_TIMEOUT) -> None:
        with self._lock:
            f = self._followers.get(handle)
            if f is not None and f.error is not None and not f.is_alive() and not self._closed.is_set():
                # it gave up while the engine refused (RETRIES): the engine answers now (the
                # caller just read the container's end), so one more goes on from its cursor
                f = self._followers[handle] = Follower(self.api, handle, f.log_path, self.log_cap, self.log_reserve)
                f.start()
        if f is not None:
            f.join(timeout)

    def close(self) -> None:
        """Stop all followers (daemon shutdown); their cursors let the next daemon go on."""
        self._closed.set()
        with self._lock:
            followers = list(self._followers.values())
            self._followers.clear()
        for f in followers:
            f.stop()
        for f in followers:
            f.join(5)

    # -- lifecycle ---------------------------------------------------------------------------

    def _state(self, handle: str) -> dict:
        try:
            return self.api.inspect_container(handle)["State"]
        except docker.errors.NotFound:
            raise Gone(f"container {handle[:12]} no longer exists") from None
        except docker.errors.APIError as e:
            raise _refused(e, handle) from None

    def wait(self, handle: str) -> int:
        """Raises EngineError when the engine answers a call with an error (e.g. the engine
        cancelling the wait as it stops): the daemon calls wait() again after a while, and a
        container that has ended meanwhile gives its exit code at once."""
        while True:
            try:
                if self._state(handle).get("Status") == "created":
                    raise Gone(f"container {handle[:12]} was created but never started")
                code = int(self.api.wait(handle, timeout=None)["StatusCode"])
                break
            except docker.errors.NotFound:
                raise Gone(f"container {handle[:12]} no longer exists") from None
            except ENGINE_DOWN as e:
                # dockerd restarting: with live-restore the container runs on, else it was stopped;
                # either way its exit code is there to read once the engine answers again.
                self._interrupted(e, handle)
                self._await_engine()
            except docker.errors.APIError as e:
                raise _refused(e, handle) from None
        try:  # `docker rm -f` ends the wait with 137: that is a removal, not an exit
            removed = self._state(handle).get("Status") in ("removing", "dead")
        except Gone:
            removed = True
        except ENGINE_DOWN as e:  # the engine went away as the container ended: it stopped it
            self._interrupted(e, handle)
            removed = False
        if removed:
            raise Gone(f"container {handle[:12]} was removed while it ran (it no longer exists)")
        self._drain(handle)
        self._note_loader(handle)
        return code

    def _interrupted(self, e: BaseException, handle: str) -> None:
        self._engine_down(e)
        with self._lock:  # noted at once: wait() may be called again before the exit is read
            self._notes[handle] = "the Docker engine stopped or restarted while it ran"

    def exit_note(self, handle: str) -> str:
        """Read only what wait() or poll() noted (the daemon asks from its event loop)."""
        with self._lock:
            return "; ".join(n for n in (self._notes.get(handle), self._loader.get(handle)) if n)

    def _note_loader(self, handle: str) -> None:
        """Once it ended: what the dynamic loader said about colo's interposer, when it preloaded it."""
        with self._lock:
            if handle in self._loader:
                return
        try:
            config = self.api.inspect_container(handle)["Config"]
        except (docker.errors.DockerException, *ENGINE_DOWN):
            return
        env = dict(e.partition("=")[::2] for e in config.get("Env") or [])
        log_path = (config.get("Labels") or {}).get(LABEL_LOG)
        note = preload.note(Path(log_path)) if log_path and preload.INTERPOSER in env.get("LD_PRELOAD", "") else ""
        with self._lock:
            self._loader[handle] = note

    def poll(self, handle: str) -> int | None:
        try:
            state = self._state(handle)
        except ENGINE_DOWN as e:
            raise self._engine_down(e) from None
        if state.get("Status") == "created":
            raise Gone(f"container {handle[:12]} was created but never started")
        if state.get("Running") or state.get("Restarting"):
            return None
        self._note_loader(handle)
        return int(state.get("ExitCode", 0))

    def stop(self, handle: str, grace: float) -> None:
        try:
            # docker stop: SIGTERM, then SIGKILL after t whole seconds; returns once it has stopped.
            self.api.stop(handle, timeout=max(0, math.ceil(grace)))
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            raise _refused(e, handle) from None
        except ENGINE_DOWN as e:
            raise self._engine_down(e) from None

    def pause(self, handle: str) -> None:
        self._call(self.api.pause, handle)

    def resume(self, handle: str) -> None:
        self._call(self.api.unpause, handle)

    def signal(self, handle: str, sig: int) -> None:
        self._call(self.api.kill, handle, signal=sig)  # the container's main process, as `docker kill -s`

    def _call(self, fn, handle: str, **kw) -> None:
        try:
            fn(handle, **kw)
        except docker.errors.NotFound:
            raise Gone(f"container {handle[:12]} no longer exists") from None
        except docker.errors.APIError as e:
            raise _refused(e, handle) from None
        except ENGINE_DOWN as e:
            raise self._engine_down(e) from None

    def adopt(self) -> dict[int, str]:
        found: dict[int, str] = {}
        mine = [f"{LABEL_MANAGED}=1", f"{LABEL_INSTANCE}={self.instance}"]
        try:
            containers = self.api.containers(all=True, filters={"label": mine})
        except ENGINE_DOWN as e:
            raise self._engine_down(e) from None
        except docker.errors.APIError as e:
            raise _refused(e, None) from None
        for c in containers:
            try:
                found[int(c["Labels"][LABEL_JOB])] = c["Id"]
            except (KeyError, ValueError):
                continue  # labelled by hand, not by colo
        return found

    def pids(self, handle: str) -> list[int]:
        try:
            top = self.api.top(handle, ps_args="-eo pid")
        except docker.errors.NotFound:
            raise Gone(f"container {handle[:12]} no longer exists") from None
        except docker.errors.APIError:
            return []  # not running: no processes
        except ENGINE_DOWN as e:
            raise self._engine_down(e) from None
        col = top["Titles"].index("PID")
        return [int(p[col]) for p in top.get("Processes") or []]

    def cgroup_paths(self, handle: str) -> dict[str, str]:
        """The container's own cgroup as the kernel names it: the lines of its main process (the
        engine's `State.Pid`) whose last folder carries the container's full id (the engine made
        them; a line the engine left alone, such as "/", says nothing about the container)."""
        pid = self._state(handle).get("Pid") or 0
        if pid <= 0:
            return {}
        return {k: v for k, v in places(pid).items() if handle in v.rsplit("/", 1)[-1]}

    def cleanup(self, handle: str) -> None:
        """EngineError when the engine refuses (e.g. 409, a removal under way): nothing is removed
        that could not be looked at first, and the daemon tries again later."""
        try:
            if not self._state(handle).get("Running"):
                self._drain(handle)  # normally done by wait() already; do not cut the tail if not
        except Gone:
            pass
        except ENGINE_DOWN as e:
            raise self._engine_down(e) from None
        try:
            self._remove(handle)
        except ENGINE_DOWN as e:
            raise self._engine_down(e) from None
        with self._lock:
            self._notes.pop(handle, None)
            self._loader.pop(handle, None)
            f = self._followers.pop(handle, None)
            relay = self._relays.pop(handle, None)
        if relay is not None:
            relay.stop()
        if f is not None:
            f.stop()
            f.join(5)

    def _remove(self, handle: str) -> None:
        try:
            # v: its anonymous volumes go with it (an image's VOLUME would otherwise leave one per
            # job, outside log_cap and log_reserve); named volumes are never removed this way
            self.api.remove_container(handle, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            raise _refused(e, handle) from None


def _refused(e: docker.errors.APIError, handle: str | None, to: str = "") -> EngineError:
    """The engine's own words for an error answer, e.g. 'Docker engine answered 409 for container
    0123456789ab: removal of container 0123456789ab is already in progress'; `to`: the call it
    answered ('the image check')."""
    what = (f" to {to}" if to else "") + (f" for container {handle[:12]}" if handle else "")
    return EngineError(f"Docker engine answered {e.status_code}{what}: {_reason(e)}")


def _engine_fault(e: docker.errors.APIError) -> bool:
    """A create or start the engine failed (5xx), not one the job's own config made fail (4xx). The
    runtime's refusal of the job's command, mounts or user is the job's whatever the status: some
    engine versions answer 500 for 'exec: "x": executable file not found' (docker.io 20.10: 400)."""
    text = str(e.explanation or e)
    return (e.status_code or 0) >= 500 and "OCI runtime" not in text and 'exec: "' not in text


def _reason(e: docker.errors.APIError) -> str:
    text = str(e.explanation or e)
    return text.strip().splitlines()[0] if text.strip() else str(e.status_code)


def _start_reason(e: docker.errors.APIError, launch: Launch) -> str:
    text = str(e.explanation or e)
    # runc: 'exec: "sh": executable file not found in $PATH'
    #   or  'exec: "/x": stat /x: no such file or directory'
    m = re.search(r'exec: "([^"]*)": (.*?)(?:: unknown)?$', text)
    if m and ("not found" in m.group(2) or "no such file" in m.group(2)):
        return f"command {m.group(1)!r} not found in image {launch.image!r}"
    if m and "permission denied" in m.group(2):
        return (
            f"command {m.group(1)!r} in image {launch.image!r} is not executable (uid {launch.uid})"
        )
    return f"cannot start the container: {_reason(e)}"
