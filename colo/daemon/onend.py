"""What runs when a job ends, as the job's owner and never as root: its --on-end command (pueue's
callback) and the mail --mail-type asks for (where the node has a mail transfer agent).

Each runs under colo-shim (native/shim), which drops to the owner's groups, gid and uid before it
enters the job's workdir (a process job's; the owner's home for a container job) and runs
`/bin/sh -c CMD` with COLO_JOB_ID, COLO_JOB_NAME, COLO_JOB_STATE, COLO_JOB_EXIT (empty when the
job ended without a code) and COLO_JOB_REASON set; its output is added to the job's log after a
line that says so. It has ON_END_TIMEOUT seconds, then it is stopped. A daemon that stops
meanwhile leaves it to run to its end unfollowed; a job that ended while the daemon was away has
its command run when the daemon records that end.

It runs under the job's own limits (--cpus, --mem, --tasks), in a cgroup leaf of its own beside
the job's (onend-<ID>), never in the daemon's: one command allocated 300 MiB past its job's 64 MiB
there. Commands wait their turn on a few threads (WORKERS), each user at most PER_USER at once and
users taken in turn, so that 300 of one user's neither take the daemon to 300 threads nor hold
everyone else's back.

Owns: the queue of commands to run and the threads that run them.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from ..config import Config
from ..jobs import TERMINAL, Job, State
from ..node.cgroup import ONEND, CgroupError, Cgroups
from ..runtimes import process

log = logging.getLogger("colo")

ON_END_TIMEOUT = 300.0  # seconds an --on-end command (or a mail's hand-over) may take
SENDMAIL = ("/usr/sbin/sendmail", "/usr/lib/sendmail")
WHERE = "no sendmail in /usr/sbin or /usr/lib"
WORKERS = 8  # commands run at once, all users together
PER_USER = 2  # of them, one user's


class Turns:
    """Work run on at most `workers` threads (made when needed, gone when idle), at most
    `per_user` of one user's at once, the users with work waiting taken in turn."""

    def __init__(self, workers: int = WORKERS, per_user: int = PER_USER):
        self.workers, self.per_user = workers, per_user
        self.lock = threading.Lock()
        self.queues: dict[int, deque[Callable[[], None]]] = {}
        self.order: deque[int] = deque()  # users with work waiting, the next one first
        self.running: dict[int, int] = {}
        self.threads = 0

    def submit(self, uid: int, fn: Callable[[], None]) -> None:
        with self.lock:
            if uid not in self.queues:
                self.queues[uid] = deque()
                self.order.append(uid)
            self.queues[uid].append(fn)
            if self.threads < self.workers:
                self.threads += 1
                threading.Thread(target=self._work, name="colo-onend", daemon=True).start()

    def waiting(self) -> int:
        with self.lock:
            return sum(len(q) for q in self.queues.values())

    def _next(self) -> tuple[int, Callable[[], None]] | None:
        for _ in range(len(self.order)):
            uid = self.order[0]
            self.order.rotate(-1)
            if self.running.get(uid, 0) < self.per_user:
                q = self.queues[uid]
                fn = q.popleft()
                if not q:
                    del self.queues[uid]
                    self.order.remove(uid)
                self.running[uid] = self.running.get(uid, 0) + 1
                return uid, fn
        return None

    def _work(self) -> None:
        while True:
            with self.lock:
                pick = self._next()
                if pick is None:
                    self.threads -= 1
                    return
            uid, fn = pick
            try:
                fn()
            finally:
                with self.lock:
                    self.running[uid] -= 1
                    if not self.running[uid]:
                        del self.running[uid]


def transfer_agent() -> str | None:
    """The node's sendmail (any MTA installs one), or None."""
    return next((p for p in SENDMAIL if os.access(p, os.X_OK)), None)


def wants_mail(job: Job) -> bool:
    kind = job.spec.mail_type or ""
    return "END" in kind or "ALL" in kind or ("FAIL" in kind and job.state != State.SUCCEEDED)


def mail_text(job: Job, to: str) -> bytes:
    """The message sendmail -t sends: headers of colo's own words (the name is NAME-checked, the
    address validate.MAIL_USER's), the job's reason in the body."""
    name = f" ({job.spec.name})" if job.spec.name else ""
    code = f", exit code {job.exit_code}" if job.exit_code is not None else ""
    return (f"To: {to}\nSubject: colo job {job.id}{name} {job.state}{code}\n\n"
            f"colo job {job.id}{name} of {job.user} ended: {job.state}{code}.\n{job.reason}\n").encode()


