"""Finding jobs again: after a daemon restart, and when the Docker engine comes back.

Owns: when to look again at jobs the engine answered errors about, and what it last said of its
container listing. Calls: the runtimes (adopt, poll), the launcher (follow what runs, record
what ended, stop what a cancel left half done) and the job table.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

from ..config import Config
from ..jobs import ACTIVE, Job, State
from ..node import mps
from ..node.cgroup import Cgroups
from ..runtimes.base import EngineError, Gone, StartError, Unavailable
from .backoff import Backoff
from .engines import Engines
from .gpus import Gpus
from .jobtable import JobTable
from .launcher import Launcher

log = logging.getLogger("colo")


class Recovery:
    def __init__(self, config: Config, table: JobTable, engines: Engines, gpus: Gpus, launcher: Launcher,
                 cgroups: Cgroups | None, wake: Callable[..., None]):
        self.config = config
        self.table = table
        self.engines = engines
        self.gpus = gpus
        self.launcher = launcher
        self.cgroups = cgroups
        self.wake = wake
        self._engine_retry = Backoff()  # when to look again at jobs the engine answered errors about
        self._listing_said: str | None = None  # what the engine said of the container listing (logged once)

    async def recover(self) -> None:
        """Find every active job again: running on, finished while we were away, or lost."""
        m = self.gpus.mps
        if m.available():
            users = self.table.mps_users()  # a superset of those still running: each found ended revokes
            for d in self.gpus.devices:
                await asyncio.to_thread(m.adopt, d.uuid, d.index)
                try:  # the ACL again from the store, without a restart: these jobs run on it
                    await asyncio.to_thread(m.allow, d.uuid, d.index, users.get(d.uuid, ()), False)
                except mps.MpsError as e:
                    log.error("%s", e)
        await self._recover(self.table.jobs_in(*ACTIVE))
        await self.launcher.end_strays()
        if self.cgroups is not None:  # leaves of jobs that ended while colo was away
            await asyncio.to_thread(self.cgroups.sweep, {j.id for j in self.table.jobs_in(*ACTIVE)})

    async def _recover(self, jobs: list[Job]) -> None:
        """Engine errors (it answers, but 500, 409...) leave the jobs concerned as they are (a
        running job keeps running and its budget) and are tried again with a backoff
        (watch_docker); 404 for a container colo knows is its end (Gone), not an error."""
        found: dict[int, str] = {}
        listed = False
        # Jobs of other runtimes first: none waits on the Docker engine's listing (a busy engine
        # answers in up to a minute), so Slurm's and process jobs are found again at once.
        unsure = await self._recover_each([j for j in jobs if j.spec.runtime != "docker"], found, listed)
        docker = self.engines.get("docker")
        if docker is not None:
            try:
                found = await asyncio.to_thread(docker.adopt)
                listed = True
                self._listing_said = None
            except Unavailable:  # it answered the ping at start-up, not now (dockerd restarting)
                pass
            except EngineError as e:
                if self._listing_said != str(e):  # said once
                    self._listing_said = str(e)
                    log.warning("cannot list colo's containers: %s; looked for again later", e)
        unsure += await self._recover_each([j for j in jobs if j.spec.runtime == "docker"], found, listed)
        self.launcher.forget_engine_said()
        if docker is not None and docker.down is None:
            if listed:
                self.launcher.removals.remove_leftovers(found)
                await self.launcher.removals.retry_removals(every=True)
            if unsure or not listed:
                self._engine_retry.failed(time.monotonic())
            else:
                self._engine_retry.clear()

    async def _recover_each(self, jobs: list[Job], found: dict[int, str], listed: bool) -> int:
        """_recover_one for each of `jobs`; how many were left for want of an answer."""
        unsure = 0
        for job in jobs:
            try:
                unsure += await self._recover_one(job, found, listed)
            except Exception as e:  # noqa: BLE001 - one job's trouble must not stop the daemon for all
                log.exception("job %d: could not be looked at (%s); looked at again later", job.id, e)
                unsure += job.spec.runtime == "docker"
        return unsure

    async def _recover_one(self, job: Job, found: dict[int, str], listed: bool) -> bool:
        """Follow one active job again, or record its end. True: left for want of an answer."""
        table, launcher = self.table, self.launcher
        if job.spec.runtime == "docker" and self.engines.docker_away():
            # The engine is not there (yet), or stopped answering: the job may well run on. It
            # keeps its budget and is found again when the engine answers (watch_docker).
            log.warning("job %d: %s; followed again when it answers", job.id, self.engines.docker_away())
            return False
        try:
            rt = self.engines.runtime_for(job)
        except StartError as e:
            table.transition(job.id, State.LOST, f"lost: cannot follow it after a restart ({e})")
            return False
        handle = job.handle or found.get(job.id) or self._unrecorded_process(job)
        if handle is None and job.spec.runtime == "docker" and not listed:
            # its container may exist (and run): requeued now, the job could run twice
            launcher.engine_trouble(job.id, "its container could not be looked for (the listing failed)")
            return True
        if handle is None:
            if job.state == State.STARTING:
                launcher.requeue(job.id, "requeued: its start was cut short by a daemon restart")
            else:
                table.transition(job.id, State.LOST, "lost: it vanished while colo was down")
            return False
        if hasattr(rt, "remember"):
            rt.remember(handle, self.config.run_dir(job.id))
        if hasattr(rt, "follow_logs") and not job.spec.tty:  # (a session's output is its terminal's)
            # Before its state is read: a container that ended while colo was away (or ends
            # now) is removed just below, and what it wrote since its last follower's cursor
            # must be in the log first (cleanup lets the follower drain before removing it).
            rt.follow_logs(handle, self.config.log_path(job.id))
        try:
            code = await asyncio.to_thread(rt.poll, handle)
        except Unavailable as e:  # the engine went away just now: as above (its follower waits too)
            log.warning("job %d: %s; followed again when it answers", job.id, e)
            return False
        except EngineError as e:  # it answers, but not about this job: as it was, looked at again later
            launcher.engine_trouble(job.id, str(e))
            return True
        except Gone as e:
            # 404: it is over, its exit code unknown (removed behind colo's back, or between the
            # listing and this look), not an engine outage
            table.transition(job.id, State.LOST, f"lost: {e} (its exit code is unknown)")
            launcher.finish(job.id, rt, handle)
            return False
        if job.state == State.STARTING:
            table.set_fields(job.id, handle=handle)
            table.transition(job.id, State.RUNNING, "found again after a daemon restart")
        if code is not None:
            launcher.record_exit(job.id, code)
            launcher.finish(job.id, rt, handle)
            return False
        launcher.adopt(job.id, handle)
        log.info("job %d found again after restart (%s)", job.id, handle)
        if job.cancel_by:  # the daemon stopped in the middle of cancelling it: finish that
            asyncio.get_running_loop().create_task(launcher.finish_cancel(job.id, handle))
        return False

    def _unrecorded_process(self, job: Job) -> str | None:
        """A process job whose start was cut short before its handle was stored: its shim may be
        running (or have finished) all the same. Found by the exit file it was given, so that
        recovery never starts the same job twice."""
        if job.spec.runtime != "process" or job.state != State.STARTING:
            return None
        import psutil

        exit_file = str(self.config.run_dir(job.id) / "exit")
        for p in psutil.process_iter(["pid", "cmdline", "create_time", "uids"]):
            cmd = p.info["cmdline"] or []
            if (len(cmd) > 1 and cmd[0].endswith("colo-shim") and cmd[1] == exit_file
                    and p.info["uids"] is not None and p.info["uids"].real == os.geteuid()):  # a user's is not one
                return f"{p.pid}:{p.info['create_time']:.3f}"
        if os.path.exists(exit_file):
            return "0:0"  # it ran and ended while colo was away; poll() reads its exit code
        return None

    async def watch_docker(self) -> None:
        """An engine that was not there at start-up, or went away, is looked for at each tick."""
        rt = self.engines.get("docker")
        if rt is None:
            if self.engines.docker_due() and await asyncio.to_thread(self.engines.look_for_docker):
                await self._recover(self._unfollowed_docker_jobs())
                self.wake()
        elif rt.down is not None:
            if await asyncio.to_thread(rt.check):
                # Jobs recovery had to leave while it was away are found again now (then the sweep).
                await self._recover(self._unfollowed_docker_jobs())
                self.launcher.retry_cancels()  # asked for while it was away
                self.wake()
        else:
            now = time.monotonic()
            if self._engine_retry.due(now):  # jobs it answered errors about: looked at again
                await self._recover(self._unfollowed_docker_jobs())
                self.wake()
            self.launcher.retry_cancels(now)
            await self.launcher.removals.retry_removals()

    def _unfollowed_docker_jobs(self) -> list[Job]:
        """Active container jobs no task follows or starts: left by recovery for want of an engine
        (or of an answer), or whose follower ended without ending the job."""
        return [j for j in self.table.jobs_in(*ACTIVE)
                if j.spec.runtime == "docker" and not self.launcher.followed(j.id)]
