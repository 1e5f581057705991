"""The open jobs: the store's queued and active rows mirrored in memory, and the one way a job
changes state.

Owns: `open` (id -> Job, queued and active), the index of active jobs, each user's open detached
sessions (max_detached_per_user counts them, queued ones too: a restart leaves those no
terminal until they start), and `changed` (wakes
whoever waits for any job to change: `colo wait`, `logs -f`). Every change goes to the store
first (checked there, colo/jobs.py's state machine), then here, then to the watchers the daemon
registered (`on_change(prev, job)`, `on_edit(prev, job)`): the scheduler files queued jobs, the
launcher forgets retries of jobs that ended. Only the event loop calls the changing methods.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable

from ..jobs import ACTIVE, TERMINAL, Job, Mode, State
from ..store import Store

log = logging.getLogger("colo")


class Changes:
    """Wakes whoever waits for any job to change (`wait`, `logs -f`). It holds no lock: an
    asyncio.Condition waited on with a timeout, by a thousand clients some of whom hung up, was
    left locked for good (Python 3.11), and every later wait and follow hung with it."""

    def __init__(self) -> None:
        self._now = asyncio.Event()

    def notify_all(self) -> None:
        now, self._now = self._now, asyncio.Event()
        now.set()

    async def wait(self, timeout: float) -> None:
        """Until the next change, or `timeout` seconds."""
        try:
            await asyncio.wait_for(self._now.wait(), timeout)
        except asyncio.TimeoutError:
            pass


class JobTable:
    def __init__(self, store: Store):
        self.store = store
        self.open: dict[int, Job] = {j.id: j for j in store.jobs([State.QUEUED, *ACTIVE])}
        # active jobs by id: every start (who shares its GPU) and every sample asks for these, and
        # walking 10,000 queued jobs for them made that most of a pass
        self._active: dict[int, None] = {j.id: None for j in sorted(self.open.values(), key=lambda j: j.id)
                                         if j.state in ACTIVE}
        self._detached: dict[int, set[int]] = {}  # uid -> ids of its open detached sessions' jobs
        for j in self.open.values():
            self._file_detached(j)
        self.changed = Changes()
        self.on_change: list[Callable[[Job | None, Job], None]] = []
        self.on_edit: list[Callable[[Job, Job], None]] = []

    # reading ----------------------------------------------------------------------------------
    def job(self, job_id: int) -> Job:
        """An open job from memory, an ended one from the store (KeyError: no such job)."""
        return self.open.get(job_id) or self.store.get(job_id)

    def jobs_in(self, *states: State) -> list[Job]:
        if ACTIVE.issuperset(states):
            return self.active(*states)  # a few, kept apart from the queue (10,000 long)
        return [j for j in self.open.values() if j.state in states]

    def active(self, *states: State) -> list[Job]:
        """Open jobs in these (active) states, by id, without walking the queue."""
        open_jobs = self.open
        return sorted((j for i in self._active if (j := open_jobs.get(i)) is not None and j.state in states),
                      key=lambda j: j.id)

    def active_ids(self) -> list[int]:
        """Ids of the active jobs, copied in one step (safe to call from a worker thread)."""
        return list(self._active)

    def mps_users(self) -> dict[str, set[int]]:
        """GPU uuid -> the uids of its starting and running MPS jobs: with root, the only ones that
        may reach its MPS control daemon (docs/mps.md "Who may reach the daemon")."""
        users: dict[str, set[int]] = {}
        open_jobs = self.open
        # ids copied in one step: build_launch asks from a worker thread while the loop changes them
        for i in self.active_ids():
            j = open_jobs.get(i)
            if j is not None and j.state in ACTIVE and j.mode == Mode.MPS and j.gpus:
                users.setdefault(j.gpus[0], set()).add(j.uid)
        return users

    def mode_shown(self, job: Job, foreign_gpus: set[str]) -> str | None:
        """A job's mode as listings and metrics show it: a time-sliced job alone on its GPUs (no
        other job; no process of no job on them, `foreign_gpus`: the patrol's last look) runs
        "exclusive"."""
        if job.mode is None:
            return None
        if job.mode == Mode.TIMESLICED and job.state in ACTIVE and job.gpus:
            mine = set(job.gpus)
            if not mine & foreign_gpus and not any(mine & set(j.gpus) for j in self.active(*ACTIVE) if j.id != job.id):
                return "exclusive"
        return job.mode.value

    def detached_count(self, uid: int) -> int:
        """How many detached sessions `uid` has open, queued or running."""
        return len(self._detached.get(uid, ()))

    def state_of(self, job_id: int) -> State | None:
        try:
            return self.job(job_id).state
        except KeyError:
            return None

    # changing (the event loop only) -----------------------------------------------------------
    def add(self, spec, uid: int, gid: int, user: str, reason: str | None = None, held_by: str | None = None) -> Job:
        job = self.store.add_job(spec, uid, gid, user, reason=reason, held_by=held_by)
        self.open[job.id] = job
        self._changed(None, job)
        return job

    def add_array(self, spec, indices: list[int], limit: int | None, uid: int, gid: int, user: str,
                  held_by: str | None = None) -> list[Job]:
        """The tasks of `colo submit --array`, stored at once (store.add_array)."""
        jobs = self.store.add_array(spec, indices, limit, uid, gid, user, held_by=held_by)
        for job in jobs:
            self.open[job.id] = job
            self._changed(None, job)
        return jobs

    def change_queued(self, job_id: int, reason: str, **changes) -> Job:
        """A queued job's spec or hold changed (colo edit/hold/release): stored, mirrored, re-filed."""
        prev = self.open[job_id]
        job = self.store.change_queued(job_id, reason, **changes)
        self.open[job_id] = job
        for fn in self.on_edit:
            fn(prev, job)
        log.info("job %d: %s", job_id, reason)
        self._notify()
        return job

    def transition(self, job_id: int, new: State, reason: str, **fields) -> Job:
        """The one way a job changes state: checked and stored by the store, mirrored here."""
        prev = self.open.get(job_id)
        if new == State.QUEUED and "spec" not in fields and prev is not None and prev.spec.asked_mem is not None:
            # back in the queue it asks for what its submitter asked: a lend is for one start only
            fields["spec"] = json.dumps(prev.spec.as_asked().to_dict())
        job = self.store.transition(job_id, new, reason, **fields)
        if job.state in TERMINAL:
            self.open.pop(job_id, None)
        else:
            self.open[job_id] = job
        self._changed(prev, job)
        log.info("job %d -> %s: %s", job_id, new, reason)
        self._notify()
        return job

    def set_fields(self, job_id: int, **fields) -> Job:
        self.store.set_fields(job_id, **fields)
        job = self.store.get(job_id)
        if job_id in self.open:
            self.open[job_id] = job
        return job

    def _changed(self, prev: Job | None, job: Job) -> None:
        if job.state in ACTIVE:
            self._active[job.id] = None
        else:
            self._active.pop(job.id, None)
        self._file_detached(job)
        for fn in self.on_change:
            fn(prev, job)

    def _file_detached(self, job: Job) -> None:
        if not job.spec.detached:
            return
        mine = self._detached.setdefault(job.uid, set())
        if job.state in TERMINAL:
            mine.discard(job.id)
            if not mine:
                del self._detached[job.uid]
        else:
            mine.add(job.id)

    def _notify(self) -> None:
        asyncio.get_running_loop().call_soon(self.changed.notify_all)