class OnEnd:
    def __init__(self, config: Config, native_dir: Path, cgroups: Cgroups | None = None,
                 no_gpus: Callable[[], list[str]] | None = None):
        self.config = config
        self.native = native_dir
        self.cgroups = cgroups if cgroups is not None and cgroups.contain is not None else None
        # the device rules that keep a command from every GPU: its leaf is beneath colo's folder,
        # which a gated node's device program lets reach the GPUs (docs/gating.md)
        self.no_gpus = no_gpus
        self.folder = config.state_dir / "onend"  # the shims' exit files: root's alone
        self.turns = Turns()

    def job_changed(self, prev: Job | None, job: Job) -> None:
        """JobTable's watcher: a job that just ended runs what it asked for, in its turn (Turns)."""
        if prev is None or prev.state in TERMINAL or job.state not in TERMINAL:
            return
        mail = job.spec.mail_type and wants_mail(job)
        if not (job.spec.on_end or mail):
            return
        self.turns.submit(job.uid, lambda: self._run(job, bool(mail)))

    def _run(self, job: Job, mail: bool) -> None:
        try:
            if job.spec.on_end:
                self._as_owner(job, ["/bin/sh", "-c", job.spec.on_end], f"--on-end: {job.spec.on_end}")
            if mail and (mta := transfer_agent()):
                to = job.spec.mail_user or job.user
                self._as_owner(job, [mta, "-t"], f"--mail-type {job.spec.mail_type}: to {to}", mail_text(job, to))
        except Exception as e:  # noqa: BLE001 - a command that could not run is logged, never the daemon's end
            log.warning("job %d: what it asked to run at its end failed: %s", job.id, e)

    def _as_owner(self, job: Job, argv: list[str], said: str, stdin: bytes | None = None) -> None:
        self.folder.mkdir(mode=0o700, exist_ok=True)
        exit_file = self.folder / f"{job.id}-{threading.get_ident()}"
        env, groups, home = process.user_setup(job.uid, job.gid, {"PATH": "/usr/local/bin:/usr/bin:/bin",
                                                                 "LANG": "C.UTF-8"})
        env.update(COLO_JOB_ID=str(job.id), COLO_JOB_NAME=job.spec.name or "", COLO_JOB_STATE=str(job.state),
                   COLO_JOB_EXIT="" if job.exit_code is None else str(job.exit_code), COLO_JOB_REASON=job.reason)
        workdir = job.spec.workdir if job.spec.image is None and job.spec.workdir else home
        leaf, extra = f"{ONEND}{job.id}-{threading.get_ident()}", []
        if self.cgroups is not None and os.geteuid() == 0:
            try:  # the job's limits: --cpus, --mem, --tasks (the node's job_tasks when it gave none)
                extra = [a for d in self.cgroups.create(job.id, job.spec.cpus, job.spec.mem,
                                                        job.spec.tasks or self.config.job_tasks or None, leaf)
                         for a in ("--cgroup", str(d))]
            except (CgroupError, OSError) as e:  # its limits cannot be had: it does not run without them
                raise RuntimeError(f"no cgroup for it: {e}") from None
            try:  # and no GPU: it runs after its job, outside any budget
                self.cgroups.restrict_devices(job.id, self.no_gpus() if self.no_gpus else [], leaf)
            except (CgroupError, LookupError) as e:
                if self.config.gpu_group is not None:  # a gated node: GPU files are open to colo's folders
                    self._drop(leaf, job.id)
                    raise RuntimeError(str(e)) from None
        logf = os.open(self.config.log_path(job.id), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                       | os.O_CLOEXEC, 0o600)  # root's, in the root-only logs/ folder
        try:
            os.write(logf, f"\n[colo: {said} (as {job.user})]\n".encode(errors="replace"))
            uid = job.uid if os.geteuid() == 0 else None
            p = process.spawn(str(self.native / "colo-shim"), exit_file, argv, uid, job.gid, groups, workdir, env,
                              logf, extra, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
        except BaseException:
            self._drop(leaf, job.id)
            raise
        finally:
            os.close(logf)
        try:
            if stdin is not None:
                try:
                    p.stdin.write(stdin)
                    p.stdin.close()
                except OSError:
                    pass
            try:
                code = p.wait(ON_END_TIMEOUT)
            except subprocess.TimeoutExpired:
                log.warning("job %d: %s ran past %.0f s: stopped", job.id, said, ON_END_TIMEOUT)
                p.send_signal(signal.SIGTERM)  # passed on to the command; the shim then ends the rest
                try:
                    code = p.wait(10)
                except subprocess.TimeoutExpired:
                    for c in _tree(p.pid):
                        c.kill()
                    p.kill()
                    code = p.wait()
            if code:
                log.info("job %d: %s exited with %d", job.id, said, code)
        finally:
            for f in (exit_file, exit_file.with_name(exit_file.name + ".tmp")):
                f.unlink(missing_ok=True)
            self._drop(leaf, job.id)

    def _drop(self, leaf: str, job_id: int) -> None:
        """The command's cgroup leaves, emptied (the shim has ended what it started) and removed."""
        if self.cgroups is None:
            return
        for d in self.cgroups.dirs(job_id):
            d = d.parent / leaf
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # its last processes are still going
                    kill = d / "cgroup.kill"
                    try:
                        kill.write_text("1")
                    except OSError:
                        pass
                    time.sleep(0.1)


def _tree(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []

