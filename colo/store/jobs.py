"""The jobs table: adding jobs, their state changes and events, reading them back."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any, Iterable

from ..jobs import Job, JobSpec, Mode, State, check_transition
from .base import _JOB_COLS, _LS_SQL, Base, NotFound, _decoded
from .schema import _shared_part, _slim


class Jobs(Base):
    # jobs -------------------------------------------------------------------------------------
    def add_job(self, spec: JobSpec, uid: int, gid: int, user: str, now: float | None = None,
                reason: str | None = None, held_by: str | None = None) -> Job:
        """held_by: queued held (`submit --hold`)."""
        now = time.time() if now is None else now
        reason = reason or f"submitted by {user}"
        with self.tx():
            cur = self.db.execute(
                "INSERT INTO jobs(spec, uid, gid, user, state, reason, priority, submitted_at, held_by) "
                "VALUES (?,?,?,?,?,?,?,?,?)",
                (json.dumps(spec.to_dict()), uid, gid, user, State.QUEUED.value, reason, spec.priority, now, held_by))
            job_id = cur.lastrowid
            self.db.execute("INSERT INTO events(job_id, at, old_state, new_state, reason) VALUES (?,?,?,?,?)",
                            (job_id, now, None, State.QUEUED.value, reason))
        return self.get(job_id)

    def add_array(self, spec: JobSpec, indices: list[int], limit: int | None, uid: int, gid: int, user: str,
                  now: float | None = None, held_by: str | None = None) -> list[Job]:
        """The tasks of a job array in one transaction: all or none. The array's id is its first
        task's job id, known once that row is in. What the tasks share is stored once (array_specs),
        each task's row holds its own keys (_slim)."""
        now = time.time() if now is None else now
        reason = f"submitted by {user}"
        full = replace(spec, array_job=0, array_index=indices[0], array_size=len(indices),
                       array_limit=limit).to_dict()
        shared = _shared_part(full)
        ids: list[int] = []
        with self.tx():
            for i in indices:
                row = _slim({**full, "array_job": ids[0] if ids else 0, "array_index": i}, shared)
                cur = self.db.execute(
                    "INSERT INTO jobs(spec, uid, gid, user, state, reason, priority, submitted_at, held_by) "
                    "VALUES (?,?,?,?,?,?,?,?,?)",
                    (json.dumps(row), uid, gid, user, State.QUEUED.value, reason, spec.priority, now, held_by))
                ids.append(cur.lastrowid)
                if len(ids) == 1:
                    self.db.execute("UPDATE jobs SET spec=? WHERE id=?",
                                    (json.dumps({**row, "array_job": ids[0]}), ids[0]))
                    self.db.execute("INSERT INTO array_specs(array_job, spec) VALUES (?,?)",
                                    (ids[0], json.dumps(shared)))
            self.db.executemany("INSERT INTO events(job_id, at, old_state, new_state, reason) VALUES (?,?,?,?,?)",
                                [(i, now, None, State.QUEUED.value, reason) for i in ids])
        return self.jobs_by_id(ids, ordered=True)

    def change_queued(self, job_id: int, reason: str, spec: JobSpec | None = None, held_by: Any = ...,
                      now: float | None = None) -> Job:
        """`colo edit`/`hold`/`release`: a queued job's spec or hold, with an event (queued -> queued)
        saying what changed; NotFound unless the job is still queued."""
        now = time.time() if now is None else now
        sets: dict[str, Any] = {}
        if spec is not None:
            sets.update(spec=self._spec_text(spec), priority=spec.priority)
        if held_by is not ...:
            sets["held_by"] = held_by
        with self.tx():
            cur = self.db.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in sets)} WHERE id=? AND state=?",
                                  (*sets.values(), job_id, State.QUEUED.value))
            if cur.rowcount != 1:
                raise NotFound(job_id)
            self.db.execute("INSERT INTO events(job_id, at, old_state, new_state, reason) VALUES (?,?,?,?,?)",
                            (job_id, now, State.QUEUED.value, State.QUEUED.value, reason))
        return self.get(job_id)

    def get(self, job_id: int) -> Job:
        r = self.db.execute(f"SELECT {_JOB_COLS} FROM jobs WHERE id=?", (job_id,)).fetchone()
        if r is None:
            raise NotFound(job_id)
        return self._job(r)

    def jobs(self, states: Iterable[State] | None = None, limit: int | None = None,
             newest_first: bool = False) -> list[Job]:
        q = f"SELECT {_JOB_COLS} FROM jobs"
        args: list[Any] = []
        if states is not None:
            states = list(states)
            q += f" WHERE state IN ({','.join('?' * len(states))})"
            args += [str(s) for s in states]
        q += " ORDER BY id DESC" if newest_first else " ORDER BY id"
        if limit:
            q += " LIMIT ?"
            args.append(limit)
        return [self._job(r) for r in self.db.execute(q, args)]

    def listing(self, fields: list[str], states: Iterable[State], users: Iterable[str] | None = None,
                names: Iterable[str] | None = None, limit: int | None = None,
                refs: Iterable[str] | None = None) -> list[tuple]:
        """`colo ls` of stored jobs: only `fields` (keys of _LS_SQL) of the jobs in `states` whose
        owner is one of `users`, whose name is one of `names` and that one of `refs` names (where
        given), oldest first; only the newest `limit`. gpus and argv come as lists."""
        where, args = self._where(states, users, names, refs)
        q = f"SELECT {', '.join(_LS_SQL[f] for f in fields)} FROM jobs{where} ORDER BY id DESC"
        if limit:
            q += " LIMIT ?"
            args.append(limit)
        rows = self.db.execute(q, args).fetchall()
        rows.reverse()
        return _decoded(rows, fields)

    def listing_by_id(self, fields: list[str], ids: list[int]) -> list[tuple]:
        """listing()'s `fields` of the jobs `ids`, in no order."""
        out: list[tuple] = []
        for k in range(0, len(ids), 500):
            part = ids[k:k + 500]
            out += self.db.execute(f"SELECT {', '.join(_LS_SQL[f] for f in fields)} FROM jobs "
                                   f"WHERE id IN ({','.join('?' * len(part))})", part).fetchall()
        return _decoded(out, fields)

    def jobs_by_id(self, ids: list[int], ordered: bool = False) -> list[Job]:
        """The jobs `ids`, in no order (`ordered`: by id)."""
        out: list[Job] = []
        for k in range(0, len(ids), 500):
            part = ids[k:k + 500]
            out += [self._job(r) for r in self.db.execute(
                f"SELECT {_JOB_COLS} FROM jobs WHERE id IN ({','.join('?' * len(part))})", part)]
        if ordered:
            out.sort(key=lambda j: j.id)
        return out

    def listing_counts(self, states: Iterable[State], users: Iterable[str] | None = None,
                       names: Iterable[str] | None = None, refs: Iterable[str] | None = None) -> dict[str, int]:
        """How many jobs listing() would give, per state."""
        where, args = self._where(states, users, names, refs)
        return dict(self.db.execute(f"SELECT state, count(*) FROM jobs{where} GROUP BY state", args).fetchall())


    def newest_copy(self, job_id: int) -> int | None:
        """The newest job `colo requeue` made as a copy of `job_id` (the jobs_copy_of index), if any."""
        return self.db.execute("SELECT max(id) FROM jobs WHERE json_extract(spec, '$.copy_of') = ?",
                               (job_id,)).fetchone()[0]

    def count(self) -> int:
        return self.db.execute("SELECT count(*) FROM jobs").fetchone()[0]

    def transition(self, job_id: int, new: State, reason: str = "", now: float | None = None,
                   neighbours: tuple[Iterable[tuple[int, str]], int] | None = None, **fields: Any) -> Job:
        """Move a job to `new`, checked against the one table of allowed transitions, with its event;
        at a start, `neighbours` (pairs, most: see add_neighbours) in the same transaction."""
        now = time.time() if now is None else now
        with self.tx():
            r = self.db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()
            if r is None:
                raise NotFound(job_id)
            old = State(r[0])
            check_transition(old, new)
            sets = {"state": new.value, "reason": reason, **fields}
            if new == State.RUNNING and "started_at" not in fields:
                sets["started_at"] = now
            if new in (State.SUCCEEDED, State.FAILED, State.CANCELLED, State.LOST):
                sets.setdefault("ended_at", now)
            if new == State.QUEUED:
                sets.update(started_at=None, handle=None, gpus="[]", mode=None)
            if new != State.RUNNING:
                sets.setdefault("paused_by", None)  # only a running job is paused
                sets.setdefault("suspended", None)  # or suspended
            for k in ("gpus",):
                if k in sets and not isinstance(sets[k], str):
                    sets[k] = json.dumps(list(sets[k]))
            if "spec" in sets:
                sets["spec"] = self._spec_text(sets["spec"])
            if isinstance(sets.get("mode"), Mode):
                sets["mode"] = sets["mode"].value
            cols = ", ".join(f"{k}=?" for k in sets)
            self.db.execute(f"UPDATE jobs SET {cols} WHERE id=?", (*sets.values(), job_id))
            self.db.execute("INSERT INTO events(job_id, at, old_state, new_state, reason) VALUES (?,?,?,?,?)",
                            (job_id, now, old.value, new.value, reason))
            if neighbours is not None:
                self._put_neighbours(*neighbours, fresh=job_id)
        return self.get(job_id)

    def set_fields(self, job_id: int, **fields: Any) -> None:
        """Facts that are not a state change (the runtime handle once known)."""
        if "gpus" in fields:
            fields["gpus"] = json.dumps(list(fields["gpus"]))
        cols = ", ".join(f"{k}=?" for k in fields)
        with self.tx():
            self.db.execute(f"UPDATE jobs SET {cols} WHERE id=?", (*fields.values(), job_id))

    def add_event(self, job_id: int, reason: str, now: float | None = None) -> None:
        """An event that is no state change (a suspend, a resume): in the job's history all the same."""
        with self.tx():
            r = self.db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()
            if r is None:
                raise NotFound(job_id)
            self.db.execute("INSERT INTO events(job_id, at, old_state, new_state, reason) VALUES (?,?,?,?,?)",
                            (job_id, time.time() if now is None else now, r[0], r[0], reason))

    def events(self, job_id: int) -> list[dict]:
        return [dict(at=r[0], old=r[1], new=r[2], reason=r[3]) for r in self.db.execute(
            "SELECT at, old_state, new_state, reason FROM events WHERE job_id=? ORDER BY id", (job_id,))]

