"""Finding jobs again: after a daemon restart, and when the Docker engine comes back."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time

from ..node import mps
from ..jobs import ACTIVE, TERMINAL, Job, State
from ..runtimes.base import EngineError, Gone, StartError, Unavailable
from .lifecycle import Live

log = logging.getLogger("colo")
DOCKER_RETRY = 5.0  # seconds between looks for an engine that was not there at start-up
START_RETRIES = 3  # starts of a job the engine failed (500...) tried again, after 1, 2, 4 s; then it fails


class Backoff:
    """When to try again what the engine refused: after 1 s, then twice as long each time, at most
    `cap` apart, so an engine that keeps refusing costs a call a minute, not a loop."""

    def __init__(self, first: float = 1.0, cap: float = 60.0):
        self.first, self.cap = first, cap
        self.delay = 0.0
        self.at: float | None = None  # monotonic time of the next try; None: nothing to try
        self.tries = 0

    def due(self, now: float) -> bool:
        return self.at is not None and now >= self.at

    def failed(self, now: float) -> float:
        """One more refusal: the delay before the next try."""
        self.tries += 1
        self.delay = min(self.cap, self.delay * 2 if self.delay else self.first)
        self.at = now + self.delay
        return self.delay

    def clear(self) -> None:
        self.delay, self.at, self.tries = 0.0, None, 0


class RecoveryMixin:
    """Part of Daemon (colo/daemon/core.py); uses its state."""

    def _init_recovery(self) -> None:
        self._engine_retry = Backoff()  # when to look again at jobs the engine answered errors about
        self._engine_said: dict[int, str] = {}  # job -> what the engine last said of it (logged once)
        self._removals: dict[str, tuple[int, Backoff]] = {}  # container -> its job, when to try again
        self._cleanups: set[asyncio.Task] = set()  # removals of ended jobs' containers under way
        self._cancel_retry = Backoff()  # when to try again stops of cancelled jobs the engine refused
        # queued jobs whose start the engine failed -> when to try again, what it said (_take waits for it)
        self._start_retry: dict[int, tuple[Backoff, str]] = {}

    def _start_refused(self, job_id: int, why: str) -> Job:
        """The engine failed a job's start (not the job's fault: a 500 to its container's creation):
        back to the queue as for an engine that went away, started again after a backoff, at most
        START_RETRIES times; then it fails with the engine's words."""
        b, _ = self._start_retry.get(job_id) or (Backoff(), "")
        if b.tries >= START_RETRIES:
            self._start_retry.pop(job_id, None)
            return self.transition(job_id, State.FAILED, f"failed to start: {why} (tried {b.tries + 1} times)")
        delay = b.failed(time.monotonic())
        said = f"{why} as it started; tried again in {delay:.0f} s ({b.tries} of {START_RETRIES})"
        self._start_retry[job_id] = (b, said)
        log.warning("job %d: %s", job_id, said)
        asyncio.get_running_loop().call_later(delay, self.wake)  # a full pass then starts it
        return self._requeue(job_id, f"requeued: {said}")

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
        """Engine errors (it answers, but 500, 409...) leave the jobs concerned as they are (a
        running job keeps running and its budget) and are tried again with a backoff
        (_watch_docker); 404 for a container colo knows is its end (Gone), not an error."""
        found: dict[int, str] = {}
        listed = False
        unsure = 0  # jobs left for want of an answer
        docker = self.runtimes.get("docker")
        if docker is not None:
            try:
                found = await asyncio.to_thread(docker.adopt)
                listed = True
                self._engine_said.pop(0, None)
            except Unavailable:  # it answered the ping at start-up, not now (dockerd restarting)
                pass
            except EngineError as e:
                if self._engine_said.get(0) != str(e):  # 0: the listing (no job has id 0); said once
                    self._engine_said[0] = str(e)
                    log.warning("cannot list colo's containers: %s; looked for again later", e)
        for job in jobs:
            try:
                unsure += await self._recover_one(job, found, listed)
            except Exception as e:  # noqa: BLE001 - one job's trouble must not stop the daemon for all
                log.exception("job %d: could not be looked at (%s); looked at again later", job.id, e)
                unsure += job.spec.runtime == "docker"
        for job_id in [j for j in self._engine_said if j and self._engine_said_done(j)]:
            del self._engine_said[job_id]
        if docker is not None and docker.down is None:
            if listed:
                await self._sweep_containers(found)
            if unsure or not listed:
                self._engine_retry.failed(time.monotonic())
            else:
                self._engine_retry.clear()

    async def _recover_one(self, job: Job, found: dict[int, str], listed: bool) -> bool:
        """Follow one active job again, or record its end. True: left for want of an answer."""
        if job.spec.runtime == "docker" and self.docker_away():
            # The engine is not there (yet), or stopped answering: the job may well run on. It
            # keeps its budget and is found again when the engine answers (_watch_docker).
            log.warning("job %d: %s; followed again when it answers", job.id, self.docker_away())
            return False
        try:
            rt = self.runtime_for(job)
        except StartError as e:
            self.transition(job.id, State.LOST, f"lost: cannot follow it after a restart ({e})")
            return False
        handle = job.handle or found.get(job.id) or self._unrecorded_process(job)
        if handle is None and job.spec.runtime == "docker" and not listed:
            # its container may exist (and run): requeued now, the job could run twice
            self._engine_trouble(job.id, "its container could not be looked for (the listing failed)")
            return True
        if handle is None:
            if job.state == State.STARTING:
                self._requeue(job.id, "requeued: its start was cut short by a daemon restart")
            else:
                self.transition(job.id, State.LOST, "lost: it vanished while colo was down")
            return False
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
            return False
        except EngineError as e:  # it answers, but not about this job: as it was, looked at again later
            self._engine_trouble(job.id, str(e))
            return True
        except Gone as e:
            # 404: it is over, its exit code unknown (removed behind colo's back, or between the
            # listing and this look), not an engine outage
            self.transition(job.id, State.LOST, f"lost: {e} (its exit code is unknown)")
            self._finish(job.id, rt, handle)
            return False
        if job.state == State.STARTING:
            self.set_fields(job.id, handle=handle)
            self.transition(job.id, State.RUNNING, "found again after a daemon restart")
        if code is not None:
            self.record_exit(job.id, code)
            self._finish(job.id, rt, handle)
            return False
        live = self.live.setdefault(job.id, Live())
        live.task = asyncio.get_running_loop().create_task(self.follow(job.id, handle))
        log.info("job %d found again after restart (%s)", job.id, handle)
        if job.cancel_by:  # the daemon stopped in the middle of cancelling it: finish that
            asyncio.get_running_loop().create_task(self._finish_cancel(job.id, handle))
        return False

    def _engine_trouble(self, job_id: int, words: str) -> None:
        """One line per job for what the engine said about it (again only when it says otherwise)."""
        if self._engine_said.get(job_id) != words:
            self._engine_said[job_id] = words
            log.warning("job %d: %s; left as it is (%s), looked at again later", job_id, words,
                        self.job(job_id).state)

    def _engine_said_done(self, job_id: int) -> bool:
        """The job is followed again, or over: what the engine said of it is forgotten."""
        live = self.live.get(job_id)
        return job_id not in self.open_jobs or (live is not None and live.task is not None and not live.task.done())

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
        for job_id, handle in found.items():
            job = self.open_jobs.get(job_id)
            if job is not None and (job.handle == handle or job.state == State.STARTING):
                continue
            if handle not in self._removals:  # one the engine refused is tried on its own schedule
                self._removals[handle] = (job_id, Backoff())
        await self._retry_removals(every=True)

    def _remove_later(self, job_id: int, handle: str) -> None:
        """A container of an ended job whose removal the engine refused: tried again soon."""
        b = self._removals.setdefault(handle, (job_id, Backoff()))[1]
        if b.at is None:
            b.failed(time.monotonic())

    async def _retry_removals(self, every: bool = False) -> None:
        """Remove the containers waiting for it whose time has come (every=True: all of them).
        Each is one entry, tried at most once a minute however long the engine refuses it."""
        rt = self.runtimes.get("docker")
        if rt is None or rt.down is not None:
            return
        now = time.monotonic()
        for handle, (job_id, b) in list(self._removals.items()):
            if not (every and b.at is None) and not b.due(now):
                continue
            job = self.open_jobs.get(job_id)
            if job is not None and job.handle == handle:  # its job runs in it again (not expected)
                del self._removals[handle]
                continue
            try:
                await asyncio.to_thread(rt.cleanup, handle)
            except Unavailable:
                return  # the next sweep, when the engine answers again
            except Exception as e:  # noqa: BLE001 - e.g. 409 removal already in progress: tried again
                delay = b.failed(time.monotonic())
                if b.tries == 1 or delay < b.cap or b.tries % 10 == 0:  # not a line a minute for ever
                    log.warning("container %s of job %d not removed (refused %d time%s): %s; trying again in %.0f s",
                                handle[:12], job_id, b.tries, "" if b.tries == 1 else "s", e, delay)
                continue
            del self._removals[handle]
            if b.tries:
                log.warning("container %s of job %d removed after %d refusal%s", handle[:12], job_id, b.tries,
                            "" if b.tries == 1 else "s")

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
        elif rt.down is not None:
            if await asyncio.to_thread(rt.check):
                # Jobs recovery had to leave while it was away are found again now (then the sweep).
                await self._recover(self._unfollowed_docker_jobs())
                self._retry_cancels()  # asked for while it was away
                self.wake()
        else:
            now = time.monotonic()
            if self._engine_retry.due(now):  # jobs it answered errors about: looked at again
                await self._recover(self._unfollowed_docker_jobs())
                self.wake()
            if self._cancel_retry.due(now):
                self._cancel_retry.at = None  # re-armed (later) by a stop refused again
                if not self._retry_cancels():
                    self._cancel_retry.clear()
            await self._retry_removals()

    def _retry_cancels(self) -> int:
        """Stop again the container jobs whose cancel is stored but not carried out."""
        n = 0
        for j in self.jobs_in(State.RUNNING):
            if j.cancel_by and j.handle and j.spec.runtime == "docker":
                asyncio.get_running_loop().create_task(self._finish_cancel(j.id, j.handle))
                n += 1
        return n

    def _unfollowed_docker_jobs(self) -> list[Job]:
        """Active container jobs no task follows or starts: left by recovery for want of an engine
        (or of an answer), or whose follower ended without ending the job."""
        out = []
        for j in self.jobs_in(*ACTIVE):
            task = getattr(self.live.get(j.id), "task", None)
            if j.spec.runtime == "docker" and (task is None or task.done()):
                out.append(j)
        return out
