"""The interface both runtimes keep. The daemon calls these from worker threads."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from ..jobs import Mount


class Gone(RuntimeError):
    """The job's container or process no longer exists (removed or reaped behind colo's back)."""


class Unavailable(RuntimeError):
    """The runtime's engine does not answer now (dockerd stopped or restarting): try again later."""


class EngineError(RuntimeError):
    """The engine answers, but refused or failed one call about this job (HTTP 500, 409...): not
    the job's end, and not the engine gone; the daemon looks again later. The text is the engine's."""


class StartError(RuntimeError):
    """The job could not be started (unknown image, no shell, bad workdir...): a one-line reason."""


@dataclass
class Launch:
    job_id: int
    argv: list[str]
    uid: int
    gid: int
    log_path: Path  # the job's output; kept after the job ends, read by `colo logs`
    run_dir: Path  # per-job folder owned by root, not writable by the job (exit file, ledger)
    image: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # complete additions: user env + colo's own
    mounts: list[Mount] = field(default_factory=list)  # user mounts (validated) + colo's own
    workdir: str | None = None
    gpus: list[str] = field(default_factory=list)  # UUIDs
    labels: dict[str, str] = field(default_factory=dict)
    share_host_shm: bool = False  # MPS clients in containers share /dev/shm with the server
    # called once the mount sources are no longer needed (the container started, or did not):
    # removes the staging mounts of the user's pinned sources (colo/daemon/pin.py)
    release: Callable[[], None] | None = None
    cpus: float | None = None  # CPU limit (cores), None: none
    mem: int | None = None  # host memory limit (bytes), None: none
    tasks: int | None = None  # processes and threads at once (pids.max), None: none
    # A session's terminal (the slave end of a pty the daemon made): the job's stdin, stdout,
    # stderr and controlling terminal. The runtime owns it: it closes it once the job has it.
    tty: int | None = None
    # `tty` is a wire instead (a socket: `colo run --image` fed from a pipe, as `docker run -i`):
    # the container gets no terminal; its input, stdout and stderr go over it (runtimes/ttyrelay.py)
    pipe: bool = False
    # A host session without a terminal (`colo run` fed from a pipe, as ssh without one): the job's
    # stdin, stdout and stderr, pipes whose other ends went to the client. Owned as `tty` is.
    stdio: tuple[int, int, int] | None = None
    kept: bool = False  # a detached session's (colo/daemon/detach.py): found again after a restart, attachable

    @property
    def simulated_gpus(self) -> bool:
        """Its GPUs are colo's simulated ones (native/fakegpu), reached through mounted files, not
        devices of the engine. COLO_FAKEGPU_STATE is colo's own variable: a submitter cannot set it."""
        return "COLO_FAKEGPU_STATE" in self.env
    output: str | None = None  # --output, expanded (%j...): also gets stdout (and stderr unless `error`)
    error: str | None = None  # --error: gets stderr apart


class Runtime(Protocol):
    name: str
    # True: an ended job's cleanup() only removes its remains (nothing of it runs on, so nothing
    # of it holds a GPU), and the daemon calls it off its event loop: a slow engine then delays
    # that removal, not every request. False: it may end leftovers that still hold GPU memory,
    # done before the job's GPUs are given to anyone else.
    cleanup_in_background: bool
    # True: stop() reaches every process of the job, those that left its process group too (the
    # patrol then kills none itself first). A container's engine and Slurm (proctrack) do; a
    # host job's stop signals its process group.
    stop_reaches_all: bool

    def start(self, launch: Launch) -> str:
        """Start the job; return a handle that survives a daemon restart. Raises StartError (the
        job's fault), EngineError (the engine failed the start: tried again later) or Unavailable."""

    def wait(self, handle: str) -> int:
        """Block until the job ends; its exit code (128+signal when killed). Raises Gone."""

    def exit_note(self, handle: str) -> str:
        """Anything unusual wait() saw that the job's reason should mention ("" when nothing)."""

    def poll(self, handle: str) -> int | None:
        """None while running, else the exit code. Raises Gone when it vanished without one."""

    def stop(self, handle: str, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds. Returns when it has stopped (a paused job is
        thawed first)."""

    def pause(self, handle: str) -> None:
        """Freeze every process of the job where it is (the cgroup freezer; `docker pause`). Raises
        EngineError with the reason where that cannot be done here."""

    def resume(self, handle: str) -> None:
        """Thaw what pause() froze."""

    def signal(self, handle: str, sig: int) -> None:
        """Send `sig` to the job (every process of a process job; a container's main process)."""

    def adopt(self) -> dict[int, str]:
        """Jobs of colo's still known to this runtime (running or exited, not yet cleaned): id -> handle."""

    def pids(self, handle: str) -> list[int]:
        """Host pids of the job's processes (to map NVML's processes to jobs)."""

    def cgroup_paths(self, handle: str) -> dict[str, str]:
        """Where the job's processes are, exactly, as /proc/PID/cgroup names it ({hierarchy: path},
        colo/node/cgroup.py places()): a folder only root (colo or the engine) makes, so that a
        process found at or beneath it is the job's. {} when the runtime has none."""

    def cleanup(self, handle: str) -> None:
        """Remove what is left (the container); the log file stays."""
