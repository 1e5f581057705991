"""The scheduler's decisions as kept and stored: a WAIT kept compactly per queued job, and the
thread that stores WAIT decisions (a START is stored at once, by the scheduler)."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from ..sched import policy
from ..store import Store

log = logging.getLogger("colo")


class KeptWait:
    """A WAIT decision as the scheduler keeps it for each queued job: its reason and figures, the
    figures shared by every job told the same (a policy.Decision and a details dict of its own were
    ~0.6 KiB a job, 30 MiB at 50,000 queued). Read as a Decision is."""

    __slots__ = ("job_id", "reason", "details")
    action, mode, gpus, thread_pct = policy.WAIT, None, (), None

    def __init__(self, job_id: int, reason: str, details: dict):
        self.job_id, self.reason, self.details = job_id, reason, details


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
