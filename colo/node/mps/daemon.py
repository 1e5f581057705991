"""The MPS control daemon of one GPU (MpsDaemon), and what it needs: its errors, sizes as MPS
reads them, the processes it checks."""
from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterable

from .access import acl_users, set_pipe_access

log = logging.getLogger("colo.node.mps")

PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the control daemon into its pipe directory
# Read by the fake control daemon only (native/fakegpu); the real one ignores it.
FAKE_MULTIUSER_ENV = "COLO_FAKEGPU_MPS_MULTIUSER"
_MiB = 1024**2
_GiB = 1024**3


_ERROR_WORDS = ("error", "invalid", "unknown", "not found", "failed", "cannot", "usage")


class MpsError(RuntimeError):
    """A control command failed or timed out; the message is one line."""


def _one_line(text: str) -> str:
    lines = [s.strip() for s in (text or "").splitlines() if s.strip()]
    return " / ".join(lines)[:300]


# What MPS keeps of a client's pinned limit for the client itself. On an H200 (driver 580, docs/gpu.md)
# a client's free memory at init was 879 MiB of a 1 GiB limit and 1,777 MiB of a 2 GiB one: about
# 12.3 % of the limit plus 19 MiB. A job whose pinned limit were its budget could allocate only
# ~87 % of it under MPS, where time-sliced it gets all of it (and sees all of it: the interposer
# answers the budget as the card's size). The allowance is above both figures; bench/gpu_check.py's
# part mps measures what a client can allocate under colo's limit, so the next GPU checks it.
MPS_KEPT_SHARE = 0.15
MPS_KEPT_MIB = 64


def pinned_limit(budget: int) -> int:
    """The pinned limit of an MPS client with this budget: the budget, plus what MPS keeps of the
    limit (MPS_KEPT_*). The interposer holds the job to the exact budget; MPS is the second line."""
    return math.ceil((budget + MPS_KEPT_MIB * _MiB) / (1 - MPS_KEPT_SHARE))


def mps_size(size_bytes: int) -> str:
    """Size as MPS reads it ("4G", "1536M"), rounded up to whole MiB so the MPS limit never cuts
    below the budget: the interposer enforces the exact budget, MPS is the second line."""
    if size_bytes <= 0:
        raise ValueError(f"pinned memory limit must be positive, got {size_bytes}")
    if size_bytes % _GiB == 0:
        return f"{size_bytes // _GiB}G"
    return f"{math.ceil(size_bytes / _MiB)}M"


# --- processes --------------------------------------------------------------------------------

def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live process, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = raw[raw.rfind(")") + 2:].split()  # the command name may hold spaces and parens
    return rest[0], int(rest[19])


def _alive(pid: int, start: int | None) -> bool:
    """Alive and the same process (not a zombie, not a reused pid)."""
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return start is None or st[1] == start


def _environ_has(pid: int, key: str, value: str) -> bool:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{key}={value}".encode() in raw.split(b"\0")



# --- one GPU ----------------------------------------------------------------------------------

def gpu_dir_name(uuid: str) -> str:
    """A short folder name per GPU: the pipe's socket path must fit in 108 bytes."""
    return uuid.removeprefix("GPU-")[:8] or uuid


