"""The scheduler pass: dependencies, plan(), starts; and where its decisions are stored."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

from .. import policy
from ..jobs import ACTIVE, Job, State
from ..store import Store

log = logging.getLogger("colo")


class SchedulerMixin:
    """Part of Daemon (colo/daemon/core.py); uses its state."""

    def schedule_pass(self) -> list[policy.Decision]:
        """Check dependencies, plan, start. Exits are reaped by the monitors, not here."""
        queued = self.jobs_in(State.QUEUED)
        if not queued:
            return []
        candidates, waits = self._eligible(queued)
        now = time.time()
        decisions = policy.plan(candidates, self.gpu_views(), self.placed(now), self.cfg_policy, now=now)
        self._record(waits)
        self._record(decisions)
        for d in decisions:
            if d.action == policy.START:
                self.start_job(d)
        return decisions

    def placed(self, now: float) -> list[policy.Placed]:
        """The active jobs on GPUs as plan() sees them (colo's own and Slurm's alike)."""
        return [policy.Placed(j.id, tuple(j.gpus), j.spec.gpu_mem, j.uid, str(j.mode or "timesliced"),
                              self.profile_of(j), now - (j.started_at or now))
                for j in self.jobs_in(*ACTIVE) if j.gpus]

    def _eligible(self, queued: list[Job]) -> tuple[list[policy.Candidate], list[policy.Decision]]:
        cands, waits = [], []
        for j in queued:
            if j.spec.after:
                deps = {a: self._state_of(a) for a in j.spec.after}
                failed = [a for a, st in deps.items() if st in (State.FAILED, State.CANCELLED, State.LOST, None)]
                if failed:
                    self.transition(j.id, State.FAILED, f"dependency failed: job {failed[0]} "
                                    f"{deps[failed[0]] or 'does not exist'}")
                    continue
                pending = [a for a, st in deps.items() if st != State.SUCCEEDED]
                if pending:
                    waits.append(policy.Decision(j.id, policy.WAIT, reason=f"waiting for job {pending[0]} to succeed"))
                    continue
            if j.spec.gpus and self.gpu_error:
                waits.append(policy.Decision(j.id, policy.WAIT, reason=self.gpu_error))
                continue
            if j.spec.runtime == "docker" and (why := self.docker_away()):
                waits.append(policy.Decision(j.id, policy.WAIT, reason=f"waiting for the Docker engine: {why}"))
                continue
            c = self._cands.get(j.id)
            last = self.decisions.get(j.id)
            held = tuple(last.details.get("held", ())) if last is not None else ()
            if c is not None and c.held != held:
                c = self._cands[j.id] = dataclasses.replace(c, held=held)
            if c is None:
                c = self._cands[j.id] = policy.Candidate(j.id, j.spec.gpu_mem, j.spec.gpus, j.uid, j.spec.priority,
                                                         j.id, self.profile_of(j) if j.spec.gpus else None,
                                                         queued_at=j.submitted_at, held=held)
            cands.append(c)
        return cands, waits

    def _state_of(self, job_id: int) -> State | None:
        try:
            return self.job(job_id).state
        except KeyError:
            return None

    def _record(self, decisions: list[policy.Decision]) -> None:
        """Keep the latest decision per job; START decisions are stored at once, the (many, often
        re-worded) WAIT ones by a writer thread, so a pass over 10,000 queued jobs stays short."""
        now = time.time()
        starts, waits = [], []
        for d in decisions:
            old = self.decisions.get(d.job_id)
            if old is not None and old.reason == d.reason and old.action == d.action:
                continue
            self.decisions[d.job_id] = d
            row = (d.job_id, d.action, d.mode, list(d.gpus), d.reason, d.details)
            (starts if d.action == policy.START else waits).append(row)
        if starts:
            self.store.record_decisions(starts, now)
        if waits:
            self._writer.put(waits, now)


class DecisionWriter:
    """Stores WAIT decisions from its own thread and SQLite connection, latest per job."""

    def __init__(self, db_path: Path):
        self.db_path = db_path
        self._pending: dict[int, tuple] = {}
        self._now = 0.0
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="colo-decisions", daemon=True)
        self._thread.start()

    def put(self, rows: list[tuple], now: float) -> None:
        with self._cv:
            self._pending.update((r[0], r) for r in rows)
            self._now = now
            self._cv.notify()

    def _run(self) -> None:
        store = Store(self.db_path)
        try:
            while True:
                with self._cv:
                    while not self._pending and not self._stop:
                        self._cv.wait()
                    batch, self._pending = self._pending, {}
                    now = self._now
                if batch:
                    try:
                        store.record_decisions(batch.values(), now)
                    except Exception as e:  # noqa: BLE001 - disk full, say: the next batch tries again
                        log.warning("could not store %d decisions: %s", len(batch), e)
                if self._stop and not self._pending:
                    return
        finally:
            store.close()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)
