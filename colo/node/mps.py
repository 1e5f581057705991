"""NVIDIA MPS: one `nvidia-cuda-mps-control -d` per GPU, with a private pipe directory.

Why one control daemon per GPU: each daemon is pinned to its GPU (CUDA_VISIBLE_DEVICES=<uuid>),
so a fault, a per-uid server switch or a stop on one GPU never touches the others, and a job's
pipe directory names exactly the GPU it was placed on. Time-sliced jobs get a pipe directory with
no daemon behind it, so they can never attach to MPS by accident (invariant 4, docs/invariants.md).

The control daemon outlives colo on purpose (it daemonizes): a colo restart finds it again by the
pid file in its pipe directory and its running clients keep their server (invariant 7).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger("colo.node.mps")

PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the control daemon into its pipe directory
NULL_PIPE_DIR = "mps-none"
# Read by the fake control daemon only (native/fakegpu); the real one ignores it.
FAKE_MULTIUSER_ENV = "COLO_FAKEGPU_MPS_MULTIUSER"
_MiB = 1024**2
_GiB = 1024**3
# What a job's uid gets on its GPU's pipe directory: search only. Clients and the servers the
# control daemon starts as their uid open fixed names there (the `control` socket, FIFOs the daemon
# made); none lists or creates anything in it, so no uid can delete or plant a socket there.
CLIENT_PERM = 0o1


_ERROR_WORDS = ("error", "invalid", "unknown", "not found", "failed", "cannot", "usage")


class MpsError(RuntimeError):
    """A control command failed or timed out; the message is one line."""


def _one_line(text: str) -> str:
    lines = [s.strip() for s in (text or "").splitlines() if s.strip()]
    return " / ".join(lines)[:300]


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


# --- who may reach a pipe directory (POSIX ACL) ------------------------------------------------
#
# The pipe directory is root's, mode 0700, plus one ACL entry `user:UID:--x` per uid that colo
# runs MPS jobs for on that GPU (docs/mps.md "Files"). Written as the kernel's own xattr format
# (linux/posix_acl_xattr.h, version 2): no library, no `setfacl` binary to install, one syscall
# that replaces the whole list (so a change is atomic and nothing is left of an earlier one).

_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_NO_ID = 0xFFFFFFFF


def _acl_bytes(uids: Iterable[int], perm: int = CLIENT_PERM) -> bytes:
    """owner rwx, each uid `perm`, group and others nothing. The kernel wants entries sorted by
    tag, then id; without named users it is a plain mode (0700) and the kernel stores just that."""
    ids = sorted({int(u) for u in uids})
    ents = [(_USER_OBJ, 0o7, _NO_ID)] + [(_USER, perm, u) for u in ids] + [(_GROUP_OBJ, 0, _NO_ID)]
    if ids:
        ents.append((_MASK, perm, _NO_ID))
    ents.append((_OTHER, 0, _NO_ID))
    return struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in ents)


def acl_users(path: Path) -> set[int]:
    """The uids named in a directory's access ACL (empty when it has none)."""
    try:
        raw = os.getxattr(path, _ACL_XATTR, follow_symlinks=False)
    except OSError:
        return set()
    if len(raw) < 4 or struct.unpack_from("<I", raw)[0] != _ACL_VERSION:
        return set()
    return {i for t, _, i in struct.iter_unpack("<HHI", raw[4:4 + (len(raw) - 4) // 8 * 8]) if t == _USER}


def set_pipe_access(path: Path, uids: Iterable[int]) -> None:
    """Root's 0700 directory that exactly these uids may search (and nobody else). On any failure
    it is left 0700 with every named entry masked off: closed, never open to all."""
    try:
        os.setxattr(path, _ACL_XATTR, _acl_bytes(uids), follow_symlinks=False)
    except OSError:
        try:
            os.chmod(path, 0o700, follow_symlinks=False)  # the ACL mask becomes ---: all named entries off
        except OSError:
            pass
        raise


def acl_problem(root: Path) -> str | None:
    """Why directories under `root` cannot carry a POSIX ACL (None when they can): tried on a
    scratch directory there, so the answer is the filesystem's own."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=".acl-", dir=root))
    except OSError as e:
        return f"cannot create {root}: {e.strerror}"
    try:
        set_pipe_access(probe, [_NO_ID - 1])
        if acl_users(probe) != {_NO_ID - 1}:
            return f"{root}: an ACL written there does not read back"
        return None
    except OSError as e:
        return f"{root} takes no POSIX ACL ({e.strerror})"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


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
        """Environment of an MPS client job. The pinned limit names device 0 because the job sees
        only its own GPU. A client can only lower the daemon's limits, never raise them."""
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
               "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={mps_size(budget)}"}
        if thread_pct is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(_pct(thread_pct))
        return env


def _pct(p: int) -> int:
    p = int(p)
    if not 1 <= p <= 100:
        raise ValueError(f"active thread percentage must be 1..100, got {p}")
    return p


# --- time-sliced jobs -------------------------------------------------------------------------

def null_pipe_dir(root: Path) -> Path:
    """An existing empty directory with no daemon behind it (read-only, so nobody but root can
    put a pipe there). A time-sliced job's CUDA_MPS_PIPE_DIRECTORY points here, so its driver finds
    no control daemon and creates an ordinary context, whatever runs elsewhere on the node."""
    d = Path(root) / NULL_PIPE_DIR
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)
    for p in d.iterdir():  # stale content must not lead anywhere either
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    d.chmod(0o555)
    return d


def timesliced_env(root: Path) -> dict[str, str]:
    return {"CUDA_MPS_PIPE_DIRECTORY": str(null_pipe_dir(root))}


# --- compute modes ----------------------------------------------------------------------------

_NVML_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}


