"""Jobs as host processes: run as the submitter, in their own session, output to a log file.

A small C shim (native/shim) is the job's session leader and writes the exit code to a file,
so a job that outlives a daemon restart is followed to its end with its exit code.
"""
from __future__ import annotations

import os
import pwd
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil

from .. import native
from .base import Gone, Launch, StartError

EXIT_FILE = "exit"


def _exit_code_file(run_dir: Path) -> int | None:
    try:
        return int((run_dir / EXIT_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


class ProcessRuntime:
    name = "process"

    def __init__(self, shim: Path | None = None, base_env: dict[str, str] | None = None):
        self.shim = shim
        self.base_env = base_env if base_env is not None else {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": "C.UTF-8"}
        self._children: dict[str, subprocess.Popen] = {}
        self._run_dirs: dict[str, Path] = {}
        self._lock = threading.Lock()

    def start(self, launch: Launch) -> str:
        shim = str(self.shim or native.path("colo-shim"))
        env = dict(self.base_env)
        groups: list[int] = []
        try:
            pw = pwd.getpwuid(launch.uid)
            env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
            groups = os.getgrouplist(pw.pw_name, launch.gid)  # what the user has when logged in
        except KeyError:
            pass
        env.update(launch.env)
        (launch.run_dir / EXIT_FILE).unlink(missing_ok=True)
        as_other = os.geteuid() == 0 and launch.uid != 0
        if os.geteuid() != 0 and launch.uid != os.geteuid():
            raise StartError("this daemon is not root, so it runs jobs of its own user only")
        with open(launch.log_path, "ab", buffering=0) as log:
            try:
                p = subprocess.Popen(
                    [shim, str(launch.run_dir / EXIT_FILE), *launch.argv],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    cwd=launch.workdir or str(launch.run_dir), env=env, start_new_session=True,
                    user=launch.uid if as_other else None, group=launch.gid if as_other else None,
                    extra_groups=groups if as_other else None, close_fds=True)
            except (OSError, subprocess.SubprocessError) as e:
                raise StartError(f"cannot start process: {e}") from e
        handle = f"{p.pid}:{psutil.Process(p.pid).create_time():.3f}"
        with self._lock:
            self._children[handle] = p
            self._run_dirs[handle] = launch.run_dir
        return handle

    def remember(self, handle: str, run_dir: Path) -> None:
        """After a restart: where this job's exit file is."""
        with self._lock:
            self._run_dirs[handle] = run_dir

    def _proc(self, handle: str) -> psutil.Process | None:
        pid, _, created = handle.partition(":")
        try:
            if int(pid) <= 0:
                return None  # "0:0": it ended while colo was away, only its exit file is left
            p = psutil.Process(int(pid))
            if abs(p.create_time() - float(created)) > 0.01 or p.status() == psutil.STATUS_ZOMBIE:
                return None  # the pid was reused, or it is only a zombie left for its parent
            return p
        except (psutil.NoSuchProcess, ValueError):
            return None

    def _finished(self, handle: str) -> int:
        code = _exit_code_file(self._run_dirs[handle]) if handle in self._run_dirs else None
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
            code = _exit_code_file(self._run_dirs[handle])
            return code if code is not None else (128 - rc if rc < 0 else rc)
        p = self._proc(handle)
        if p is not None:
            try:
                p.wait()
            except psutil.NoSuchProcess:
                pass
        return self._finished(handle)

    def exit_note(self, handle: str) -> str:
        return ""

    def poll(self, handle: str) -> int | None:
        with self._lock:
            child = self._children.get(handle)
        if child is not None:
            return None if child.poll() is None else self.wait(handle)
        if self._proc(handle) is not None:
            return None
        return self._finished(handle)

    def stop(self, handle: str, grace: float) -> None:
        p = self._proc(handle)
        if p is None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self._group_gone(p.pid):
                return
            time.sleep(0.05)
        # SIGKILL the job's processes but not its shim (the group leader), so that the shim lives
        # to write the exit code: after a daemon restart that file is the only record of it.
        for _ in range(20):
            rest = self._members(p.pid, but=p.pid)
            if not rest:
                return
            for pid in rest:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        try:
            os.killpg(p.pid, signal.SIGKILL)  # it keeps forking: the whole group, shim included
        except ProcessLookupError:
            pass

    @staticmethod
    def _members(pgid: int, but: int) -> list[int]:
        """Live (not zombie) processes of group `pgid`, leaving out `but`."""
        out = []
        for q in psutil.process_iter(["pid", "status"]):
            try:
                if q.pid != but and os.getpgid(q.pid) == pgid and q.info["status"] != psutil.STATUS_ZOMBIE:
                    out.append(q.pid)
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        return out

    @staticmethod
    def _group_gone(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return not ProcessRuntime._members(pgid, but=-1)  # only zombies (waiting for our reaper) left

    def adopt(self) -> dict[int, str]:
        return {}  # process jobs are found again from the store's handles (see poll)

    def pids(self, handle: str) -> list[int]:
        p = self._proc(handle)
        if p is None:
            return []
        try:
            return [p.pid] + [c.pid for c in p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cleanup(self, handle: str) -> None:
        with self._lock:
            self._children.pop(handle, None)
