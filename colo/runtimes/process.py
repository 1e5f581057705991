"""Jobs as host processes, each under a small root helper (native/shim) as slurmstepd is for Slurm.

The daemon starts the shim as root with the job's log already open (a root-owned file in the
root-only logs/ folder) and its exit file in the job's root-owned run folder. The shim forks; the
child joins the job's cgroup, drops to the submitter's groups, gid and uid, and only then enters
the workdir and runs the command. The shim (root) copies the output to the log under a cap, kills
whatever the job left when its main process ends, and writes the exit status where the job cannot
write. So a job that outlives a daemon restart is followed to its end with its exit code, and
nothing the job controls is ever opened by root.
"""
from __future__ import annotations

import logging
import os
import pwd
import signal
import stat
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil

from ..node import native
from ..node.cgroup import CgroupError, Cgroups
from ..node.devices import GpuNodes
from . import preload
from .base import EngineError, Gone, Launch, StartError

log = logging.getLogger("colo")
EXIT_FILE = "exit"
_EXIT_MAX = 4096
# A job's PATH unless its submitter set one (--env PATH=...): never the daemon's, which is root's
# (with root's own tool folders in it).
JOB_PATH = "/usr/local/bin:/usr/bin:/bin"


def read_exit_file(path: Path) -> tuple[int, str] | None:
    """(exit code, reason) from a shim's exit file, or None. Opened without following a symlink or
    blocking on a FIFO, and only when it is a small regular file of this daemon's user: the folder
    is root's, but a record that could have been forged is no record."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > _EXIT_MAX:
            return None
        text = os.read(fd, _EXIT_MAX).decode(errors="replace")
    finally:
        os.close(fd)
    code, _, reason = text.partition("\n")
    try:
        return int(code.strip()), reason.strip()
    except ValueError:
        return None


def user_setup(uid: int, gid: int, base: dict[str, str]) -> tuple[dict[str, str], list[int], str]:
    """What a process of `uid` starts with: `base` and HOME, USER, LOGNAME; the groups the user has
    when logged in; their home folder (or / where it is missing)."""
    env, groups, home = dict(base), [], "/"
    try:
        pw = pwd.getpwuid(uid)
        env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
        groups = os.getgrouplist(pw.pw_name, gid)
        home = pw.pw_dir if os.path.isdir(pw.pw_dir) else "/"
    except KeyError:
        pass
    return env, groups, home


def spawn(shim: str, exit_file: Path, argv: list[str], uid: int | None, gid: int, groups: list[int], workdir: str,
          env: dict[str, str], out: int, extra: list[str] = (), stdin=subprocess.DEVNULL,
          tty: int | None = None, stdio: tuple[int, int, int] | None = None) -> subprocess.Popen:
    """colo-shim running `argv` as uid:gid (None: as the daemon's own user) in `workdir`, its output
    on the descriptor `out`, its exit status to `exit_file`; `extra`: more of the shim's options;
    `tty`: a session's terminal, which the shim makes the job's controlling terminal; `stdio`: a
    session's pipes instead, which the shim makes the job's stdin, stdout and stderr."""
    args = [shim, str(exit_file), "--workdir", workdir, *extra]
    if uid is not None:
        args += ["--user", f"{uid}:{gid}:{','.join(map(str, groups))}".rstrip(":")]
    # The environment goes through a memfd, not argv (which every user can read in /proc).
    envfd = os.memfd_create("colo-env", os.MFD_CLOEXEC)
    fds = (envfd, *([] if tty is None else [tty]), *(stdio or ()))
    if tty is not None:
        args += ["--tty-fd", str(tty)]
    if stdio is not None:
        args += ["--stdio-fds", ",".join(map(str, stdio))]
    try:
        os.write(envfd, b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
        os.lseek(envfd, 0, os.SEEK_SET)
        args += ["--env-fd", str(envfd), "--", *argv]
        return subprocess.Popen(args, stdin=stdin, stdout=out, stderr=out, cwd="/",
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                start_new_session=True, pass_fds=fds, close_fds=True)
    finally:
        os.close(envfd)


def _parse(handle: str) -> tuple[int, float]:
    """A handle is "SHIM_PID:START_TIME"; the job's id comes with start() or remember()."""
    pid, _, created = handle.partition(":")
    try:
        return int(pid), float(created)
    except ValueError:
        return 0, 0.0


class ProcessRuntime:
    name = "process"
    cleanup_in_background = False  # its cleanup kills leftovers (setsid children) that may hold GPU memory
    stop_reaches_all = False  # its stop signals the process group; a setsid child is not in it

    def __init__(self, shim: Path | None = None, base_env: dict[str, str] | None = None,
                 cgroups: Cgroups | None = None, log_cap: int = 0, reserve: int = 0,
                 gpu_gid: int | None = None, gpu_nodes: GpuNodes | None = None):
        self.shim = shim
        # A gated node (docs/gating.md): GPU jobs get this group; each job's cgroup refuses the
        # device files of GPUs not its own (and a job of no GPU, all of them).
        self.gpu_gid, self.gpu_nodes = gpu_gid, gpu_nodes
        self._said_rules = False
        self.base_env = base_env if base_env is not None else {"PATH": JOB_PATH, "LANG": "C.UTF-8"}
        self.cgroups = cgroups
        self.log_cap, self.reserve = log_cap, reserve
        self._children: dict[str, subprocess.Popen] = {}
        self._run_dirs: dict[str, Path] = {}
        self._notes: dict[str, str] = {}
        self._preloaded: dict[str, Path] = {}  # handle -> log of a job that preloads the interposer
        self._attempt: dict[int, str] = {}  # job id -> handle of its latest start (which owns job-<ID>)
        self._busy: dict[int, int] = {}  # job id -> stops/cleanups acting on job-<ID> now
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a job's _busy count falls

    def start(self, launch: Launch) -> str:
        try:
            return self._start_attempt(launch)
        finally:
            for fd in ([launch.tty] if launch.tty is not None else []) + list(launch.stdio or ()):
                os.close(fd)  # the shim's child has it now (or the start failed)

    def _start_attempt(self, launch: Launch) -> str:
        shim = str(self.shim or native.path("colo-shim"))
        root = os.geteuid() == 0
        if not root and launch.uid != os.geteuid():
            raise StartError("this daemon is not root, so it runs jobs of its own user only")
        env, groups, home = user_setup(launch.uid, launch.gid, self.base_env)
        env.update(launch.env)
        with self._lock:
            # A stop or cleanup of an earlier attempt still acting on job-<ID> (it took ownership
            # before this start) would kill this one's processes there: let it finish first.
            self._idle.wait_for(lambda: not self._busy.get(launch.job_id), timeout=120)
            prior = self._attempt.get(launch.job_id)
            self._attempt[launch.job_id] = "starting"  # from here an earlier attempt's stop or cleanup leaves it
        self._end_earlier_attempt(launch.job_id, prior)
        if prior is None and self._leaf_left(launch.job_id):
            # What an attempt left that this daemon does not know (it died while stopping it):
            # the daemon ends it at its restart before starting the job again; should that ever
            # be missed, the new attempt must still not join it in job-<ID>.
            if not self.end_leftovers(launch.job_id, launch.run_dir):
                with self._lock:
                    del self._attempt[launch.job_id]
                raise StartError("processes of an earlier attempt of the job cannot be ended (in its cgroup)")
        try:
            return self._start(launch, shim, root, env, groups, home)
        except BaseException:
            with self._lock:
                if self._attempt.get(launch.job_id) == "starting":
                    del self._attempt[launch.job_id]
            raise

    def _start(self, launch: Launch, shim: str, root: bool, env: dict[str, str], groups: list[int],
               home: str) -> str:
        exit_file = launch.run_dir / EXIT_FILE
        exit_file.unlink(missing_ok=True)
        extra = ["--log-cap", str(int(self.log_cap)), "--reserve", str(int(self.reserve))]
        if root and launch.gpus and self.gpu_gid is not None:
            extra += ["--gpu-group", str(self.gpu_gid)]
        for flag, path in (("--out", launch.output), ("--err", launch.error)):
            if path:  # opened by colo-shim's writer, as the user (never by root)
                extra += [flag, path]
        if (launch.cpus or launch.mem) and self.cgroups is None:
            raise StartError("--cpus/--mem cannot be enforced here: colo has no cgroups")
        if self.cgroups is not None:
            try:
                for d in self.cgroups.create(launch.job_id, launch.cpus, launch.mem, launch.tasks):
                    extra += ["--cgroup", str(d)]
                self._hold_to_gpus(launch)
            except CgroupError as e:
                raise StartError(str(e)) from None
            except OSError as e:
                raise StartError(f"cannot make the job's cgroup: {e.strerror}") from None
        log = os.open(launch.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            p = spawn(shim, exit_file, launch.argv, launch.uid if root else None, launch.gid, groups,
                      launch.workdir or home, env, log, extra, tty=launch.tty,
                      stdio=launch.stdio)
        except (OSError, subprocess.SubprocessError) as e:
            if self.cgroups is not None:
                self.cgroups.remove(launch.job_id)
            raise StartError(f"cannot start process: {e}") from e
        finally:
            os.close(log)
        handle = f"{p.pid}:{psutil.Process(p.pid).create_time():.3f}"  # (before it is reaped)
        if self.cgroups is not None and self.cgroups.contain is not None:
            # Started means contained: a stop that came before the child joined its cgroup would
            # find the cgroup empty and leave the job to run on.
            deadline = time.monotonic() + 10
            while not self.cgroups.pids(launch.job_id) and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
        with self._lock:
            self._children[handle] = p
            self._run_dirs[handle] = launch.run_dir
            if preload.INTERPOSER in launch.env.get("LD_PRELOAD", ""):
                self._preloaded[handle] = launch.log_path
            self._attempt[launch.job_id] = handle
        return handle

    def _hold_to_gpus(self, launch: Launch) -> None:
        """Device rules on the job's cgroup: it opens only its own GPUs' files (as Slurm's
        ConstrainDevices). On a gated node a job that cannot be held so is not started (CgroupError);
        elsewhere it starts as before, said once in the log."""
        assert self.cgroups is not None
        try:
            rules = self.gpu_nodes.deny_rules(launch.gpus) if self.gpu_nodes is not None else []
            self.cgroups.restrict_devices(launch.job_id, rules)
        except (CgroupError, LookupError) as e:
            if self.gpu_gid is not None:
                self.cgroups.remove(launch.job_id)
                raise CgroupError(str(e)) from None
            if not self._said_rules:
                self._said_rules = True
                log.warning("jobs are not held to their own GPUs' device files: %s", e)

    def _end_earlier_attempt(self, job_id: int, prior: str | None) -> None:
        """A requeued job (MPS fault) starts again only once its earlier attempt has ended: both
        would share the cgroup job-<ID>, and the old shim empties it as it ends."""
        p = self._proc(prior) if prior not in (None, "starting") else None
        if p is None:
            return
        if self.cgroups is not None:
            self.cgroups.kill(job_id)
        self._signal_tree(p, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while self._proc(prior) is not None and time.monotonic() < deadline:  # (not reaped here: its
            time.sleep(0.02)                                                  # follower waits on it)

    def _shims(self, exit_file: str) -> list[psutil.Process]:
        """Live shims started for this exit file (so of this job), by this daemon's user: the
        same test as recovery's, with the owner checked (a user's process named colo-shim is
        not one)."""
        out = []
        me = os.geteuid()
        for p in psutil.process_iter(["cmdline", "uids", "status"]):
            cmd = p.info["cmdline"] or []
            if (len(cmd) > 1 and cmd[0].endswith("colo-shim") and cmd[1] == exit_file
                    and p.info["uids"] is not None and p.info["uids"].real == me
                    and p.info["status"] != psutil.STATUS_ZOMBIE):
                out.append(p)
        return out

    def _leaf_left(self, job_id: int) -> bool:
        """Is job-<ID> still there? A shim removes it as the last thing it does, so a leaf there
        (and no attempt known) may be an earlier attempt's, still acting on it."""
        c = self.cgroups
        return c is not None and c.contain is not None and (c.contain / f"job-{job_id}").exists()

    def leftover_pids(self, job_id: int) -> list[int]:
        """Processes in job-<ID> (for a job with no attempt running: what an earlier one left)."""
        return self.cgroups.pids(job_id) if self.cgroups is not None else []

    def strays(self, keep: set[int], jobs_dir: Path) -> set[int]:
        """Jobs (not in `keep`) whose earlier attempt left processes behind: in their cgroup, or a
        shim still running. After a daemon that died while stopping an attempt (MPS fault)."""
        found = set()
        if self.cgroups is not None and self.cgroups.contain is not None:
            try:
                names = os.listdir(self.cgroups.contain)
            except OSError:
                names = []
            for n in names:
                if n.startswith("job-") and n[4:].isdigit() and int(n[4:]) not in keep and self.cgroups.pids(int(n[4:])):
                    found.add(int(n[4:]))
        prefix = str(jobs_dir) + "/"
        for p in psutil.process_iter(["cmdline", "uids", "status"]):
            cmd = p.info["cmdline"] or []
            if len(cmd) > 1 and cmd[0].endswith("colo-shim") and cmd[1].startswith(prefix):
                rest = cmd[1][len(prefix):]
                job, _, name = rest.partition("/")
                if (name == EXIT_FILE and job.isdigit() and int(job) not in keep and p.info["uids"] is not None
                        and p.info["uids"].real == os.geteuid() and p.info["status"] != psutil.STATUS_ZOMBIE):
                    found.add(int(job))
        return found

    def end_leftovers(self, job_id: int, run_dir: Path, timeout: float = 60.0) -> bool:
        """End what an earlier attempt of a job left (processes in job-<ID>, its shim) and wait
        until it is gone; True once nothing is left. Only for a job with no attempt of this
        daemon's running: everything of the job then is an earlier attempt's. The shim goes too,
        for it acts on job-<ID> (cgroup.kill, rmdir) and the job's exit file as it ends."""
        exit_file = str(run_dir / EXIT_FILE)
        deadline = time.monotonic() + timeout
        if self.cgroups is not None and self.cgroups.contain is not None:
            if not self.cgroups.kill(job_id, timeout):
                return False
        else:
            for p in self._shims(exit_file):  # no cgroup: the shim's descendants (its subreaper)
                self._signal_tree(p, signal.SIGKILL)
        # A shim whose job's processes are gone records the exit and ends by itself (then its
        # last lines are in the log); one that does not is killed.
        soft = min(deadline, time.monotonic() + 10)
        while (shims := self._shims(exit_file)) and time.monotonic() < soft:
            time.sleep(0.05)
        for p in shims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        while (shims := self._shims(exit_file)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if shims or self.leftover_pids(job_id):
            return False
        if self.cgroups is not None:
            self.cgroups.remove(job_id)
        return True

    def _owns(self, handle: str, job: int | None) -> bool:
        """Is this handle the job's latest start (so the job's cgroup is its own)?"""
        with self._lock:
            return job is not None and self._attempt.get(job, handle) == handle

    @contextmanager
    def _owning(self, handle: str, job: int | None):
        """Whether this handle owns job-<ID>; while True, a new start of the job waits (ownership
        checked once, then acted on for seconds: a start in between would be killed with it)."""
        with self._lock:
            own = job is not None and self._attempt.get(job, handle) == handle
            if own:
                self._busy[job] = self._busy.get(job, 0) + 1
        try:
            yield own
        finally:
            if own:
                with self._lock:
                    n = self._busy.pop(job) - 1
                    if n:
                        self._busy[job] = n
                    self._idle.notify_all()

    def remember(self, handle: str, run_dir: Path) -> None:
        """After a restart: where this job's exit file is."""
        with self._lock:
            self._run_dirs[handle] = run_dir
        job = self._job_id(handle)
        if job is not None:
            with self._lock:
                self._attempt.setdefault(job, handle)

    def _job_id(self, handle: str) -> int | None:
        """From the run folder the handle was started (or found again) with: jobs/<ID>."""
        run_dir = self._run_dirs.get(handle)
        return int(run_dir.name) if run_dir is not None and run_dir.name.isdigit() else None

    def _proc(self, handle: str) -> psutil.Process | None:
        pid, created = _parse(handle)
        try:
            if pid <= 0:
                return None  # "0:0": it ended while colo was away, only its exit file is left
            p = psutil.Process(pid)
            if abs(p.create_time() - created) > 0.01 or p.status() == psutil.STATUS_ZOMBIE:
                return None  # the pid was reused, or it is only a zombie left for its parent
            return p
        except psutil.NoSuchProcess:
            return None

    def _exit(self, handle: str) -> int | None:
        run_dir = self._run_dirs.get(handle)
        got = read_exit_file(run_dir / EXIT_FILE) if run_dir is not None else None
        if got is None:
            return None
        code, reason = got
        if reason:
            with self._lock:
                self._notes[handle] = reason
        return code

    def _finished(self, handle: str) -> int:
        code = self._exit(handle)
        if code is None:
            raise Gone("the job's process ended without leaving an exit code (killed with its shim?)")
        return code

    def wait(self, handle: str) -> int:
        with self._lock:
            child = self._children.get(handle)
        if child is not None:
            rc = child.wait()
            with self._lock:
                self._children.pop(handle, None)
            code = self._exit(handle)
            return code if code is not None else (128 - rc if rc < 0 else rc)
        p = self._proc(handle)
        if p is not None:
            try:
                p.wait()
            except psutil.NoSuchProcess:
                pass
        return self._finished(handle)

    def exit_note(self, handle: str) -> str:
        with self._lock:
            notes, log_path = [self._notes.get(handle, "")], self._preloaded.get(handle)
        if log_path is not None:  # (not known for a job found again after a restart)
            notes.append(preload.note(log_path))
        return "; ".join(n for n in notes if n)

    def poll(self, handle: str) -> int | None:
        with self._lock:
            child = self._children.get(handle)
        if child is not None:
            return None if child.poll() is None else self.wait(handle)
        if self._proc(handle) is not None:
            return None
        return self._finished(handle)

    def stop(self, handle: str, grace: float) -> None:
        """SIGTERM to every process of the job, SIGKILL to what is left after `grace`. The shim
        (root, outside the job's cgroup) lives on to record the exit code."""
        job = self._job_id(handle)
        if self.cgroups is not None:
            with self._owning(handle, job) as own:
                if own and self.cgroups.pids(job):
                    self.cgroups.signal(job, signal.SIGTERM)
                    deadline = time.monotonic() + grace
                    while time.monotonic() < deadline and not self.cgroups.empty(job):
                        time.sleep(0.05)
                    self.cgroups.kill(job)
                    return
        # No cgroup (or a job started by an older colo): the shim's descendants (it is their subreaper).
        p = self._proc(handle)
        if p is None:
            return
        self._signal_tree(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._descendants(p):
            time.sleep(0.05)
        for _ in range(200):
            if not self._signal_tree(p, signal.SIGKILL):
                return
            time.sleep(0.05)

    def pause(self, handle: str) -> None:
        self._freeze(handle, True)

    def resume(self, handle: str) -> None:
        self._freeze(handle, False)

    def _freeze(self, handle: str, on: bool) -> None:
        """The job's cgroup frozen or thawed, whole: cgroup v2's cgroup.freeze (on hybrid hosts too,
        where the v2 leaf contains the job), or the v1 freezer when that hierarchy contains it.
        Returns once the kernel says it is so (a freeze waits for tasks in the kernel to stop)."""
        job = self._job_id(handle)
        c = self.cgroups
        if c is None or c.contain is None or job is None:
            raise EngineError("cannot pause here: process jobs run without a cgroup of their own (the daemon "
                              "is not root, or no cgroup hierarchy is available to it)")
        with self._owning(handle, job) as own:
            if not own:
                raise Gone(f"job {job}'s attempt {handle} no longer owns its cgroup")
            d = c.contain / f"job-{job}"
            if c.v2:  # cgroup.events says "frozen 1" once every task has stopped
                ctl, value = d / "cgroup.freeze", "1" if on else "0"
                state = lambda: _events(d).get("frozen")  # noqa: E731
            elif (d / "freezer.state").exists():  # reads FREEZING until it is FROZEN
                ctl, value = d / "freezer.state", "FROZEN" if on else "THAWED"
                state = lambda: _read(ctl)  # noqa: E731
            else:
                raise EngineError("cannot pause here: the cgroup hierarchy that contains process jobs has no freezer")
            try:
                fd = os.open(ctl, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(fd, value.encode())
                finally:
                    os.close(fd)
            except FileNotFoundError:
                raise Gone(f"job {job}'s cgroup is gone (it ended)") from None
            except OSError as e:
                raise EngineError(f"cannot {'freeze' if on else 'thaw'} job {job}'s cgroup: {e.strerror}") from None
            deadline = time.monotonic() + 10
            while state() != value and time.monotonic() < deadline:
                time.sleep(0.01)

    def signal(self, handle: str, sig: int) -> None:
        """`sig` to the job's main process: sent to its shim, which passes it on (HUP INT QUIT USR1
        USR2 TERM). Raises Gone when the shim has ended."""
        p = self._proc(handle)
        if p is None:
            raise Gone("the job's process has ended")
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            raise Gone("the job's process has ended") from None

    def lost_terminal(self, handle: str) -> bool | None:
        """Does the job's command (the shim's child, which leads a session of its own) have no
        controlling terminal? A session's terminal hanging up (its master end closed: the client
        that held it went away) takes it from every process of the session. None: cannot tell
        (the shim has ended or has no child). Also True for a moment while the command starts
        (before it takes its terminal): the caller looks twice."""
        p = self._proc(handle)
        if p is None:
            return None
        try:
            kids = p.children()
        except psutil.NoSuchProcess:
            return None
        for c in kids:
            try:
                with open(f"/proc/{c.pid}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if len(fields) > 4 and fields[3] == str(c.pid).encode():  # it leads its session: the command
                return fields[4] == b"0"  # tty_nr
        return None

    @staticmethod
    def _descendants(p: psutil.Process) -> list[psutil.Process]:
        try:
            return [c for c in p.children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
        except psutil.NoSuchProcess:
            return []

    def _signal_tree(self, p: psutil.Process, sig: int) -> int:
        procs = self._descendants(p)
        for c in procs:
            try:
                c.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        return len(procs)

    def adopt(self) -> dict[int, str]:
        return {}  # process jobs are found again from the store's handles (see poll)

    def pids(self, handle: str) -> list[int]:
        job = self._job_id(handle)
        got = self.cgroups.pids(job) if self.cgroups is not None and self._owns(handle, job) else []
        if got:
            return got
        p = self._proc(handle)  # no cgroup, or a job started by an older colo
        return [c.pid for c in self._descendants(p)] if p is not None else []

    def cgroup_paths(self, handle: str) -> dict[str, str]:
        job = self._job_id(handle)
        if self.cgroups is None or job is None or not self._owns(handle, job):
            return {}
        return self.cgroups.paths(job)

    def cleanup(self, handle: str) -> None:
        """Nothing of the job runs on (its shim may have been killed): empty its cgroup, remove it."""
        with self._lock:
            self._children.pop(handle, None)
            self._notes.pop(handle, None)
            self._preloaded.pop(handle, None)
        job = self._job_id(handle)
        if self.cgroups is None:
            return
        with self._owning(handle, job) as own:
            if not own:
                return
            self.cgroups.kill(job)
            self.cgroups.remove(job)
            with self._lock:
                if self._attempt.get(job) == handle:
                    del self._attempt[job]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _events(d: Path) -> dict[str, str]:
    """A cgroup v2 leaf's cgroup.events (populated, frozen) as a dict."""
    return dict(ln.split(None, 1) for ln in _read(d / "cgroup.events").splitlines() if " " in ln)