def _mode_name(mode: str | int) -> str:
    if isinstance(mode, int):
        return _NVML_MODES.get(mode, f"unknown({mode})")
    return str(mode).strip().lower().replace("-", "_").replace(" ", "_")


def compute_mode_ok(mode: str | int) -> tuple[bool, str]:
    """Whether a GPU in this compute mode can mix MPS clients and time-sliced jobs (invariant 4)."""
    m = _mode_name(mode)
    if m == "default":
        return True, "DEFAULT compute mode: MPS clients and time-sliced jobs can share it"
    if m in ("exclusive_process", "exclusive_thread"):
        return False, (f"{m.upper()} compute mode: one CUDA context at a time, so MPS clients "
                       "(which share the MPS server's context) or a single time-sliced job, "
                       "never both")
    if m == "prohibited":
        return False, "PROHIBITED compute mode: no CUDA context may be created on it"
    return False, f"unknown compute mode {mode!r}"


def mode_plan(mode: str | int, set_default_mode: bool, mps_available: bool = True,
              name: str = "GPU") -> tuple[str, str]:
    """What to do with a GPU in this compute mode: ("mixed" | "mps_only" | "timesliced_only" |
    "unusable", message). "mixed" for a non-DEFAULT GPU means: set it to DEFAULT first (see
    ensure_default_mode). Pure."""
    ok, why = compute_mode_ok(mode)
    m = _mode_name(mode)
    if ok:
        return "mixed", ""
    if m == "prohibited":
        return "unusable", f"{name}: {why}; colo places no jobs on it"
    if set_default_mode and m in ("exclusive_process", "exclusive_thread"):
        return "mixed", (f"{name} is in {m.upper()} compute mode; setting it to DEFAULT "
                         "(set_default_compute_mode)")
    if m in ("exclusive_process", "exclusive_thread") and mps_available:
        return "mps_only", (f"{name} is in {m.upper()} compute mode: MPS jobs only (set "
                            "set_default_compute_mode = true, or run `nvidia-smi -c DEFAULT`, "
                            "to mix)")
    return "timesliced_only", f"{name}: {why}; one job at a time"


