"""What jobs used: `colo history` and `colo report`, the counters, decisions, fair share's GPU use, samples."""
from __future__ import annotations

import json
import time
from typing import Any, Iterable

from ..jobs import State
from .base import Base


class Accounting(Base):
    # accounting: `colo history` and `colo report` ----------------------------------------------
    def _ended_where(self, states: Iterable[State], since: float | None,
                     users: Iterable[str] | None) -> tuple[str, list[Any]]:
        where, args = self._where(states, users, None)
        if since is not None:
            where += " AND ended_at >= ?"  # the jobs_ended index
            args.append(since)
        return where, args

    def history(self, states: Iterable[State], since: float | None = None, users: Iterable[str] | None = None,
                limit: int | None = None, full: bool = False) -> tuple[list[dict], int]:
        """`colo history`: the jobs in `states` that ended at or after `since`, of `users` (where
        given), oldest first, only the newest `limit`; and how many more matched. Each as a dict of
        the fields report.job_figures reads (its spec: name, gpus, gpu_mem; with `full`, all of it),
        with its profile's run time alone and the slowdown predicted at its start where known."""
        where, args = self._ended_where(states, since, users)
        spec = "spec" if full else ("json_object('name', json_extract(spec, '$.name'), 'gpus', "
                                    "json_extract(spec, '$.gpus'), 'gpu_mem', json_extract(spec, '$.gpu_mem'))")
        q = (f"SELECT id, uid, gid, user, state, jobs.reason, exit_code, submitted_at, started_at, ended_at, jobs.gpus, "
             f"jobs.mode, attempts, {spec}, json_extract(d.details, '$.profile_runtime'), "
             f"json_extract(d.details, '$.predicted_slowdown') "
             f"FROM jobs LEFT JOIN decisions d ON d.job_id = jobs.id{where} "
             "ORDER BY id DESC")
        if limit:
            q += " LIMIT ?"
        rows = self.db.execute(q, [*args, limit] if limit else args).fetchall()
        more = 0
        if limit and len(rows) == limit:
            more = self.db.execute(f"SELECT count(*) FROM jobs{where}", args).fetchone()[0] - limit
        loads = json.loads
        keys = ("id", "uid", "gid", "user", "state", "reason", "exit_code", "submitted_at", "started_at",
                "ended_at", "gpus", "mode", "attempts")
        out = []
        for r in reversed(rows):
            row = dict(zip(keys, r))
            row["gpus"] = loads(r[10])
            row["spec"] = self._full(r[13]) if full else loads(r[13])
            row["alone_s"], row["predicted_slowdown"] = r[14], r[15]
            out.append(row)
        return out, more

    # One job's figures as report.job_figures makes them, in SQL (`colo report` adds them up here).
    _FIGURES = """
        SELECT user, jobs.state AS state, ran, ngpus, budget, waited,
               CASE WHEN alone > 0 AND ran > 0 AND jobs.state = 'succeeded' THEN ran / alone END AS slow
        FROM (SELECT *,
                CASE WHEN started_at IS NULL THEN 0.0
                     ELSE max(0.0, coalesce(ended_at, started_at) - started_at) END AS ran,
                CASE WHEN json_array_length(gpus) > 0 THEN json_array_length(gpus)
                     WHEN started_at IS NULL THEN 0 ELSE coalesce(json_extract(spec, '$.gpus'), 0) END AS ngpus,
                coalesce(json_extract(spec, '$.gpu_mem'), 0) AS budget,
                max(0.0, coalesce(started_at, ended_at, submitted_at) - submitted_at) AS waited
              FROM jobs{where}) AS jobs
        LEFT JOIN (SELECT job_id, json_extract(details, '$.profile_runtime') AS alone FROM decisions) AS d
          ON d.job_id = jobs.id"""

    def report_users(self, states: Iterable[State], since: float | None = None,
                     users: Iterable[str] | None = None) -> list[dict]:
        """`colo report` per user, added up here (not a row per job out): jobs, succeeded, failed,
        GPU-hours one per GPU, GiB-hours budgeted, waiting (median, max) and slowdown against alone
        (over the jobs where known: how many, median, max); medians as report.py takes them (the
        value at n // 2 sorted)."""
        where, args = self._ended_where(states, since, users)
        f = self._FIGURES.format(where=where)
        out = {r[0]: {"user": r[0], "jobs": r[1], "succeeded": r[2], "failed": r[3], "gpu_hours": r[4],
                      "gib_hours_budgeted": r[5], "wait_max": r[6], "wait_median": 0.0, "slowdown_jobs": r[7],
                      "slowdown_median": None, "slowdown_max": r[8]}
               for r in self.db.execute(
                   f"SELECT user, count(*), sum(state = 'succeeded'), sum(state IN ('failed', 'lost')), "
                   f"total(ngpus * ran) / 3600.0, total(budget * ngpus * ran) / 3600.0 / {1024**3}, "
                   f"max(waited), count(slow), max(slow) FROM ({f}) GROUP BY user", args)}
        for col, key in (("waited", "wait_median"), ("slow", "slowdown_median")):
            for user, v in self.db.execute(
                    f"SELECT user, {col} FROM (SELECT user, {col}, row_number() OVER (PARTITION BY user ORDER BY "
                    f"{col}) - 1 AS k, count(*) OVER (PARTITION BY user) AS n FROM ({f}) WHERE {col} IS NOT NULL) "
                    "WHERE k = n / 2", args):
                out[user][key] = v
        return list(out.values())

    def report_spans(self, states: Iterable[State], since: float | None = None,
                     users: Iterable[str] | None = None) -> Iterable[tuple[str, float, float]]:
        """(GPU, started_at, ended_at) of each job that ran, once per GPU it held, by GPU then start:
        read as they are used (report.spans_figures merges them), not all at once."""
        where, args = self._ended_where(states, since, users)
        return self.db.execute(
            f"SELECT g.value, started_at, ended_at FROM jobs, json_each(jobs.gpus) AS g{where} "
            "AND started_at IS NOT NULL AND ended_at > started_at ORDER BY g.value, started_at", args)

    def report_samples(self, states: Iterable[State], since: float | None = None,
                       users: Iterable[str] | None = None) -> Iterable[tuple[str, int, int, float, Any, Any]]:
        """(user, job, its GPUs, at, SM, memory) of each usage sample of the jobs that ended at or
        after `since`, by job then time: read as report.idle_hours adds them up, not all at once."""
        where, args = self._ended_where(states, since, users)
        return self.db.execute(
            f"SELECT user, s.job_id, max(json_array_length(jobs.gpus), 1), s.at, s.sm, s.mem "
            f"FROM jobs JOIN samples s ON s.job_id = jobs.id{where} ORDER BY s.job_id, s.at", args)

    def counters(self) -> dict[tuple[str, str], float]:
        """{(name, label): value} of the counters (colo/daemon/metrics.py)."""
        return {(n, lb): v for n, lb, v in self.db.execute("SELECT name, label, value FROM counters")}

    def add_counters(self, deltas: dict[tuple[str, str], float]) -> None:
        """Add each delta (>= 0) to its counter, all in one transaction."""
        with self.tx():
            self.db.executemany("INSERT INTO counters (name, label, value) VALUES (?, ?, ?) ON CONFLICT "
                                "(name, label) DO UPDATE SET value = value + excluded.value",
                                [(n, lb, v) for (n, lb), v in deltas.items() if v > 0])

    # decisions --------------------------------------------------------------------------------
    def record_decisions(self, decisions: Iterable[tuple[int, str, str | None, list[str], str, dict]],
                         now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self.tx():
            # a job removed meanwhile (colo clean: the writer thread's rows may be late) is skipped,
            # not a foreign-key error that would lose the whole batch
            self.db.executemany(
                "INSERT INTO decisions(job_id, at, action, mode, gpus, reason, details) SELECT ?,?,?,?,?,?,? "
                "WHERE EXISTS (SELECT 1 FROM jobs WHERE id=?) "
                "ON CONFLICT(job_id) DO UPDATE SET at=excluded.at, action=excluded.action, mode=excluded.mode, "
                "gpus=excluded.gpus, reason=excluded.reason, details=excluded.details",
                [(j, now, a, m, json.dumps(list(g)), r, json.dumps(d), j) for j, a, m, g, r, d in decisions])

    def decision(self, job_id: int) -> dict | None:
        r = self.db.execute("SELECT at, action, mode, gpus, reason, details FROM decisions WHERE job_id=?",
                            (job_id,)).fetchone()
        if r is None:
            return None
        return dict(at=r[0], action=r[1], mode=r[2], gpus=json.loads(r[3]), reason=r[4], details=json.loads(r[5]))

    def gpu_use(self, since: float) -> list[tuple[int, int, int, float, float]]:
        """(uid, budget, gpus, started_at, ended_at) of GPU jobs that ended after `since` (fair share),
        those removed since (cleaned_use) included."""
        return list(self.db.execute(
            "SELECT uid, json_extract(spec, '$.gpu_mem'), json_array_length(gpus), started_at, ended_at FROM jobs "
            "WHERE ended_at > ? AND started_at IS NOT NULL AND gpus != '[]' "
            "UNION ALL SELECT uid, budget, gpus, started_at, ended_at FROM cleaned_use WHERE ended_at > ?",
            (since, since)))

    # samples ----------------------------------------------------------------------------------
    def add_samples(self, rows: Iterable[tuple[int, float, float | None, int | None, float | None]]) -> None:
        with self.tx():  # a job removed since it was sampled is skipped (as in record_decisions)
            self.db.executemany("INSERT INTO samples(job_id, at, sm, mem, membw) SELECT ?,?,?,?,? "
                                "WHERE EXISTS (SELECT 1 FROM jobs WHERE id=?)", [(*r, r[0]) for r in rows])

    def samples(self, job_id: int) -> list[tuple[float, float | None, int | None, float | None]]:
        return list(self.db.execute("SELECT at, sm, mem, membw FROM samples WHERE job_id=? ORDER BY at", (job_id,)))

