"""Finding jobs again: after a daemon restart, and when the Docker engine comes back."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time

from .. import mps
from ..jobs import ACTIVE, TERMINAL, Job, State
from ..runtimes.base import Gone, StartError, Unavailable
from .lifecycle import Live

log = logging.getLogger("colo")
DOCKER_RETRY = 5.0  # seconds between looks for an engine that was not there at start-up


class RecoveryMixin:
    """Part of Daemon (colo/daemon/core.py); uses its state."""

    async def recover(self) -> None:
        """Find every active job again: running on, finished while we were away, or lost."""
        if self.mps is not None and self.mps.available():
            users = self.mps_users()  # a superset of those still running: each found ended revokes
            for d in self.devices:
                await asyncio.to_thread(self.mps.adopt, d.uuid, d.index)
                try:  # the ACL again from the store, without a restart: these jobs run on it
                    await asyncio.to_thread(self.mps.allow, d.uuid, d.index, users.get(d.uuid, ()), False)
                except mps.MpsError as e:
                    log.error("%s", e)
        await self._recover(self.jobs_in(*ACTIVE))
        await self._end_strays()
        if self.cgroups is not None:  # leaves of jobs that ended while colo was away
            await asyncio.to_thread(self.cgroups.sweep, {j.id for j in self.jobs_in(*ACTIVE)})

    async def _recover(self, jobs: list[Job]) -> None:
        found: dict[int, str] = {}
        docker = self.runtimes.get("docker")
        if docker is not None:
            try:
                found = await asyncio.to_thread(docker.adopt)
            except Unavailable:  # it answered the ping at start-up, not now (dockerd restarting)
                pass
        for job in jobs:
            if job.spec.runtime == "docker" and self.docker_away():
                # The engine is not there (yet), or stopped answering: the job may well run on. It
                # keeps its budget and is found again when the engine answers (_watch_docker).
                log.warning("job %d: %s; followed again when it answers", job.id, self.docker_away())
                continue
            try:
                rt = self.runtime_for(job)
            except StartError as e:
                self.transition(job.id, State.LOST, f"lost: cannot follow it after a restart ({e})")
                continue
            handle = job.handle or found.get(job.id) or self._unrecorded_process(job)
            if handle is None:
                if job.state == State.STARTING:
                    self._requeue(job.id, "requeued: its start was cut short by a daemon restart")
                else:
                    self.transition(job.id, State.LOST, "lost: it vanished while colo was down")
                continue
            if hasattr(rt, "remember"):
                rt.remember(handle, self.run_dir(job.id))
            if hasattr(rt, "follow_logs"):
                # Before its state is read: a container that ended while colo was away (or ends
                # now) is removed just below, and what it wrote since its last follower's cursor
                # must be in the log first (cleanup lets the follower drain before removing it).
                rt.follow_logs(handle, self.log_path(job.id))
            try:
                code = await asyncio.to_thread(rt.poll, handle)
            except Unavailable as e:  # the engine went away just now: as above (its follower waits too)
                log.warning("job %d: %s; followed again when it answers", job.id, e)
                continue
            except Gone as e:
                self.transition(job.id, State.LOST, f"lost while colo was down: {e}")
                self._finish(job.id, rt, handle)
                continue
            if job.state == State.STARTING:
                self.set_fields(job.id, handle=handle)
                self.transition(job.id, State.RUNNING, "found again after a daemon restart")
            if code is not None:
                self.record_exit(job.id, code)
                self._finish(job.id, rt, handle)
                continue
            live = self.live.setdefault(job.id, Live())
            live.task = asyncio.get_running_loop().create_task(self.follow(job.id, handle))
            log.info("job %d found again after restart (%s)", job.id, handle)
            if job.cancel_by:  # the daemon stopped in the middle of cancelling it: finish that
                asyncio.get_running_loop().create_task(self._finish_cancel(job.id, handle))
        if docker is not None and docker.down is None:
            await self._sweep_containers(found)

    async def _end_strays(self) -> None:
        """Processes of an attempt that is over, left by a daemon that died while stopping it (an
        MPS fault requeues the job, then stops the old attempt for up to stop_grace): the store
        knows nothing of them any more. They are ended, and the job waits ("waiting for its
        earlier attempt to end") until they are gone: a new attempt would share job-<ID> with
        them, and the old shim, as it ends, kills whatever is in job-<ID> and writes the job's
        exit file."""
        rt = self.runtimes.get("process")
        if rt is None:
            return
        keep = {j.id for j in self.jobs_in(*ACTIVE)}
        for job_id in sorted(await asyncio.to_thread(rt.strays, keep, self.config.jobs_dir)):
            self._ending.add(job_id)  # before the first scheduling pass
            asyncio.get_running_loop().create_task(self._end_stray(job_id, rt))

    async def _end_stray(self, job_id: int, rt) -> None:
        try:
            delay = 1.0
            while True:
                pids = await asyncio.to_thread(rt.leftover_pids, job_id)
                log.warning("job %d: an earlier attempt left processes running (%s) when colo stopped; "
                            "ending them before the job may start again", job_id,
                            ", ".join(map(str, pids)) or "its shim")
                if await asyncio.to_thread(self._end_leftovers, job_id, rt, pids):
                    break
                log.warning("job %d: its earlier attempt is not gone yet; trying again in %.0fs", job_id, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
            if self.store.get(job_id).state in TERMINAL:
                shutil.rmtree(self.run_dir(job_id), ignore_errors=True)
        finally:
            self._ending.discard(job_id)
            self.wake()

    def _end_leftovers(self, job_id: int, rt, pids: list[int]) -> bool:
        # invariant 6: any MPS client among them is sent terminate_client before it is killed
        # (the store no longer says which GPU the attempt had: every GPU's MPS daemon is asked)
        if pids and self.mps is not None:
            for d in self.devices:
                m = self.mps.get(d.uuid)
                if m is not None and m.running():
                    self.mps.terminate_then(d.uuid, pids, lambda: None)
        return rt.end_leftovers(job_id, self.run_dir(job_id))

    async def _sweep_containers(self, found: dict[int, str]) -> None:
        """Remove this daemon's containers that no open job owns: ended while colo or the engine
        was away, or created by a start the engine cut short."""
        rt = self.runtimes["docker"]
        for job_id, handle in found.items():
            job = self.open_jobs.get(job_id)
            if job is not None and (job.handle == handle or job.state == State.STARTING):
                continue
            try:
                await asyncio.to_thread(rt.cleanup, handle)
            except Exception as e:  # noqa: BLE001 - e.g. 409 removal already in progress: the next sweep
                log.warning("container %s of job %d not removed yet: %s", handle[:12], job_id, e)
                if rt.down is not None:
                    return

    def _unrecorded_process(self, job: Job) -> str | None:
        """A process job whose start was cut short before its handle was stored: its shim may be
        running (or have finished) all the same. Found by the exit file it was given, so that
        recovery never starts the same job twice."""
        if job.spec.runtime != "process" or job.state != State.STARTING:
            return None
        import psutil

        exit_file = str(self.run_dir(job.id) / "exit")
        for p in psutil.process_iter(["pid", "cmdline", "create_time", "uids"]):
            cmd = p.info["cmdline"] or []
            if (len(cmd) > 1 and cmd[0].endswith("colo-shim") and cmd[1] == exit_file
                    and p.info["uids"] is not None and p.info["uids"].real == os.geteuid()):  # a user's is not one
                return f"{p.pid}:{p.info['create_time']:.3f}"
        if os.path.exists(exit_file):
            return "0:0"  # it ran and ended while colo was away; poll() reads its exit code
        return None

    async def _watch_docker(self) -> None:
        """An engine that was not there at start-up, or went away, is looked for at each tick."""
        rt = self.runtimes.get("docker")
        if rt is None:
            if time.monotonic() < self._docker_retry_at:
                return
            self._docker_retry_at = time.monotonic() + DOCKER_RETRY
            await asyncio.to_thread(self._init_docker)
            if "docker" in self.runtimes:
                log.warning("Docker engine found: container jobs can run")
                self.docker_error = None
                await self._recover(self._unfollowed_docker_jobs())
                self.wake()
        elif rt.down is not None and await asyncio.to_thread(rt.check):
            # Jobs recovery had to leave while it was away are found again now (then the sweep).
            await self._recover(self._unfollowed_docker_jobs())
            for j in self.jobs_in(State.RUNNING):  # cancels asked for while it was away
                if j.cancel_by and j.handle and j.spec.runtime == "docker":
                    asyncio.get_running_loop().create_task(self._finish_cancel(j.id, j.handle))
            self.wake()

    def _unfollowed_docker_jobs(self) -> list[Job]:
        """Active container jobs no task follows or starts: left by recovery for want of an engine."""
        return [j for j in self.jobs_in(*ACTIVE)
                if j.spec.runtime == "docker" and getattr(self.live.get(j.id), "task", None) is None]