def ensure_default_mode(mode: str | int, set_default_mode: bool,
                        set_mode: Callable[[], None] | None = None, mps_available: bool = True,
                        name: str = "GPU") -> tuple[str, str]:
    """mode_plan, carried out: when it says to set DEFAULT, call `set_mode` (the NVML call, which
    needs root); if that fails, fall back to what the GPU can do in its current mode."""
    use, msg = mode_plan(mode, set_default_mode, mps_available, name)
    if use == "mixed" and _mode_name(mode) != "default":
        try:
            if set_mode is None:
                raise RuntimeError("no way to set the compute mode was given")
            set_mode()
        except Exception as e:  # noqa: BLE001 - any failure leaves the GPU in its mode
            use, msg = mode_plan(mode, False, mps_available, name)
            msg = f"{msg} (setting DEFAULT failed: {_one_line(str(e))})"
    if msg:
        log.warning("%s", msg)
    return use, msg


# --- all GPUs ---------------------------------------------------------------------------------

@dataclass
class CheckReport:
    """What MpsManager.check() found: log lines, and the MPS client pids of FAULT servers per GPU
    uuid (each client reported once per fault); their jobs fail with FAULT_REASON."""
    events: list[tuple[str, str]] = field(default_factory=list)  # (uuid, message)
    faults: dict[str, list[int]] = field(default_factory=dict)  # uuid -> client pids


FAULT_REASON = "MPS server fault"


