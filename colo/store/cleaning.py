"""Removing ended jobs: `colo clean`, history_keep_days."""
from __future__ import annotations

from typing import Any, Iterable

from ..jobs import TERMINAL, State
from .base import Base


class Cleaning(Base):
    # removing ended jobs: `colo clean`, history_keep_days --------------------------------------
    def cleanable(self, states: Iterable[State], before: float | None = None, user: str | None = None,
                  uid: int | None = None, after: tuple[float, int] = (float("-inf"), 0),
                  limit: int = 200) -> list[tuple[int, int | None, float]]:
        """(id, its array's id or None, ended_at) of ended jobs in `states` (TERMINAL ones only)
        that ended before `before`, of `user` (a name) and `uid` where given: the first `limit`
        after the key `after`, which is (ended_at, id) of the last row without `user` (the
        jobs_ended index, for history_keep_days), else (anything, id) (the jobs_user index). A
        caller pages on with the last row's key: each page reads about `limit` rows, never the
        whole table. (`+state`: not the jobs_state index, which would read every ended job.)"""
        states = [str(s) for s in states if s in TERMINAL]
        if not states or (user is None and before is None):
            return []
        marks = ",".join("?" * len(states))
        if user is None:
            q = "SELECT id, json_extract(spec, '$.array_job'), ended_at FROM jobs WHERE ended_at < ? " \
                f"AND (ended_at, id) > (?, ?) AND +state IN ({marks})"
            args: list[Any] = [before, *after, *states]
            order = "ended_at, id"
        else:
            q = "SELECT id, json_extract(spec, '$.array_job'), ended_at FROM jobs WHERE user = ? AND id > ? " \
                f"AND +state IN ({marks})"
            args = [user, after[1], *states]
            if before is not None:
                q += " AND ended_at < ?"
                args.append(before)
            order = "id"
        if uid is not None:
            q += " AND uid = ?"
            args.append(uid)
        return self.db.execute(f"{q} ORDER BY {order} LIMIT ?", [*args, limit]).fetchall()

    def _ended_in(self, ids: list[int]) -> tuple[str, list[Any]]:
        """SQL for the ids among `ids` whose jobs have ended (never an open job's)."""
        terminal = [str(s) for s in TERMINAL]
        return (f"SELECT id FROM jobs WHERE id IN ({','.join('?' * len(ids))}) "
                f"AND state IN ({','.join('?' * len(terminal))})", [*ids, *terminal])

    def remove_samples(self, ids: list[int], most: int) -> int:
        """Drop up to `most` usage samples of the ended jobs among `ids` (a long job has tens of
        thousands: removed a piece at a time, so that no one transaction is long)."""
        if not ids:
            return 0
        ended, args = self._ended_in(ids)
        with self.tx():
            return self.db.execute(f"DELETE FROM samples WHERE rowid IN (SELECT rowid FROM samples "
                                   f"WHERE job_id IN ({ended}) LIMIT ?)", [*args, most]).rowcount

    def remove_jobs(self, ids: list[int], keep_use_since: float) -> list[int]:
        """Remove the ended jobs among `ids` with everything stored of them (events, decision,
        samples, neighbours) in one transaction; the ids removed. Their GPU use that ended after
        `keep_use_since` is kept in cleaned_use for fair share (gpu_use), where older use is
        dropped. What was learned (learned_*) is per user and profile, never per job: untouched."""
        if not ids:
            return []
        ended, args = self._ended_in(ids)
        with self.tx():
            gone = [r[0] for r in self.db.execute(ended, args)]
            if not gone:
                return []
            marks = ",".join("?" * len(gone))
            self.db.execute(
                "INSERT INTO cleaned_use(uid, budget, gpus, started_at, ended_at) "
                "SELECT uid, coalesce(json_extract(spec, '$.gpu_mem'), 0), json_array_length(gpus), started_at, ended_at "
                f"FROM jobs WHERE id IN ({marks}) AND started_at IS NOT NULL AND gpus != '[]' AND ended_at > ?",
                [*gone, keep_use_since])
            self.db.execute("DELETE FROM cleaned_use WHERE ended_at <= ?", (keep_use_since,))
            for table in ("samples", "events", "decisions", "job_neighbours"):
                self.db.execute(f"DELETE FROM {table} WHERE job_id IN ({marks})", gone)
            arrays = [r[0] for r in self.db.execute(
                f"SELECT DISTINCT json_extract(spec, '$.array_job') FROM jobs WHERE id IN ({marks}) "
                "AND json_extract(spec, '$.array_job') IS NOT NULL", gone)]
            self.db.execute(f"DELETE FROM jobs WHERE id IN ({marks})", gone)
            self.db.executemany("DELETE FROM array_specs WHERE array_job=? AND NOT EXISTS (SELECT 1 FROM jobs "
                                "WHERE json_extract(spec, '$.array_job') = ?)", [(a, a) for a in arrays])
        return gone