class MpsDaemon:
    """The MPS control daemon of one GPU.

    Layout: root/<uuid>/pipe (control socket, pid file; root's, 0700, searchable only by the
    uids in `users` through an ACL: whoever reaches the control socket can `quit` the daemon or
    terminate any client, so only the uids colo runs MPS jobs for there may; in Docker it is
    bind-mounted into the job, same inode, same ACL) and root/<uuid>/log
    (control.log, server.log; 0755 so servers started for job uids can write through the daemon
    and users can read why their client was refused). Unix socket paths are limited to 107 bytes,
    so `root` should be short (e.g. /run/colo/mps)."""

    def __init__(self, root: Path, gpu_uuid: str, gpu_index: int,
                 control: Path | str = "nvidia-cuda-mps-control", env: dict | None = None,
                 multi_user: bool = False, start_timeout: float = 10.0, cgroup: Path | None = None):
        self.root = Path(root)
        self.cgroup = cgroup  # a cgroup2 folder of colo's the control daemon (and so its servers) starts in
        self.uuid = gpu_uuid
        self.index = gpu_index
        self.control = str(control)
        self.multi_user = multi_user
        self.start_timeout = start_timeout
        self._base = self.root / gpu_dir_name(gpu_uuid)
        e = dict(os.environ if env is None else env)
        e.update(CUDA_MPS_PIPE_DIRECTORY=str(self.pipe_dir),
                 CUDA_MPS_LOG_DIRECTORY=str(self.log_dir), CUDA_VISIBLE_DEVICES=gpu_uuid)
        if multi_user:
            e[FAKE_MULTIUSER_ENV] = "1"
        self._env = e
        self._pid: int | None = None
        self._start: int | None = None  # /proc start time, guards against pid reuse
        self._started = False  # colo asked for it; cleared by stop()
        self._reaper: subprocess.Popen | None = None  # the `-d` process, reaped when it exits
        self._lock = threading.RLock()
        # uids that may reach the pipe directory (as found on disk: a colo restart keeps them)
        self.users: frozenset[int] = frozenset(acl_users(self.pipe_dir))
        # uids that may hold a connection to the running daemon (None: unknown, it was adopted)
        self.served: set[int] | None = set()

    @property
    def pipe_dir(self) -> Path:
        return self._base / "pipe"

    @property
    def log_dir(self) -> Path:
        return self._base / "log"

    @property
    def pid(self) -> int | None:
        return self._pid if self.running() else None

    @property
    def name(self) -> str:
        return f"GPU{self.index}"

    def __repr__(self) -> str:
        return f"MpsDaemon({self.name}, {self.uuid}, pid={self._pid})"

    # lifecycle

    def running(self) -> bool:
        if self._reaper is not None:
            self._reaper.poll()  # reap our own child, so a dead one is not left a zombie
        return self._pid is not None and _alive(self._pid, self._start)

    def start(self) -> None:
        """Start (or adopt an already running) daemon; return once it answers get_server_list."""
        with self._lock:
            if self.running():
                return
            for d in (self._base, self.pipe_dir, self.log_dir):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chown(d, os.geteuid(), os.getegid(), follow_symlinks=False)
                if d != self.pipe_dir:  # the pipe directory never passes through an open mode
                    d.chmod(0o755)
            self._write_access()  # closed before any daemon listens there
            if self._adopt():
                self.served = None
                self._started = True
                log.info("MPS daemon on %s found running (pid %d)", self.name, self._pid)
                return
            (self.pipe_dir / PID_FILE).unlink(missing_ok=True)
            with open(self.log_dir / "colo-start.log", "ab") as out:
                # -d forks and the parent returns; its output goes to a file, not a pipe, because
                # the daemon child may keep inherited descriptors open for its whole life.
                # in colo's own folder when it has one: a gated node lets its jobs' folder open the
                # GPUs, and the servers (the users' uids) must (colo/node/gate.py); joined by the
                # shell before the exec, so that no fork of the daemon is left behind
                argv = [self.control, "-d"] if self.cgroup is None else \
                    ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$1" -d', str(self.cgroup), self.control]
                proc = subprocess.Popen(argv, env=self._env,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        start_new_session=True, close_fds=True)
            deadline = time.monotonic() + self.start_timeout
            err = ""
            while True:
                rc = proc.poll()
                if rc not in (None, 0):
                    raise MpsError(f"MPS daemon on {self.name} did not start: `{self.control} -d` "
                                   f"exited {rc}: {_one_line(self._start_log())}")
                try:
                    self.command("get_server_list", timeout=2.0)
                    if self._adopt():
                        break
                    err = f"it answers but wrote no valid {PID_FILE}"
                except MpsError as e:
                    err = str(e)
                if time.monotonic() > deadline:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    raise MpsError(f"MPS daemon on {self.name} did not answer within "
                                   f"{self.start_timeout:.0f}s: {err}")
                time.sleep(0.02)
            self._reaper = proc  # reaped by running(), also if a daemon stays in the foreground
            self._started = True
            self._write_access()  # again, in case the daemon set its own mode on the directory
            self.served = set(self.users)
            log.info("MPS daemon on %s started (pid %d, pipe %s)", self.name, self._pid,
                     self.pipe_dir)

    def set_users(self, uids: Iterable[int]) -> None:
        """Exactly these uids (and root) may reach the pipe directory from now on. A connection
        made before stays open: see MpsManager.allow for how colo drops those."""
        with self._lock:
            self.users = frozenset(int(u) for u in uids)
            if self.pipe_dir.is_dir():
                self._write_access()

    def _write_access(self) -> None:
        try:
            set_pipe_access(self.pipe_dir, self.users)
        except OSError as e:
            raise MpsError(f"MPS on {self.name}: cannot set who may reach {self.pipe_dir} "
                           f"({e.strerror}); it is left closed to every job") from None

    def _start_log(self) -> str:
        try:
            return (self.log_dir / "colo-start.log").read_text(errors="replace")[-500:]
        except OSError:
            return ""

    def _adopt(self) -> bool:
        """Take the running daemon of this pipe directory, found by the pid file it writes there."""
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        if not self._is_ours(pid):
            return False
        st = _proc_stat(pid)
        if st is None or st[0] in ("Z", "X"):
            return False
        self._pid, self._start = pid, st[1]
        return True

    def _is_ours(self, pid: int) -> bool:
        if not _alive(pid, None):
            return False
        if not _environ_has(pid, "CUDA_MPS_PIPE_DIRECTORY", str(self.pipe_dir)):
            return False
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"-d" in argv[1:] or b"-f" in argv[1:]

    def stop(self, timeout: float = 10.0) -> None:
        """`quit`; SIGTERM then SIGKILL only if the daemon will not quit within `timeout`."""
        with self._lock:
            self._started = False
            if not self.running():
                self._pid = None
                self.served = set()
                return
            pid = self._pid
            try:
                self.command("quit", timeout=timeout)
            except MpsError as e:
                log.warning("MPS daemon on %s: quit failed (%s)", self.name, e)
            if not self._wait_gone(timeout):
                log.warning("MPS daemon on %s (pid %d) did not quit in %.0fs; terminating it",
                            self.name, pid, timeout)
                for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
                    if self._wait_gone(wait):
                        break
            if self._reaper is not None and self._reaper.poll() is None:
                self._reaper.wait(timeout=1)
            self._pid = None
            self.served = set()

    def _wait_gone(self, timeout: float) -> bool:
        reaper = self._reaper
        deadline = time.monotonic() + timeout
        while self.running():
            if reaper is not None:
                reaper.poll()  # reap it if it was our own child
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    # commands

    def command(self, line: str, timeout: float = 5.0) -> str:
        """One control command through the control binary's client mode; the reply, stripped."""
        try:
            r = subprocess.run([self.control], input=line.strip() + "\n", env=self._env,
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise MpsError(f"MPS control on {self.name}: `{line}` timed out after "
                           f"{timeout:g}s") from None
        except OSError as e:
            raise MpsError(f"MPS control on {self.name}: cannot run {self.control}: "
                           f"{e.strerror}") from None
        reply = r.stdout.strip()
        if r.returncode != 0 or "cannot find mps control daemon" in reply.lower():
            raise MpsError(f"MPS control on {self.name}: `{line}` failed (exit {r.returncode}): "
                           f"{_one_line(r.stderr + chr(10) + reply) or 'no output'}")
        return reply

    def _checked(self, line: str) -> str:
        """For set/terminate commands: a reply that reads as an error is one."""
        reply = self.command(line)
        low = reply.lower()
        if any(w in low for w in _ERROR_WORDS):
            raise MpsError(f"MPS control on {self.name}: `{line}`: {_one_line(reply)}")
        return reply

    @staticmethod
    def _pids(reply: str) -> list[int]:
        return [int(w) for w in reply.split() if w.isdigit()]

    def server_list(self) -> list[int]:
        return self._pids(self.command("get_server_list"))

    def client_list(self, server_pid: int) -> list[int]:
        return self._pids(self.command(f"get_client_list {server_pid}"))

    def server_status(self, server_pid: int) -> str:
        """"ACTIVE" or "FAULT" (the control daemon's words)."""
        return self.command(f"get_server_status {server_pid}").strip().upper()

    def start_server(self, uid: int) -> None:
        self._checked(f"start_server -uid {int(uid)}")

    def set_default_thread_pct(self, p: int) -> None:
        self._checked(f"set_default_active_thread_percentage {_pct(p)}")

    def set_default_pinned_mem_limit(self, dev: int, size_bytes: int) -> None:
        self._checked(f"set_default_device_pinned_mem_limit {int(dev)} {mps_size(size_bytes)}")

    def set_thread_pct(self, server_pid: int, p: int) -> None:
        self._checked(f"set_active_thread_percentage {int(server_pid)} {_pct(p)}")

    def terminate_client(self, server_pid: int, client_pid: int) -> None:
        self._checked(f"terminate_client {int(server_pid)} {int(client_pid)}")

    def health(self) -> str:
        """off (not started by colo) | active | fault (a server in FAULT, or no answer) | dead
        (colo started it and its process vanished)."""
        if not self.running():
            return "dead" if self._started else "off"
        try:
            servers = self.server_list()
            if any(self.server_status(s).startswith("FAULT") for s in servers):
                return "fault"
        except MpsError as e:
            if not self.running():
                return "dead"
            log.warning("%s", e)
            return "fault"
        return "active"

    def client_env(self, budget: int, thread_pct: int | None) -> dict[str, str]:
        """Environment of an MPS client job. The pinned limit (pinned_limit: the budget and what MPS
        keeps of it) names device 0 because the job sees only its own GPU. A client can only lower
        the daemon's limits, never raise them."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
               "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={mps_size(pinned_limit(budget))}"}
        if thread_pct is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(_pct(thread_pct))
        return env


def _pct(p: int) -> int:
    p = int(p)
    if not 1 <= p <= 100:
        raise ValueError(f"active thread percentage must be 1..100, got {p}")
    return p
