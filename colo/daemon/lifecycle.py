"""A job's life after the scheduler picked it: launch, follow to its exit, cancel and stop."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import signal
import threading
import time
from dataclasses import dataclass

from ..node import interposer, mps
from ..sched import policy
from ..jobs import TERMINAL, Job, Mode, State
from ..runtimes.base import EngineError, Gone, StartError, Unavailable
from ..store import StoreError
from ..units import format_duration, format_size
from .launchspec import build_launch

log = logging.getLogger("colo")


async def blocking(fn, *args):
    """Run a call that blocks for a job's whole life (waiting for its exit) on a thread of its
    own. The thread is a daemon thread, so stopping colo never waits for it: the job runs on and
    is found again at the next start. (The shared worker pool would hold shutdown until every
    job had ended, and cap the number of jobs that can run at once.)"""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is closed: colo stopped while the job ran

    threading.Thread(target=run, name=f"colo-wait-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await fut


@dataclass
class Live:
    """What the daemon knows about an active job beyond the store."""
    task: asyncio.Task | None = None
    stopping: bool = False
    timed_out: bool = False  # stopped by the daemon at its --time limit


class LifecycleMixin:
    """Part of Daemon (colo/daemon/core.py); uses its state."""

    def start_job(self, d: policy.Decision) -> None:
        mode = Mode(d.mode) if d.mode else Mode.TIMESLICED
        prev = self.job(d.job_id)
        fields = {}
        budget = d.details.get("budget", prev.spec.gpu_mem)
        if budget != prev.spec.gpu_mem and prev.spec.grow and prev.spec.gpus:
            # started with more than asked (--grow only): the budget everything counts from now on,
            # stored in the transition that starts it, so a restarted daemon counts it too
            fields["spec"] = json.dumps(dataclasses.replace(prev.spec, gpu_mem=int(budget),
                                                            asked_mem=prev.spec.gpu_mem).to_dict())
        job = self.transition(d.job_id, State.STARTING, d.reason, gpus=list(d.gpus), mode=mode,
                              attempts=prev.attempts + 1,
                              neighbours=self.start_neighbours(d.job_id, d.gpus), **fields)  # one transaction
        live = self.live.setdefault(job.id, Live())
        live.task = asyncio.get_running_loop().create_task(self._launch_and_follow(job, d))

    async def _launch_and_follow(self, job: Job, d: policy.Decision) -> None:
        try:
            rt = self.runtime_for(job)
            launch = await asyncio.to_thread(build_launch, self, job, d)
            handle = await asyncio.to_thread(rt.start, launch)
        except asyncio.CancelledError:
            raise
        except Unavailable as e:  # the engine went away: not the job's fault, it starts when it is back
            why = f"requeued: {e} as it started"
            await self._durably(lambda: self._requeue(job.id, why))
            self._finish(job.id)
            return
        except EngineError as e:  # it answers, but failed the start (500): requeued as above, a few times
            said = str(e)
            await self._durably(lambda: self._start_refused(job.id, said))
            self._finish(job.id)
            return
        except Exception as e:  # noqa: BLE001 - whatever it was, the job must not stay "starting"
            reason = str(e) if isinstance(e, (StartError, mps.MpsError, OSError)) else f"{e.__class__.__name__}: {e}"
            await self._durably(lambda: self.transition(job.id, State.FAILED, f"failed to start: {reason}"))
            self._finish(job.id)
            return
        self._start_retry.pop(job.id, None)
        await self._durably(lambda: self.set_fields(job.id, handle=handle))
        said = f"started ({job.spec.runtime})"
        if job.spec.asked_mem is not None:  # what ls shows of it while it runs
            said += f" with {format_size(job.spec.gpu_mem)} (asked {format_size(job.spec.asked_mem)}, --grow)"
        await self._durably(lambda: self.transition(job.id, State.RUNNING, said))
        if self.job(job.id).cancel_by:  # cancelled while it was starting
            await self._finish_cancel(job.id, handle)
        await self.follow(job.id, handle)

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

    async def follow(self, job_id: int, handle: str) -> None:
        job = self.job(job_id)
        rt = self.runtime_for(job)
        timer = (asyncio.get_running_loop().create_task(self._time_limit(job_id, handle))
                 if job.spec.time else None)
        try:
            delay = 1.0
            while True:
                try:
                    code = await blocking(rt.wait, handle)
                    break
                except EngineError as e:  # it answers, but an error: the job is as it was; wait again
                    self._engine_trouble(job_id, str(e))
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 60.0)
            self._engine_said.pop(job_id, None)
        except Unavailable:
            return  # colo is stopping while the engine is away: found again at the next start
        except Gone as e:
            by = self.job(job_id).cancel_by
            reason = f"cancelled by {by} ({e})" if by else f"lost: {e} (its exit code is unknown)"
            await self._durably(lambda: self.transition(job_id, State.CANCELLED if by else State.LOST, reason))
            self._finish(job_id, rt, handle)
            return
        except asyncio.CancelledError:
            return  # the daemon is stopping; the job runs on and is found again at restart
        finally:
            if timer is not None:
                timer.cancel()
        job = await self._durably(lambda: self.record_exit(job_id, code))
        if job.state == State.SUCCEEDED:
            self.learn(job)
        self._finish(job_id, rt, handle)

    async def _time_limit(self, job_id: int, handle: str) -> None:
        """--time: stop the job when its wall time is up (counted from its start, also across a
        daemon restart)."""
        job = self.job(job_id)
        started = job.started_at or time.time()
        await asyncio.sleep(max(0.0, started + job.spec.time - time.time()))
        job = self.job(job_id)
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
            job = self.job(job_id)
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
        refused = self._refused(job_id)
        note = (f"; {refused} allocation(s) refused by its budget of {format_size(self.job(job_id).spec.gpu_mem)}"
                if refused else "")
        job = self.job(job_id)
        if job.handle and job.spec.runtime in self.runtimes:
            extra = self.runtimes[job.spec.runtime].exit_note(job.handle)
            note += f"; {extra}" if extra else ""
        if job.cancel_by:
            stop_sent = job_id in self.live and self.live[job_id].stopping
            if code == 0 and not stop_sent:  # it ended on its own; the cancel came too late to matter
                return self.transition(job_id, State.SUCCEEDED, f"exited with code 0 before the cancel by "
                                       f"{job.cancel_by} reached it{note}", exit_code=0)
            first = "the stop was sent first, " if stop_sent else ""
            return self.transition(job_id, State.CANCELLED, f"cancelled by {job.cancel_by} ({first}then it "
                                   f"exited with code {_code_text(code)})", exit_code=code)
        if self._timed_out(job, code):
            return self.transition(job_id, State.FAILED, f"stopped at its time limit of {format_duration(job.spec.time)}"
                                   f" (exited with code {_code_text(code)}){note}", exit_code=code)
        if code == 0:
            return self.transition(job_id, State.SUCCEEDED, f"exited with code 0{note}", exit_code=0)
        if refused and job.spec.grow and (bigger := self.grown_budget(job)) is not None:
            spec = dataclasses.replace(job.spec, gpu_mem=bigger, grow=False, asked_mem=None)  # once
            return self.transition(job_id, State.QUEUED, f"exited with code {_code_text(code)}{note}; requeued with "
                                   f"budget {format_size(bigger)} (--grow)", spec=json.dumps(spec.to_dict()))
        return self.transition(job_id, State.FAILED, f"exited with code {_code_text(code)}{note}", exit_code=code)

    def _refused(self, job_id: int) -> int:
        try:
            return interposer.read_ledger(self.run_dir(job_id) / "ledger").refused
        except Exception:  # noqa: BLE001 - no ledger (CPU job) or unreadable: nothing to add
            return 0

    def _finish(self, job_id: int, rt=None, handle: str | None = None) -> None:
        self.live.pop(job_id, None)
        self.left_alone(job_id)
        if rt is not None and handle:
            if rt.cleanup_in_background:
                task = asyncio.get_running_loop().create_task(self._cleanup(job_id, rt, handle))
                self._cleanups.add(task)  # held until done (the loop keeps only a weak reference)
                task.add_done_callback(self._cleanups.discard)
            else:
                self._cleanup_now(job_id, rt, handle)
        shutil.rmtree(self.run_dir(job_id), ignore_errors=True)  # the ledger goes with the job
        self.revoke_mps_access()  # ended and reaped: its uid keeps access only for its other MPS jobs
        self.wake()

    def _cleanup_now(self, job_id: int, rt, handle: str) -> None:
        try:
            rt.cleanup(handle)
        except Exception as e:  # noqa: BLE001
            self._cleanup_failed(job_id, handle, e)

    async def _cleanup(self, job_id: int, rt, handle: str) -> None:
        try:
            await asyncio.to_thread(rt.cleanup, handle)
        except Exception as e:  # noqa: BLE001
            self._cleanup_failed(job_id, handle, e)  # back on the loop: _removals is the loop's

    def _cleanup_failed(self, job_id: int, handle: str, e: Exception) -> None:
        log.warning("cleanup of job %d: %s", job_id, e)
        if isinstance(e, EngineError):  # e.g. 409: removed on a backoff, not at the next restart
            self._remove_later(job_id, handle)

    async def cancel(self, job_id: int, by: str) -> Job:
        job = self.job(job_id)
        if job.state in TERMINAL:
            return job
        if job.state == State.QUEUED:
            return self.transition(job_id, State.CANCELLED, f"cancelled by {by} before it started")
        self.set_fields(job_id, cancel_by=by)  # first, so that a crash from here on still ends in a cancel
        if job.handle:  # else it is starting: stopped as soon as it has a handle
            await self._finish_cancel(job_id, job.handle)
        return self.job(job_id)

    def _requeue(self, job_id: int, reason: str) -> Job:
        """Back to the queue, unless a cancel was asked for meanwhile."""
        job = self.job(job_id)
        if job.cancel_by:
            return self.transition(job_id, State.CANCELLED, f"cancelled by {job.cancel_by} before it started")
        return self.transition(job_id, State.QUEUED, reason)

    async def _finish_cancel(self, job_id: int, handle: str) -> None:
        """Stop a job whose cancel is stored (once at a time). An engine that is away is left to
        _watch_docker, which calls this again when it answers."""
        live = self.live.setdefault(job_id, Live())
        if live.stopping:
            return
        try:
            await self._stop(job_id, handle)
        except Unavailable:
            live.stopping = False
        except EngineError as e:  # the cancel is stored: _watch_docker tries it again
            live.stopping = False
            log.warning("job %d: stopping it was refused: %s; trying again later", job_id, e)
            self._cancel_retry.failed(time.monotonic())
        except Exception:
            live.stopping = False  # a later cancel may try again
            raise

    async def _stop(self, job_id: int, handle: str) -> None:
        live = self.live.setdefault(job_id, Live())
        live.stopping = True
        job = self.store.get(job_id)
        rt = self.runtime_for(job)

        def stop() -> None:
            rt.stop(handle, self.config.stop_grace)

        if job.mode == Mode.MPS and self.mps is not None and job.gpus:
            try:
                pids = await asyncio.to_thread(rt.pids, handle)
            except Gone:
                pids = []  # no container, no client to terminate; the stop finds it gone too
            # invariant 6: terminate_client for every client pid before any signal
            await asyncio.to_thread(self.mps.terminate_then, job.gpus[0], pids, stop)
        else:
            await asyncio.to_thread(stop)


def _code_text(code: int) -> str:
    """137 -> "137 (SIGKILL)": exit codes past 128 are how a signal's death is reported."""
    if code > 128:
        try:
            return f"{code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return str(code)
