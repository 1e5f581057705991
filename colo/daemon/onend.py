"""What runs when a job ends, as the job's owner and never as root: its --on-end command (pueue's
callback) and the mail --mail-type asks for (where the node has a mail transfer agent).

Each runs under colo-shim (native/shim), which drops to the owner's groups, gid and uid before it
enters the job's workdir (a process job's; the owner's home for a container job) and runs
`/bin/sh -c CMD` with COLO_JOB_ID, COLO_JOB_NAME, COLO_JOB_STATE, COLO_JOB_EXIT (empty when the
job ended without a code) and COLO_JOB_REASON set; its output is added to the job's log after a
line that says so. It has ON_END_TIMEOUT seconds, then it is stopped. A daemon that stops
meanwhile leaves it to run to its end unfollowed; a job that ended while the daemon was away has
its command run when the daemon records that end.

Owns: nothing that lasts (a thread per command, which waits for it).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

from ..config import Config
from ..jobs import TERMINAL, Job, State
from ..runtimes import process

log = logging.getLogger("colo")

ON_END_TIMEOUT = 300.0  # seconds an --on-end command (or a mail's hand-over) may take
SENDMAIL = ("/usr/sbin/sendmail", "/usr/lib/sendmail")
WHERE = "no sendmail in /usr/sbin or /usr/lib"


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
    def __init__(self, config: Config, native_dir: Path):
        self.config = config
        self.native = native_dir
        self.folder = config.state_dir / "onend"  # the shims' exit files: root's alone

    def job_changed(self, prev: Job | None, job: Job) -> None:
        """JobTable's watcher: a job that just ended runs what it asked for, on a thread of its own."""
        if prev is None or prev.state in TERMINAL or job.state not in TERMINAL:
            return
        mail = job.spec.mail_type and wants_mail(job)
        if not (job.spec.on_end or mail):
            return
        threading.Thread(target=self._run, args=(job, bool(mail)), name=f"colo-onend-{job.id}", daemon=True).start()

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
        logf = os.open(self.config.log_path(job.id), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                       | os.O_CLOEXEC, 0o600)  # root's, in the root-only logs/ folder
        try:
            os.write(logf, f"\n[colo: {said} (as {job.user})]\n".encode(errors="replace"))
            uid = job.uid if os.geteuid() == 0 else None
            p = process.spawn(str(self.native / "colo-shim"), exit_file, argv, uid, job.gid, groups, workdir, env,
                              logf, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
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


def _tree(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []

