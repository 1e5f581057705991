"""Containers of ended jobs still to be removed (the launcher's): an ended job's container goes in
the background, and one the engine refused to remove (or one no open job owns) is tried again on
a backoff, its job's output drained into the log as it goes.

Owns: the containers to remove (each with its job and when to try again) and the removals under
way. Calls: the runtimes (cleanup), the job table (what still runs in one).
"""
from __future__ import annotations

import asyncio
import logging
import time

from ..jobs import State
from ..runtimes.base import EngineError, Unavailable
from .backoff import Backoff
from .engines import Engines
from .jobtable import JobTable

log = logging.getLogger("colo")


class Removals:
    def __init__(self, table: JobTable, engines: Engines):
        self.table = table
        self.engines = engines
        self._removals: dict[str, tuple[int, Backoff]] = {}  # container -> its job, when to try again
        self._cleanups: set[asyncio.Task] = set()  # removals of ended jobs' containers under way

    def clean_up(self, job_id: int, rt, handle: str) -> None:
        """An ended job's container or cgroup goes (in the background where its runtime says so)."""
        if rt.cleanup_in_background:
            task = asyncio.get_running_loop().create_task(self._cleanup(job_id, rt, handle))
            self._cleanups.add(task)  # held until done (the loop keeps only a weak reference)
            task.add_done_callback(self._cleanups.discard)
        else:
            self._cleanup_now(job_id, rt, handle)

    def removing(self) -> set[int]:
        """Ended jobs whose container the engine has not let colo remove yet: its removal drains
        the rest of its output into the job's log."""
        return {job_id for job_id, _ in self._removals.values()}

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
            self.remove_later(job_id, handle)


    def remove_later(self, job_id: int, handle: str) -> None:
        """A container of an ended job whose removal the engine refused: tried again soon."""
        b = self._removals.setdefault(handle, (job_id, Backoff()))[1]
        if b.at is None:
            b.failed(time.monotonic())

    def remove_leftovers(self, found: dict[int, str]) -> None:
        """Containers of this daemon that no open job owns (ended while colo or the engine was
        away, or created by a start the engine cut short): removed by retry_removals."""
        for job_id, handle in found.items():
            job = self.table.open.get(job_id)
            if job is not None and (job.handle == handle or job.state == State.STARTING):
                continue
            if handle not in self._removals:  # one the engine refused is tried on its own schedule
                self._removals[handle] = (job_id, Backoff())

    async def retry_removals(self, every: bool = False) -> None:
        """Remove the containers waiting for it whose time has come (every=True: all of them).
        Each is one entry, tried at most once a minute however long the engine refuses it."""
        rt = self.engines.get("docker")
        if rt is None or rt.down is not None:
            return
        now = time.monotonic()
        for handle, (job_id, b) in list(self._removals.items()):
            if not (every and b.at is None) and not b.due(now):
                continue
            job = self.table.open.get(job_id)
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