class MpsManager:
    """The MPS control daemons of all GPUs colo manages. Thread-safe."""

    def __init__(self, root: Path, control: Path | str = "nvidia-cuda-mps-control",
                 env: dict | None = None, multi_user: bool = False, idle_stop_s: float = 300):
        self.root = Path(root)
        self.control = str(control)
        self.env = env
        self.multi_user = multi_user
        self.idle_stop_s = idle_stop_s
        self.cgroup: Path | None = None  # where control daemons start (MpsDaemon.cgroup), set by the daemon
        self._daemons: dict[str, MpsDaemon] = {}
        self._states: dict[str, str] = {}
        self._idle_since: dict[str, float] = {}
        self._reported: dict[str, set[tuple[int, int]]] = {}
        self._lock = threading.RLock()
        path = (env or os.environ).get("PATH")
        self._binary = shutil.which(self.control, path=path)
        # Fail closed: without ACLs the pipe directory could only be open to every user (anyone
        # could `quit` the daemon under other users' jobs) or to none; so no MPS at all.
        self._acl_problem = acl_problem(self.root) if self._binary else None
        if not self.available():
            log.warning("%s", self.unavailable_reason)

    def available(self) -> bool:
        return self._binary is not None and self._acl_problem is None

    @property
    def unavailable_reason(self) -> str:
        if self._binary and self._acl_problem:
            return (f"MPS unavailable: its pipe directories could not be kept to the jobs' own users: "
                    f"{self._acl_problem}; all jobs run time-sliced")
        return (f"MPS unavailable: {self.control} not found (no NVIDIA driver or MPS tools?); "
                "all jobs run time-sliced")

    def daemon_for(self, uuid: str, index: int) -> MpsDaemon:
        """The daemon of this GPU, started if it is not running."""
        return self.ensure(uuid, index)

    def ensure(self, uuid: str, index: int) -> MpsDaemon:
        if not self.available():
            raise MpsError(self.unavailable_reason)
        with self._lock:
            d = self._daemons.get(uuid)
            if d is None:
                d = self._daemons[uuid] = MpsDaemon(self.root, uuid, index, self._binary, self.env,
                                                    self.multi_user, cgroup=self.cgroup)
            self._idle_since.pop(uuid, None)
            if not d.running():
                d.start()
                self._states[uuid] = "active"
            return d

    def allow(self, uuid: str, index: int, uids: Iterable[int] | Callable[[], Iterable[int]],
              restart: bool = True) -> None:
        """Exactly these uids (those of the GPU's starting and running MPS jobs) may reach its
        control daemon from now on (docs/mps.md "Who may reach the daemon"). `uids` may be a
        callable: it is read under the daemon's lock, so a revoke (keep_only) that comes meanwhile
        is never undone by a list read before it.

        An ACL gates only new connections: a process of a uid that has since lost access may still
        hold one (its job handed a descriptor out, or a process outside the job connected while the
        job ran), and could `quit` the daemon under the next user's jobs, or stay attached as a
        client colo does not account for. So when uids come in and none of the current ones stays
        (the daemon serves one uid at a time without multi-user MPS), a daemon that served other
        uids is restarted first: it serves no colo job then, and every old connection is dropped.
        `restart=False` (after a colo restart, for jobs that already run there) never restarts."""
        with self._lock:
            d = self._daemons.get(uuid)
            if d is None:
                d = self._daemons[uuid] = MpsDaemon(self.root, uuid, index, self._binary, self.env,
                                                    self.multi_user, cgroup=self.cgroup)
            with d._lock:
                new = frozenset(int(u) for u in (uids() if callable(uids) else uids))
                if new == d.users:
                    return
                stale = d.served is None or bool(d.served - new)
                if restart and new - d.users and not new & d.users and stale and d.running():
                    d.stop()  # closed to all while it is down: users are set after the stop
                    d.set_users(new)
                    d.start()
                    self._states[uuid] = "active"
                    log.info("MPS daemon on %s restarted for uid(s) %s, so that no connection of an "
                             "earlier user outlives its jobs", d.name, ", ".join(map(str, sorted(new))))
                else:
                    d.set_users(new)
                if d.served is not None:
                    d.served |= new

    def keep_only(self, uuid: str, uids: Iterable[int]) -> None:
        """Revoke: of the uids that may reach this GPU's daemon, keep these. Never grants, never
        restarts, and takes no lock when nothing changes (it runs on colo's event loop)."""
        keep = set(uids)
        d = self._daemons.get(uuid)
        if d is None or d.users <= keep:
            return
        with d._lock:
            d.set_users(d.users & keep)

    def adopt(self, uuid: str, index: int) -> bool:
        """After a colo restart: take over this GPU's daemon if one still runs (its clients keep
        their server); never starts one. Returns whether one was found."""
        if not self.available():
            return False
        with self._lock:
            d = self._daemons.setdefault(uuid, MpsDaemon(self.root, uuid, index, self._binary,
                                                         self.env, self.multi_user, cgroup=self.cgroup))
            try:
                d.set_users(d.users)  # the mode an older colo left (0755) closed at once
            except MpsError as e:
                log.error("%s", e)
            if d.running() or ((d.pipe_dir / PID_FILE).exists() and d._adopt()):
                d.served = None  # who connected while colo was away is unknown
                d._started = True
                self._states[uuid] = "active"
                return True
            return False

    def get(self, uuid: str) -> MpsDaemon | None:
        return self._daemons.get(uuid)

    def states(self) -> dict[str, str]:
        """uuid -> "off" | "active" | "fault" for GpuView.mps, as of the last check() (call it every
        few seconds). GPUs without a daemon are absent: read them as "off"."""
        with self._lock:
            return {u: ("off" if s == "dead" else s) for u, s in self._states.items()}

    def check(self) -> CheckReport:
        """Health check of every daemon colo started: restart the dead, report FAULT clients."""
        rep = CheckReport()
        with self._lock:
            for uuid, d in list(self._daemons.items()):
                h = d.health()
                if h == "dead":
                    try:
                        d.start()
                        h = "active"
                        rep.events.append((uuid, f"MPS daemon on {d.name} died; restarted"))
                    except MpsError as e:
                        rep.events.append((uuid, f"MPS daemon on {d.name} died; "
                                                 f"restart failed: {e}"))
                if h == "fault":
                    self._collect_fault(uuid, d, rep)
                else:
                    self._reported.pop(uuid, None)
                self._states[uuid] = h
        for uuid, msg in rep.events:
            log.warning("%s", msg)
        return rep

    def _collect_fault(self, uuid: str, d: MpsDaemon, rep: CheckReport) -> None:
        seen = self._reported.setdefault(uuid, set())
        fresh: list[int] = []
        try:
            for s in d.server_list():
                if not d.server_status(s).startswith("FAULT"):
                    continue
                for c in d.client_list(s):
                    if (s, c) not in seen:
                        seen.add((s, c))
                        fresh.append(c)
        except MpsError as e:
            rep.events.append((uuid, f"MPS daemon on {d.name} does not answer: {e}"))
            return
        if fresh:
            rep.faults[uuid] = fresh
            pids = ", ".join(map(str, fresh))
            rep.events.append((uuid, f"{FAULT_REASON} on {d.name}: clients {pids}"))

    def release_idle(self, now: float, busy_uuids: Iterable[str]) -> list[str]:
        """Stop daemons that had no job for idle_stop_s (`now` in any one clock the caller keeps);
        a daemon that still lists clients is never stopped. Returns the stopped uuids."""
        busy = set(busy_uuids)
        stopped = []
        with self._lock:
            for uuid, d in self._daemons.items():
                if uuid in busy or not d.running():
                    self._idle_since.pop(uuid, None)
                    continue
                since = self._idle_since.setdefault(uuid, now)
                if now - since < self.idle_stop_s:
                    continue
                try:
                    if any(d.client_list(s) for s in d.server_list()):
                        continue
                except MpsError:
                    continue
                d.stop()
                self._idle_since.pop(uuid, None)
                self._states[uuid] = "off"
                stopped.append(uuid)
                log.info("MPS daemon on %s stopped after %.0fs idle", d.name, now - since)
        return stopped

    def own_pids(self) -> set[int]:
        """The control daemons colo runs and the servers they forked (for telling them from
        foreign GPU processes)."""
        import psutil

        out: set[int] = set()
        for d in list(self._daemons.values()):
            pid = d.pid
            if pid is None:
                continue
            out.add(pid)
            try:
                out.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return out

    def stop_unused(self) -> list[str]:
        """At colo shutdown: stop the daemons no client uses; those serving jobs outlive colo and are
        adopted again at its restart."""
        return self.release_idle(float("inf"), ()) if self.idle_stop_s < float("inf") else []

    def terminate_then(self, uuid: str, client_pids: int | Iterable[int],
                       kill: Callable[[], None]) -> bool:
        """Invariant 6: send terminate_client for each client (to the server whose client list holds
        it), then call kill(). kill() runs even when terminate_client fails or the daemon does not
        answer, because a stuck client must not live forever; the failure is logged. Returns whether
        every listed client was sent terminate_client without error."""
        pids = [client_pids] if isinstance(client_pids, int) else list(client_pids)
        d = self._daemons.get(uuid)
        ok = True
        try:
            if pids and (d is None or not d.running()):
                ok = False
                log.warning("no MPS daemon runs on GPU %s: cannot send terminate_client for %s; "
                            "killing anyway", uuid, pids)
            elif pids:
                owner = {c: s for s in d.server_list() for c in d.client_list(s)}
                for c in pids:
                    if c not in owner:
                        continue  # not (or no longer) an MPS client: nothing to terminate
                    try:
                        d.terminate_client(owner[c], c)
                    except MpsError as e:
                        ok = False
                        log.warning("terminate_client for pid %d failed, killing anyway: %s", c, e)
        except MpsError as e:
            ok = False
            log.warning("MPS daemon on %s does not answer, killing its client(s) anyway: %s",
                        d.name, e)
        finally:
            kill()
        return ok

    def stop_all(self) -> None:
        with self._lock:
            for uuid, d in self._daemons.items():
                d.stop()
                self._states[uuid] = "off"
            self._idle_since.clear()
            self._reported.clear()
