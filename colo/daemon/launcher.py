"""A job's life after the scheduler picked it: launch, follow to its exit, cancel and stop.

The launcher is the one part that acts on jobs' processes (pueue's task handler): others ask it.
Owns: `live` (active jobs' tasks and stop flags), starts the engine failed and when to try them
again, stops the engine refused, containers still to be removed (`removals`: removals.py),
attempts still ending (an MPS fault, or a daemon that died while stopping one: the job may not
start again before), and what the engine last said of each job. Calls: the job table (every state
change), the runtimes, the GPUs (MPS), the learner (at starts and ends) and `wake` (the scheduler
runs again).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass

from pathlib import Path
from typing import Callable

from ..config import Config
from ..jobs import ACTIVE, TERMINAL, Job, Mode, State
from ..node import interposer, mps
from ..runtimes.base import EngineError, Gone, StartError, Unavailable
from ..sched import policy
from ..store import StoreError
from ..units import format_duration, format_size
from .backoff import Backoff
from .blocking import blocking
from .engines import Engines
from .gpus import Gpus
from .jobtable import JobTable
from .launchspec import build_launch
from .patrol import uid_of
from .removals import Removals

log = logging.getLogger("colo")


@dataclass
class Live:
    """What the daemon knows about an active job beyond the store."""
    task: asyncio.Task | None = None
    stopping: bool = False
    timed_out: bool = False  # stopped by the daemon at its --time limit


START_RETRIES = 3  # starts of a job the engine failed (500...) tried again, after 1, 2, 4 s; then it fails


class Launcher:
    def __init__(self, config: Config, table: JobTable, engines: Engines, gpus: Gpus, native_dir: Path,
                 learner, wake: Callable[..., None], renew: Callable[[Job], int] | None = None):
        self.config = config
        self.table = table
        self.engines = engines
        self.gpus = gpus
        self.native = native_dir
        self.learner = learner  # learn, finished, grown_budget, start_neighbours
        self.wake = wake
        self.live: dict[int, Live] = {}
        # Requeued jobs whose earlier attempt is still being stopped (an MPS fault, or strays a
        # dead daemon left): not started again before it has ended, as both would share the
        # job's cgroup and run folder.
        self._ending: set[int] = set()
        # queued jobs whose start the engine failed -> when to try again, what it said
        self._start_retry: dict[int, tuple[Backoff, str]] = {}
        self._cancel_retry = Backoff()  # when to try again stops of cancelled jobs the engine refused
        self._engine_said: dict[int, str] = {}  # job -> what the engine last said of it (logged once)
        self.removals = Removals(table, engines)  # containers of ended jobs still to be removed
        # sessions' jobs (op `session`) -> the slave end of the pty the daemon made (or the socket, or
        # the three pipes, of one without a terminal), until the start hands it to the job
        # (colo/daemon/session.py)
        self._terminals: dict[int, int | tuple[int, int, int]] = {}
        self._kept: set[int] = set()  # of those, detached sessions' (detach.py)
        # a detached session's terminal made again (its master kept), for one that lost its own
        # in a restart while queued: its slave end (session.renew)
        self.renew = renew

    def job_changed(self, prev: Job | None, job: Job) -> None:
        """The table's on_change (wired in core.open())."""
        if job.state in TERMINAL:
            self._start_retry.pop(job.id, None)  # e.g. cancelled while it waited to start again
            self.drop_terminal(job.id)

    # sessions' terminals ----------------------------------------------------------------------
    def give_terminal(self, job_id: int, fd: int | tuple[int, int, int], kept: bool = False) -> None:
        """The terminal a session's job starts on (the launcher closes it); `kept`: a detached
        session's (the runtime marks it so, to find it again after a restart). Without a terminal
        (its spec's `pipe`): a container's socket (runtimes/ttyrelay.py), a host job's three pipes."""
        self.drop_terminal(job_id)
        self._terminals[job_id] = fd
        if kept:
            self._kept.add(job_id)

    def drop_terminal(self, job_id: int) -> None:
        """The session ended before its job started, or its client went away: the slave end goes."""
        fd = self._terminals.pop(job_id, None)
        self._kept.discard(job_id)
        for end in fd if isinstance(fd, tuple) else () if fd is None else (fd,):
            os.close(end)

    # what the scheduler asks ------------------------------------------------------------------
    def start_wait(self, job_id: int) -> str | None:
        """Why a queued job may not start yet for reasons of its own processes, or None."""
        if job_id in self._ending:
            return "waiting for its earlier attempt to end"
        if (retry := self._start_retry.get(job_id)) and retry[0].at is not None and retry[0].at > time.monotonic():
            return f"waiting to start again: {retry[1]}"
        return None

    # starting ---------------------------------------------------------------------------------
    def start(self, d: policy.Decision) -> None:
        mode = Mode(d.mode) if d.mode else Mode.TIMESLICED
        prev = self.table.job(d.job_id)
        fields = {}
        budget = d.details.get("budget", prev.spec.gpu_mem)
        if budget != prev.spec.gpu_mem and prev.spec.grow and prev.spec.gpus:
            # started with more than asked (--grow only): the budget everything counts from now on,
            # stored in the transition that starts it, so a restarted daemon counts it too
            fields["spec"] = json.dumps(dataclasses.replace(prev.spec, gpu_mem=int(budget),
                                                            asked_mem=prev.spec.gpu_mem).to_dict())
        job = self.table.transition(d.job_id, State.STARTING, d.reason, gpus=list(d.gpus), mode=mode,
                                    attempts=prev.attempts + 1,
                                    neighbours=self.learner.start_neighbours(d.job_id, d.gpus),
                                    **fields)  # one transaction
        live = self.live.setdefault(job.id, Live())
        live.task = asyncio.get_running_loop().create_task(self._launch_and_follow(job, d))

    def build_launch(self, job: Job, d: policy.Decision):
        """What a job starts with (blocking: files, MPS; run in a thread)."""
        return build_launch(self.config, self.gpus, self.native, self.table.mps_users, job, d)

    async def _launch_and_follow(self, job: Job, d: policy.Decision) -> None:
        try:
            rt = self.engines.runtime_for(job)
            launch = await asyncio.to_thread(self.build_launch, job, d)
            if job.spec.tty:  # the runtime closes it once the job has it
                ends = self._terminals.pop(job.id, None)
                if isinstance(ends, tuple):  # a host session's pipes (the shim's --stdio-fds)
                    launch.stdio = ends
                else:
                    launch.tty = ends
                launch.kept, launch.pipe = job.id in self._kept, job.spec.pipe
                self._kept.discard(job.id)
                if launch.tty is None and job.spec.detached and self.renew is not None:  # lost in a restart
                    launch.tty, launch.kept = self.renew(job), True
                if launch.tty is None and launch.stdio is None:
                    raise StartError("its terminal is gone (the session's client hung up, or colo restarted, "
                                     "before it started)")
            handle = await asyncio.to_thread(rt.start, launch)
        except asyncio.CancelledError:
            raise
        except Unavailable as e:  # the engine went away: not the job's fault, it starts when it is back
            why = f"requeued: {e} as it started"
            await self._durably(lambda: self.requeue(job.id, why))
            self.finish(job.id)
            return
        except EngineError as e:  # it answers, but failed the start (500): requeued as above, a few times
            said = str(e)
            await self._durably(lambda: self._start_refused(job.id, said))
            self.finish(job.id)
            return
        except Exception as e:  # noqa: BLE001 - whatever it was, the job must not stay "starting"
            reason = str(e) if isinstance(e, (StartError, mps.MpsError, OSError)) else f"{e.__class__.__name__}: {e}"
            await self._durably(lambda: self.table.transition(job.id, State.FAILED, f"failed to start: {reason}"))
            self.finish(job.id)
            return
        self._start_retry.pop(job.id, None)
        await self._durably(lambda: self.table.set_fields(job.id, handle=handle))
        said = f"started ({job.spec.runtime})"
        if job.spec.asked_mem is not None:  # what ls shows of it while it runs
            said += f" with {format_size(job.spec.gpu_mem)} (asked {format_size(job.spec.asked_mem)}, --grow)"
        await self._durably(lambda: self.table.transition(job.id, State.RUNNING, said))
        if self.table.job(job.id).cancel_by:  # cancelled while it was starting
            await self.finish_cancel(job.id, handle)
        await self.follow(job.id, handle)

    def _start_refused(self, job_id: int, why: str) -> Job:
        """The engine failed a job's start (not the job's fault: a 500 to its container's creation):
        back to the queue as for an engine that went away, started again after a backoff, at most
        START_RETRIES times; then it fails with the engine's words."""
        b, _ = self._start_retry.get(job_id) or (Backoff(), "")
        if b.tries >= START_RETRIES:
            self._start_retry.pop(job_id, None)
            return self.table.transition(job_id, State.FAILED, f"failed to start: {why} (tried {b.tries + 1} times)")
        delay = b.failed(time.monotonic())
        said = f"{why} as it started; tried again in {delay:.0f} s ({b.tries} of {START_RETRIES})"
        self._start_retry[job_id] = (b, said)
        log.warning("job %d: %s", job_id, said)
        asyncio.get_running_loop().call_later(delay, self.wake)  # a full pass then starts it
        return self.requeue(job_id, f"requeued: {said}")

    def requeue(self, job_id: int, reason: str) -> Job:
        """Back to the queue, unless a cancel was asked for meanwhile."""
        job = self.table.job(job_id)
        if job.cancel_by:
            return self.table.transition(job_id, State.CANCELLED, f"cancelled by {job.cancel_by} before it started")
        return self.table.transition(job_id, State.QUEUED, reason)

    async def _durably(self, write):
        """A store write that must happen (a job's end, its start): retried while the disk is full."""
        delay = 0.5
        while True:
            try:
                return write()
            except StoreError as e:
                log.error("cannot record to the store (%s); retrying in %.0fs", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    # following --------------------------------------------------------------------------------
    def adopt(self, job_id: int, handle: str) -> None:
        """Follow an active job that runs (found again after a restart, or started by Slurm)."""
        live = self.live.setdefault(job_id, Live())
        live.task = asyncio.get_running_loop().create_task(self.follow(job_id, handle))

    def followed(self, job_id: int) -> bool:
        """A task follows (or starts) the job now."""
        task = getattr(self.live.get(job_id), "task", None)
        return task is not None and not task.done()

    async def follow(self, job_id: int, handle: str) -> None:
        job = self.table.job(job_id)
        rt = self.engines.runtime_for(job)
        timer = (asyncio.get_running_loop().create_task(self._time_limit(job_id, handle))
                 if job.spec.time else None)
        try:
            delay = 1.0
            while True:
                try:
                    code = await blocking(rt.wait, handle)
                    break
                except EngineError as e:  # it answers, but an error: the job is as it was; wait again
                    self.engine_trouble(job_id, str(e))
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 60.0)
            self._engine_said.pop(job_id, None)
        except Unavailable:
            return  # colo is stopping while the engine is away: found again at the next start
        except Gone as e:
            by = self.table.job(job_id).cancel_by
            reason = f"cancelled by {by} ({e})" if by else f"lost: {e} (its exit code is unknown)"
            await self._durably(lambda: self.table.transition(job_id, State.CANCELLED if by else State.LOST, reason))
            self.finish(job_id, rt, handle)
            return
        except asyncio.CancelledError:
            return  # the daemon is stopping; the job runs on and is found again at restart
        finally:
            if timer is not None:
                timer.cancel()
        job = await self._durably(lambda: self.record_exit(job_id, code))
        if job.state == State.SUCCEEDED:
            self.learner.learn(job)
        self.finish(job_id, rt, handle)

    async def _time_limit(self, job_id: int, handle: str) -> None:
        """--time: stop the job when its wall time is up (counted from its start, also across a
        daemon restart)."""
        job = self.table.job(job_id)
        started = job.started_at or time.time()
        await asyncio.sleep(max(0.0, started + job.spec.time - time.time()))
        job = self.table.job(job_id)
        if job.state != State.RUNNING or job.cancel_by:
            return
        live = self.live.setdefault(job_id, Live())
        if live.stopping:
            return
        live.timed_out = True
        log.info("job %d reached its time limit of %s: stopping it", job_id, format_duration(job.spec.time))
        delay = 1.0
        while True:
            try:
                await self._stop(job_id, handle)
                return
            except Exception as e:  # noqa: BLE001 - the job's end is still followed; say why it runs on
                live.stopping = False
                log.warning("job %d: stopping it at its time limit failed: %s; trying again in %.0f s",
                            job_id, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 60.0)
            job = self.table.job(job_id)
            if job.state != State.RUNNING or job.cancel_by or live.stopping:
                return

    def _timed_out(self, job: Job, code: int) -> bool:
        live = self.live.get(job.id)
        if live is not None and live.timed_out:
            return True
        # after a restart: it ended, killed, past its limit (the daemon that stopped it died since)
        return bool(job.spec.time and job.started_at and code > 128
                    and time.time() >= job.started_at + job.spec.time)

    def record_exit(self, job_id: int, code: int) -> Job:
        table = self.table
        refused = self._refused(job_id)
        note = (f"; {refused} allocation(s) refused by its budget of {format_size(table.job(job_id).spec.gpu_mem)}"
                if refused else "")
        job = table.job(job_id)
        if job.handle and (rt := self.engines.get(job.spec.runtime)) is not None:
            extra = rt.exit_note(job.handle)
            note += f"; {extra}" if extra else ""
        if job.cancel_by:
            stop_sent = job_id in self.live and self.live[job_id].stopping
            if code == 0 and not stop_sent:  # it ended on its own; the cancel came too late to matter
                return table.transition(job_id, State.SUCCEEDED, f"exited with code 0 before the cancel by "
                                        f"{job.cancel_by} reached it{note}", exit_code=0)
            first = "the stop was sent first, " if stop_sent else ""
            return table.transition(job_id, State.CANCELLED, f"cancelled by {job.cancel_by} ({first}then it "
                                    f"exited with code {_code_text(code)})", exit_code=code)
        if self._timed_out(job, code):
            return table.transition(job_id, State.FAILED, f"stopped at its time limit of "
                                    f"{format_duration(job.spec.time)} (exited with code {_code_text(code)}){note}",
                                    exit_code=code)
        if code == 0:
            return table.transition(job_id, State.SUCCEEDED, f"exited with code 0{note}", exit_code=0)
        if refused and job.spec.grow and (bigger := self.learner.grown_budget(job)) is not None:
            spec = dataclasses.replace(job.spec, gpu_mem=bigger, grow=False, asked_mem=None)  # once
            return table.transition(job_id, State.QUEUED, f"exited with code {_code_text(code)}{note}; requeued "
                                    f"with budget {format_size(bigger)} (--grow)", spec=json.dumps(spec.to_dict()))
        return table.transition(job_id, State.FAILED, f"exited with code {_code_text(code)}{note}", exit_code=code)

    def _refused(self, job_id: int) -> int:
        try:
            return interposer.read_ledger(self.config.run_dir(job_id) / "ledger").refused
        except Exception:  # noqa: BLE001 - no ledger (CPU job) or unreadable: nothing to add
            return 0

    def finish(self, job_id: int, rt=None, handle: str | None = None) -> None:
        """A job is over (its end recorded): its container or cgroup goes, its run folder too."""
        self.live.pop(job_id, None)
        self.learner.finished(job_id)
        if rt is not None and handle:
            self.removals.clean_up(job_id, rt, handle)
        shutil.rmtree(self.config.run_dir(job_id), ignore_errors=True)  # the ledger goes with the job
        self.gpus.revoke_mps_access(self.table.mps_users())  # its uid keeps access only for its other MPS jobs
        self.wake()

    def stop_following(self) -> None:
        """The daemon stops: followers end, the jobs run on (found again at the next start)."""
        for live in list(self.live.values()):
            if live.task:
                live.task.cancel()

    # the engine's errors ----------------------------------------------------------------------
    def engine_trouble(self, job_id: int, words: str) -> None:
        """One line per job for what the engine said about it (again only when it says otherwise)."""
        if self._engine_said.get(job_id) != words:
            self._engine_said[job_id] = words
            log.warning("job %d: %s; left as it is (%s), looked at again later", job_id, words,
                        self.table.job(job_id).state)

    def forget_engine_said(self) -> None:
        """Jobs followed again, or over: what the engine said of them is forgotten."""
        for job_id in [j for j in self._engine_said if j not in self.table.open or self.followed(j)]:
            del self._engine_said[job_id]

    # cancelling and stopping ------------------------------------------------------------------
    async def cancel(self, job_id: int, by: str) -> Job:
        job = self.table.job(job_id)
        if job.state in TERMINAL:
            return job
        if job.state == State.QUEUED:
            return self.table.transition(job_id, State.CANCELLED, f"cancelled by {by} before it started")
        self.table.set_fields(job_id, cancel_by=by)  # first, so that a crash from here on still ends in a cancel
        if job.handle:  # else it is starting: stopped as soon as it has a handle
            await self.finish_cancel(job_id, job.handle)
        return self.table.job(job_id)

    async def finish_cancel(self, job_id: int, handle: str) -> None:
        """Stop a job whose cancel is stored (once at a time). An engine that is away is left to
        recovery's watch, which calls this again when it answers."""
        live = self.live.setdefault(job_id, Live())
        if live.stopping:
            return
        try:
            await self._stop(job_id, handle)
        except Unavailable:
            live.stopping = False
        except EngineError as e:  # the cancel is stored: retry_cancels tries it again
            live.stopping = False
            log.warning("job %d: stopping it was refused: %s; trying again later", job_id, e)
            self._cancel_retry.failed(time.monotonic())
        except Exception:
            live.stopping = False  # a later cancel may try again
            raise

    def retry_cancels(self, now: float | None = None) -> int:
        """Stop again the container jobs whose cancel is stored but not carried out (now: only
        when the backoff of refused stops is due)."""
        if now is not None:
            if not self._cancel_retry.due(now):
                return 0
            self._cancel_retry.at = None  # re-armed (later) by a stop refused again
        n = 0
        for j in self.table.jobs_in(State.RUNNING):
            if j.cancel_by and j.handle and j.spec.runtime == "docker":
                asyncio.get_running_loop().create_task(self.finish_cancel(j.id, j.handle))
                n += 1
        if now is not None and not n:
            self._cancel_retry.clear()
        return n

    async def signal(self, job_id: int, handle: str, sig: int) -> bool:
        """`sig` to a running job's main process; False: its runtime cannot (containers, Slurm)."""
        rt = self.engines.runtime_for(self.table.job(job_id))
        send = getattr(rt, "signal", None)
        if send is None:
            return False
        await asyncio.to_thread(send, handle, sig)
        return True

    async def _say_stop(self, job: Job, handle: str) -> None:
        """Slurm: who cancels the job, written on it while it still exists in Slurm (before any
        terminate_client or kill, which may end it at once; Slurm takes no note on an ended job)."""
        rt = self.engines.runtime_for(job)
        if hasattr(rt, "say_stop"):
            await asyncio.to_thread(rt.say_stop, handle)

    async def _stop(self, job_id: int, handle: str) -> None:
        live = self.live.setdefault(job_id, Live())
        live.stopping = True
        job = self.table.store.get(job_id)
        rt = self.engines.runtime_for(job)

        def stop() -> None:
            if job.paused_by:  # frozen: a SIGTERM would wait for the thaw
                try:
                    rt.resume(handle)
                except EngineError as e:
                    log.warning("job %d: thawing it before its stop: %s", job_id, e)
            rt.stop(handle, self.config.stop_grace)

        await self._say_stop(job, handle)
        if job.mode == Mode.MPS and job.gpus:
            try:
                pids = await asyncio.to_thread(rt.pids, handle)
            except Gone:
                pids = []  # no container, no client to terminate; the stop finds it gone too
            # invariant 6: terminate_client for every client pid before any signal
            await asyncio.to_thread(self.gpus.mps.terminate_then, job.gpus[0], pids, stop)
        else:
            await asyncio.to_thread(stop)

    # pause, resume, signal (colo pause, resume, cancel -s) ---------------------------------------
    async def pause(self, job_id: int, by: str) -> Job:
        """Freeze a running job (the runtime's freezer); it keeps its GPUs and budget."""
        job = self.table.job(job_id)
        await asyncio.to_thread(self.engines.runtime_for(job).pause, job.handle)
        log.info("job %d paused by %s", job_id, by)
        return self.table.set_fields(job_id, paused_by=by)

    async def resume(self, job_id: int, by: str) -> Job:
        job = self.table.job(job_id)
        await asyncio.to_thread(self.engines.runtime_for(job).resume, job.handle)
        log.info("job %d resumed by %s", job_id, by)
        return self.table.set_fields(job_id, paused_by=None)

    async def stop_for_patrol(self, job_id: int, by: str, pids: set[int]) -> bool:
        """The patrol's kill: the cancel stored first, processes that left the job's process
        group (setsid, not reached by its stop) killed, then the stop. False: still starting."""
        job = self.table.open.get(job_id)
        if job is None or job.state not in ACTIVE:
            return True
        if job.state != State.RUNNING or not job.handle:
            return False
        self.table.set_fields(job_id, cancel_by=by)  # stored first: a crash from here on still ends it
        await self._say_stop(job, job.handle)  # the kills below may end a Slurm job at once
        # MPS clients are left to the stop, which sends terminate_client first (invariant 6); so is
        # every process where the stop reaches them all (a container, a Slurm job)
        rt = self.engines.get(job.spec.runtime)
        reaches = rt.stop_reaches_all if rt is not None else bool(job.spec.image)
        for pid in (pids if job.mode != Mode.MPS and not reaches else ()):
            if uid_of(pid) == job.uid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        await self.finish_cancel(job_id, job.handle)
        return True

    # MPS faults -------------------------------------------------------------------------------
    async def mps_fault(self, uuid: str, clients: set[int]) -> None:
        """A FAULT server: its clients' jobs fail (or are requeued when they allow retries); the
        policy sees the GPU's MPS state as "fault" and places no MPS job there until it recovers."""
        for job in self.table.jobs_in(State.RUNNING):
            if job.mode != Mode.MPS or uuid not in job.gpus or not job.handle:
                continue
            rt = self.engines.runtime_for(job)
            try:
                pids = set(await asyncio.to_thread(rt.pids, job.handle))
            except (Gone, Unavailable, EngineError) as e:  # gone: its follower records the end
                log.warning("job %d: its processes are unknown (%s)", job.id, e)
                pids = set()
            if clients and not pids & clients:
                continue
            live = self.live.setdefault(job.id, Live())
            if live.task:
                live.task.cancel()
            # A requeued attempt must not start before this one has ended: this one's stop acts on
            # the cgroup job-<ID>, where the new attempt's processes would be (and be killed).
            self._ending.add(job.id)
            if job.attempts <= job.spec.retries:
                self.requeue(job.id, f"{mps.FAULT_REASON}; requeued (attempt {job.attempts} of {job.spec.retries + 1})")
            else:
                self.table.transition(job.id, State.FAILED, mps.FAULT_REASON)
            asyncio.get_running_loop().create_task(self._kill_after_fault(job.id, rt, job.handle))
        self.wake()

    async def requeue_running(self, job: Job, reason: str) -> None:
        """Queue a running job again under its id and end its attempt (`colo drain --now`), as an
        MPS fault does; it starts again, elsewhere, once the attempt has ended."""
        live = self.live.setdefault(job.id, Live())
        if live.task:
            live.task.cancel()
        self._ending.add(job.id)
        self.requeue(job.id, reason)
        rt = self.engines.runtime_for(job)
        asyncio.get_running_loop().create_task(self._end_requeued(job, rt))

    async def _end_requeued(self, job: Job, rt) -> None:
        """Stop a requeued job's attempt as a cancel would (thawed first; invariant 6 for an MPS
        client), then reap and clean up as after a fault."""
        def stop() -> None:
            if job.paused_by:
                rt.resume(job.handle)
            rt.stop(job.handle, self.config.stop_grace)

        try:
            if job.mode == Mode.MPS and job.gpus:
                pids = await asyncio.to_thread(rt.pids, job.handle)
                await asyncio.to_thread(self.gpus.mps.terminate_then, job.gpus[0], pids, stop)
            else:
                await asyncio.to_thread(stop)
        except (Gone, Unavailable):
            pass
        except EngineError as e:  # the stop after the fault's path tries again
            log.warning("job %d: stopping its drained attempt: %s", job.id, e)
        await self._kill_after_fault(job.id, rt, job.handle)

    async def _kill_after_fault(self, job_id: int, rt, handle: str) -> None:
        try:
            try:
                await asyncio.to_thread(rt.stop, handle, self.config.stop_grace)
                await blocking(rt.wait, handle)  # reaped, so its exit file or container is final
            except (Gone, Unavailable):
                pass
            except EngineError as e:  # the removal below stops it all the same
                log.warning("job %d: stopping its faulted attempt: %s", job_id, e)
            try:
                await asyncio.to_thread(rt.cleanup, handle)
            except (Unavailable, EngineError) as e:  # removed by the sweep, or tried again soon
                log.warning("cleanup of job %d: %s", job_id, e)
                if isinstance(e, EngineError):
                    self.removals.remove_later(job_id, handle)
            if self.table.store.get(job_id).state in TERMINAL:  # a requeued job gets a fresh ledger when it starts
                shutil.rmtree(self.config.run_dir(job_id), ignore_errors=True)
        finally:
            self._ending.discard(job_id)  # a requeued job may start again
            self.wake()

    # attempts a dead daemon left behind -------------------------------------------------------
    async def end_strays(self) -> None:
        """Processes of an attempt that is over, left by a daemon that died while stopping it (an
        MPS fault requeues the job, then stops the old attempt for up to stop_grace): the store
        knows nothing of them any more. They are ended, and the job waits ("waiting for its
        earlier attempt to end") until they are gone: a new attempt would share job-<ID> with
        them, and the old shim, as it ends, kills whatever is in job-<ID> and writes the job's
        exit file."""
        rt = self.engines.get("process")
        if rt is None:
            return
        keep = {j.id for j in self.table.jobs_in(*ACTIVE)}
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
            if self.table.store.get(job_id).state in TERMINAL:
                shutil.rmtree(self.config.run_dir(job_id), ignore_errors=True)
        finally:
            self._ending.discard(job_id)
            self.wake()

    def _end_leftovers(self, job_id: int, rt, pids: list[int]) -> bool:
        # invariant 6: any MPS client among them is sent terminate_client before it is killed
        # (the store no longer says which GPU the attempt had: every GPU's MPS daemon is asked)
        if pids:
            for d in self.gpus.devices:
                m = self.gpus.mps.get(d.uuid)
                if m is not None and m.running():
                    self.gpus.mps.terminate_then(d.uuid, pids, lambda: None)
        return rt.end_leftovers(job_id, self.config.run_dir(job_id))


def _code_text(code: int) -> str:
    """137 -> "137 (SIGKILL)": exit codes past 128 are how a signal's death is reported."""
    if code > 128:
        try:
            return f"{code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return str(code)
