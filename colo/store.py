"""The durable state: jobs, their events and decisions, usage samples. The only module with SQL.

SQLite in WAL mode: every state change is one transaction, so a daemon killed at any moment
leaves each job in exactly one state, with the event that put it there.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from collections import OrderedDict
from dataclasses import replace
from sys import intern
from pathlib import Path
from typing import Any, Callable, Iterable

from .jobs import TERMINAL, Job, JobSpec, Mode, State, check_transition

# Each entry moves the schema from version i to i+1 (SQL, or a function of the connection run in
# one transaction); never edit one that has shipped.
MIGRATIONS: list[str | Callable[[sqlite3.Connection], None]] = [
    """
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        spec TEXT NOT NULL,
        uid INTEGER NOT NULL, gid INTEGER NOT NULL, user TEXT NOT NULL,
        state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '',
        priority INTEGER NOT NULL DEFAULT 0,
        submitted_at REAL NOT NULL, started_at REAL, ended_at REAL,
        exit_code INTEGER, gpus TEXT NOT NULL DEFAULT '[]', mode TEXT, handle TEXT,
        attempts INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX jobs_state ON jobs(state);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id INTEGER NOT NULL REFERENCES jobs(id),
        at REAL NOT NULL, old_state TEXT, new_state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX events_job ON events(job_id);
    CREATE TABLE decisions (
        job_id INTEGER PRIMARY KEY REFERENCES jobs(id),
        at REAL NOT NULL, action TEXT NOT NULL, mode TEXT, gpus TEXT NOT NULL DEFAULT '[]',
        reason TEXT NOT NULL, details TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE samples (
        job_id INTEGER NOT NULL REFERENCES jobs(id),
        at REAL NOT NULL, sm REAL, mem INTEGER, membw REAL
    );
    CREATE INDEX samples_job ON samples(job_id);
    """,
    # 2: who asked to cancel a running job, stored before it is stopped, so that a daemon that
    # dies mid-cancel finishes the cancel when it starts again
    """
    ALTER TABLE jobs ADD COLUMN cancel_by TEXT;
    """,
    # 3: `colo hold`: who holds a queued job back (NULL: not held)
    """
    ALTER TABLE jobs ADD COLUMN held_by TEXT;
    """,
    # 4: what the daemon learned from jobs' ends (colo/daemon/learner.py), per user (invariant 13),
    # so a restart does not forget it; and which profiles shared a running job's GPU
    """
    CREATE TABLE learned_corun (
        uid INTEGER NOT NULL, profile TEXT NOT NULL, neighbour TEXT NOT NULL, mode TEXT NOT NULL,
        runs INTEGER NOT NULL, factor REAL NOT NULL, at REAL NOT NULL,
        PRIMARY KEY (uid, profile, neighbour, mode)
    );
    CREATE TABLE learned_profile (
        uid INTEGER NOT NULL, profile TEXT NOT NULL,
        alone_runs INTEGER, alone_ratio REAL, max_mem INTEGER, at REAL NOT NULL,
        PRIMARY KEY (uid, profile)
    );
    CREATE TABLE learned_error (
        id INTEGER PRIMARY KEY AUTOINCREMENT, uid INTEGER NOT NULL, error REAL NOT NULL
    );
    CREATE INDEX learned_error_uid ON learned_error(uid, id);
    CREATE TABLE job_neighbours (
        job_id INTEGER NOT NULL REFERENCES jobs(id), profile TEXT NOT NULL,
        PRIMARY KEY (job_id, profile)
    );
    """,
    # 5: the learned bandwidth curve (policy.Learned.bw): extra slowdown per mode and step of summed
    # peak bandwidth a shared run started into
    """
    CREATE TABLE learned_bw (
        uid INTEGER NOT NULL, mode TEXT NOT NULL, bin INTEGER NOT NULL,
        runs INTEGER NOT NULL, factor REAL NOT NULL, at REAL NOT NULL,
        PRIMARY KEY (uid, mode, bin)
    );
    """,
    # 6: the GPU use of jobs `colo clean` or history_keep_days removed, kept while it still counts
    # for fair share (gpu_use), so that removing a job never gives its user a head start
    """
    CREATE TABLE cleaned_use (
        uid INTEGER NOT NULL, budget INTEGER NOT NULL, gpus INTEGER NOT NULL,
        started_at REAL NOT NULL, ended_at REAL NOT NULL
    );
    CREATE INDEX cleaned_use_ended ON cleaned_use(ended_at);
    """,
    # 7: the errors of predictions whose pairings runs had all shown (policy.Learned.errors_seen),
    # a list of their own beside all errors: the margin of seen pairings survives a restart
    """
    ALTER TABLE learned_error ADD COLUMN seen INTEGER NOT NULL DEFAULT 0;
    CREATE INDEX learned_error_seen ON learned_error(uid, seen, id);
    """,
    # 8: `colo pause`: who froze a running job (NULL: not paused), so a restarted daemon knows it
    """
    ALTER TABLE jobs ADD COLUMN paused_by TEXT;
    """,
    # 9: an array's spec once (array_specs), each task's row only what differs (_slim): a 1,000-task
    # array of a 120 KiB spec was 1,000 copies of it; arrays stored before are slimmed here
    lambda db: _migrate_arrays(db),
    # 10: `colo suspend`: a running job's checkpoint record (JSON), so a restarted daemon finishes
    # or undoes what it was doing and never leaves a job locked
    """
    ALTER TABLE jobs ADD COLUMN suspended TEXT;
    """,
    # 11: `colo drain`: GPUs (by uuid) no new job is placed on, who drained each and why, so that a
    # restarted daemon keeps them out of service until `colo undrain`
    """
    CREATE TABLE drains (
        uuid TEXT PRIMARY KEY, gpu_index INTEGER NOT NULL, by TEXT NOT NULL, reason TEXT NOT NULL,
        at REAL NOT NULL
    );
    """,
    # 12: `colo suspend`: the seconds a job spent suspended (its memory in host memory, nothing
    # running), which fair share and `colo report` do not count as GPU use (fairshare.held_span)
    """
    ALTER TABLE jobs ADD COLUMN off_gpu REAL NOT NULL DEFAULT 0;
    ALTER TABLE cleaned_use ADD COLUMN off_gpu REAL NOT NULL DEFAULT 0;
    """,
]

# Indexes for `colo ls` filters on ended jobs (user, name). Made at every open, not in MIGRATIONS:
# they hold no data, so a database of any version may have them or not.
_INDEXES = """
CREATE INDEX IF NOT EXISTS jobs_user ON jobs(user);
CREATE INDEX IF NOT EXISTS jobs_name ON jobs(json_extract(spec, '$.name'));
CREATE INDEX IF NOT EXISTS jobs_ended ON jobs(ended_at);
CREATE INDEX IF NOT EXISTS jobs_copy_of ON jobs(json_extract(spec, '$.copy_of'));
CREATE INDEX IF NOT EXISTS jobs_array ON jobs(json_extract(spec, '$.array_job'));
"""

# Counters that only go up (the metrics' *_seconds_total): added to as jobs run, never summed
# from the jobs retention keeps. Made at every open (IF NOT EXISTS), as a database of any version
# may have the table or not; it holds nothing a migration would need to carry.
_COUNTERS = """
CREATE TABLE IF NOT EXISTS counters (
    name TEXT NOT NULL, label TEXT NOT NULL, value REAL NOT NULL, PRIMARY KEY (name, label)
);
"""

# An array task's row keeps these (what the SQL here reads of a spec, and what differs per task) and
# whatever of its own differs from its array's spec (an edit, a --grow restart); the rest is read
# from array_specs. _SLIM marks such a row.
_TASK_OWN = frozenset({"name", "gpus", "gpu_mem", "priority", "array_job", "array_index", "copy_of"})
_SLIM = "_array_spec"
_ABSENT = object()
_SPEC_FIELDS = frozenset(JobSpec.__dataclass_fields__)


def _slim(full: dict, shared: dict) -> dict:
    """An array task's row: its own keys and those that differ from the array's spec `shared`."""
    return {_SLIM: 1, **{k: v for k, v in full.items() if k in _TASK_OWN or shared.get(k, _ABSENT) != v}}


def _shared_part(full: dict) -> dict:
    return {k: v for k, v in full.items() if k not in _TASK_OWN}


def _migrate_arrays(db: sqlite3.Connection) -> None:
    """Schema 9: array_specs, and the arrays stored before slimmed (their first task still here
    gives the spec they share; a task that differs keeps what differs). One array at a time."""
    db.execute("CREATE TABLE array_specs (array_job INTEGER PRIMARY KEY, spec TEXT NOT NULL)")
    arrays = [r[0] for r in db.execute("SELECT DISTINCT json_extract(spec, '$.array_job') FROM jobs "
                                       "WHERE json_extract(spec, '$.array_job') IS NOT NULL")]
    for a in arrays:
        ids = [r[0] for r in db.execute("SELECT id FROM jobs WHERE json_extract(spec, '$.array_job') = ? "
                                        "ORDER BY id", (a,))]
        shared: dict | None = None
        for i in ids:  # a task at a time: never a whole array's copies in memory
            full = json.loads(db.execute("SELECT spec FROM jobs WHERE id=?", (i,)).fetchone()[0])
            if shared is None:
                shared = _shared_part(full)
                db.execute("INSERT INTO array_specs(array_job, spec) VALUES (?, ?)", (a, json.dumps(shared)))
            db.execute("UPDATE jobs SET spec=? WHERE id=?", (json.dumps(_slim(full, shared)), i))

# What `colo ls` may ask for by field (protocol.LS_FIELDS), as SQL; the name expression is the
# jobs_name index's, so that a filter on it uses the index.
_LS_SQL = {
    "id": "id", "name": "json_extract(spec, '$.name')", "user": "user", "state": "state", "gpus": "gpus",
    "mode": "mode", "budget": "json_extract(spec, '$.gpu_mem')", "submitted_at": "submitted_at",
    "started_at": "started_at", "ended_at": "ended_at", "exit_code": "exit_code", "priority": "priority",
    "reason": "reason",
    "argv": "coalesce(json_extract(spec, '$.argv'), (SELECT json_extract(a.spec, '$.argv') FROM array_specs a "
            "WHERE a.array_job = json_extract(jobs.spec, '$.array_job')))",
    "array": "json_extract(spec, '$.array_job') || '_' || json_extract(spec, '$.array_index')",  # NULL: none
    "array_job": "json_extract(spec, '$.array_job')",
    "uid": "uid",  # not an ls field (protocol.LS_FIELDS): for the daemon's own checks (clean)
}
_LS_JSON = ("gpus", "argv")  # stored as JSON text

_JOB_COLS = ("id, spec, uid, gid, user, state, reason, submitted_at, started_at, ended_at, "
             "exit_code, gpus, mode, handle, attempts, cancel_by, held_by, paused_by, suspended, off_gpu")


class StoreError(RuntimeError):
    pass


class StoreFull(StoreError):
    """The state disk is full: the change was rolled back, nothing half-stored."""


class NotFound(KeyError):
    pass


def _is_full(e: BaseException | None) -> bool:
    return isinstance(e, sqlite3.OperationalError) and (
        getattr(e, "sqlite_errorcode", None) == 13 or "disk is full" in str(e))  # SQLITE_FULL


def _row_to_job(r: tuple, spec: JobSpec) -> Job:
    # user names and reasons repeat across a queue of thousands: one copy of each (sys.intern)
    return Job(
        id=r[0], spec=spec, uid=r[2], gid=r[3], user=intern(r[4]),
        state=State(r[5]), reason=intern(r[6]), submitted_at=r[7], started_at=r[8], ended_at=r[9],
        exit_code=r[10], gpus=json.loads(r[11]) if r[11] != "[]" else (), mode=Mode(r[12]) if r[12] else None,
        handle=r[13], attempts=r[14], cancel_by=r[15], held_by=r[16], paused_by=r[17],
        suspended=r[18], off_gpu=r[19])


def _decoded(rows: list[tuple], fields: list[str]) -> list[tuple]:
    """listing() rows with the fields stored as JSON text (_LS_JSON) as lists."""
    decode = [i for i, f in enumerate(fields) if f in _LS_JSON]
    if decode:
        loads = json.loads
        for k, r in enumerate(rows):
            r = list(r)
            for i in decode:
                r[i] = loads(r[i]) if r[i] is not None else []
            rows[k] = tuple(r)
    return rows


class Store:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            # Jobs' env and argv are in here: root only (README). SQLite gives -wal/-shm the db's mode.
            try:  # made root-only before SQLite makes it
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            except FileExistsError:
                # Never open and close an existing database file: closing any fd of it drops this
                # process's POSIX locks, SQLite's too (another Store here, the decision writer's),
                # and the next reader elsewhere to close then takes the WAL as its own and deletes
                # it: later commits went to an unlinked WAL, unseen by others and lost in a crash.
                pass
            if os.stat(self.path).st_uid == os.geteuid():  # else SQLite says what it cannot do
                os.chmod(self.path, 0o600)
            self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
            self._arrays: OrderedDict[int, tuple[dict, JobSpec]] = OrderedDict()
            self.db.execute("PRAGMA journal_mode=WAL")
            for side in ("-wal", "-shm"):  # made by an older colo with the default mode
                if os.path.exists(f"{self.path}{side}"):
                    os.chmod(f"{self.path}{side}", 0o600)
            self.db.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes in WAL
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.execute("PRAGMA busy_timeout=5000")
            ok = self.db.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise StoreError(f"state database {self.path} is damaged ({ok}); move it aside to start afresh")
            self._migrate()
            self.db.executescript(_INDEXES)
            self.db.executescript(_COUNTERS)
            self._check_writable()
        except (sqlite3.DatabaseError, OSError) as e:
            raise StoreError(f"state database {self.path} cannot be used: {e}") from e

    def _check_writable(self) -> None:
        """Refuse at start, not at the first job: a write that is rolled back."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            v = self.db.execute("PRAGMA user_version").fetchone()[0]
            self.db.execute(f"PRAGMA user_version={v}")
        finally:
            self.db.execute("ROLLBACK")

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            raise StoreError(f"state database {self.path} has schema {version}, newer than this colo "
                             f"({len(MIGRATIONS)}); upgrade colo")
        if version:
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "jobs" not in tables:
                raise StoreError(f"{self.path} is not a colo state database")
        elif self.db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            raise StoreError(f"{self.path} is not a colo state database")
        for i in range(version, len(MIGRATIONS)):
            step = MIGRATIONS[i]
            if callable(step):  # one that SQL alone cannot say, in one transaction as well
                with self.tx():
                    step(self.db)
                    self.db.execute(f"PRAGMA user_version={i + 1}")
                continue
            # executescript commits first, so the migration carries its own transaction.
            self.db.executescript(f"BEGIN IMMEDIATE;{step};PRAGMA user_version={i + 1};COMMIT;")

    def tx(self):
        return _Tx(self.db, self.path)

    # array tasks' specs: one copy of what they share, on disk and in memory ------------------------
    def _shared(self, array_job: int) -> tuple[dict, JobSpec] | None:
        """An array's stored spec (None: an array of none stored, as no slim row names), as read
        and as a spec its tasks' specs share their lists, texts and environment with. A few arrays
        are kept (ids are never reused, so a kept one is never stale)."""
        hit = self._arrays.get(array_job)
        if hit is not None:
            self._arrays.move_to_end(array_job)
            return hit
        r = self.db.execute("SELECT spec FROM array_specs WHERE array_job=?", (array_job,)).fetchone()
        if r is None:
            return None
        d = json.loads(r[0])
        hit = self._arrays[array_job] = (d, JobSpec.from_dict({"array_job": array_job, **d}))
        if len(self._arrays) > 64:
            self._arrays.popitem(last=False)
        return hit

    def _spec(self, text: str) -> JobSpec:
        d = json.loads(text)
        if d.pop(_SLIM, None) is None or (shared := self._shared(d["array_job"])) is None:
            return JobSpec.from_dict(d)
        base = shared[1]
        own = JobSpec.from_dict({"argv": (), **d})  # only d's keys are taken from it
        return replace(base, **{k: getattr(own, k) for k in d if k in _SPEC_FIELDS})

    def _full(self, text: str) -> dict:
        """A stored spec as a dict, an array task's with its array's."""
        d = json.loads(text)
        if d.pop(_SLIM, None) is None or (shared := self._shared(d["array_job"])) is None:
            return d
        return {**shared[0], **d}

    def _spec_text(self, spec: JobSpec | dict | str) -> str:
        """A spec as its row stores it: an array task's slim (its own keys and what differs)."""
        d = json.loads(spec) if isinstance(spec, str) else spec if isinstance(spec, dict) else spec.to_dict()
        a = d.get("array_job")
        shared = self._shared(a) if a is not None else None
        return json.dumps(d if shared is None else _slim(d, shared[0]))

    def _job(self, r: tuple) -> Job:
        return _row_to_job(r, self._spec(r[1]))

    def close(self) -> None:
        self.db.close()

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

    def _where(self, states: Iterable[State], users: Iterable[str] | None, names: Iterable[str] | None,
               refs: Iterable[str] | None = None) -> tuple[str, list[Any]]:
        states = [str(s) for s in states]
        q, args = f" WHERE state IN ({','.join('?' * len(states))})", states
        for expr, values in (("user", users), (_LS_SQL["name"], names)):
            if values is not None:
                values = list(values)
                q += f" AND {expr} IN ({','.join('?' * len(values))})"
                args += values
        if refs is not None:
            # as `colo ls REF` reads a job: digits are its id or its array's, other text its name or ARRAY_INDEX
            ids = [int(r) for r in refs if r.isascii() and r.isdigit()]
            texts = [r for r in refs if not (r.isascii() and r.isdigit())]
            ors = []
            for expr, values in (("id", ids), (_LS_SQL["array_job"], ids), (_LS_SQL["name"], texts),
                                 (_LS_SQL["array"], texts)):
                if values:
                    ors.append(f"{expr} IN ({','.join('?' * len(values))})")
                    args += values
            q += f" AND ({' OR '.join(ors) or '0'})"
        return q, args

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
             f"jobs.mode, attempts, off_gpu, {spec}, json_extract(d.details, '$.profile_runtime'), "
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
                "ended_at", "gpus", "mode", "attempts", "off_gpu")
        out = []
        for r in reversed(rows):
            row = dict(zip(keys, r))
            row["gpus"] = loads(r[10])
            row["spec"] = self._full(r[14]) if full else loads(r[14])
            row["alone_s"], row["predicted_slowdown"] = r[15], r[16]
            out.append(row)
        return out, more

    # One job's figures as report.job_figures makes them, in SQL (`colo report` adds them up here).
    _FIGURES = """
        SELECT user, jobs.state AS state, ran, held, ngpus, budget, waited,
               CASE WHEN alone > 0 AND ran > 0 AND jobs.state = 'succeeded' THEN ran / alone END AS slow
        FROM (SELECT *,
                CASE WHEN started_at IS NULL THEN 0.0
                     ELSE max(0.0, coalesce(ended_at, started_at) - started_at) END AS ran,
                CASE WHEN started_at IS NULL THEN 0.0
                     ELSE max(0.0, coalesce(ended_at, started_at) - started_at - off_gpu) END AS held,
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
                   f"total(ngpus * held) / 3600.0, total(budget * ngpus * held) / 3600.0 / {1024**3}, "
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
            if new == State.QUEUED:  # a new run: its time suspended starts again from none
                sets.update(started_at=None, handle=None, gpus="[]", mode=None, off_gpu=0.0)
            if new != State.RUNNING:
                sets.setdefault("paused_by", None)  # only a running job is paused
                sets.setdefault("suspended", None)  # or suspended
            if "ended_at" in sets:
                # a job that ends suspended: its time since the suspend is added to its time off
                # the GPU (the record's "at": when its checkpoint was done; suspend.Record)
                off = self.db.execute("SELECT off_gpu + CASE WHEN json_extract(suspended, '$.phase') = 'suspended' "
                                      "THEN max(0.0, ? - json_extract(suspended, '$.at')) ELSE 0.0 END FROM jobs "
                                      "WHERE id=? AND suspended IS NOT NULL", (sets.get("ended_at", now), job_id)).fetchone()
                if off is not None:
                    sets.setdefault("off_gpu", off[0])
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
        """(uid, budget, gpus, started_at, ended_at, off_gpu) of GPU jobs that ended after `since` (fair
        share), those removed since (cleaned_use) included."""
        return list(self.db.execute(
            "SELECT uid, json_extract(spec, '$.gpu_mem'), json_array_length(gpus), started_at, ended_at, off_gpu "
            "FROM jobs WHERE ended_at > ? AND started_at IS NOT NULL AND gpus != '[]' "
            "UNION ALL SELECT uid, budget, gpus, started_at, ended_at, off_gpu FROM cleaned_use WHERE ended_at > ?",
            (since, since)))

    # samples ----------------------------------------------------------------------------------
    def add_samples(self, rows: Iterable[tuple[int, float, float | None, int | None, float | None]]) -> None:
        with self.tx():  # a job removed since it was sampled is skipped (as in record_decisions)
            self.db.executemany("INSERT INTO samples(job_id, at, sm, mem, membw) SELECT ?,?,?,?,? "
                                "WHERE EXISTS (SELECT 1 FROM jobs WHERE id=?)", [(*r, r[0]) for r in rows])

    def samples(self, job_id: int) -> list[tuple[float, float | None, int | None, float | None]]:
        return list(self.db.execute("SELECT at, sm, mem, membw FROM samples WHERE job_id=? ORDER BY at", (job_id,)))


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
                "INSERT INTO cleaned_use(uid, budget, gpus, started_at, ended_at, off_gpu) "
                "SELECT uid, coalesce(json_extract(spec, '$.gpu_mem'), 0), json_array_length(gpus), started_at, ended_at, "
                "off_gpu "
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

    # learning -------------------------------------------------------------------------------
    def learned(self) -> dict[int, dict]:
        """Everything learned, per uid: {"corun": {(profile, neighbour, mode): (runs, factor)},
        "alone": {profile: (runs, ratio)}, "max_mem": {profile: bytes}, "errors": [oldest..newest],
        "errors_seen": [oldest..newest], "bw": {(mode, bin): (runs, factor)}};
        each dict in the order the entries were last changed (oldest first)."""
        out: dict[int, dict] = {}

        def of(uid: int) -> dict:
            return out.setdefault(uid, {"corun": {}, "alone": {}, "max_mem": {}, "errors": [], "errors_seen": [], "bw": {}})

        for uid, p, nb, m, runs, f in self.db.execute(
                "SELECT uid, profile, neighbour, mode, runs, factor FROM learned_corun ORDER BY at, rowid"):
            of(uid)["corun"][(p, nb, m)] = (runs, f)
        for uid, p, runs, ratio, mem in self.db.execute(
                "SELECT uid, profile, alone_runs, alone_ratio, max_mem FROM learned_profile ORDER BY at, rowid"):
            if runs is not None and ratio is not None:
                of(uid)["alone"][p] = (runs, ratio)
            if mem is not None:
                of(uid)["max_mem"][p] = mem
        for uid, e, seen in self.db.execute("SELECT uid, error, seen FROM learned_error ORDER BY id"):
            of(uid)["errors_seen" if seen else "errors"].append(e)
        for uid, m, b, runs, f in self.db.execute("SELECT uid, mode, bin, runs, factor FROM learned_bw ORDER BY at, rowid"):
            of(uid)["bw"][(m, b)] = (runs, f)
        return out

    def save_learned(self, uid: int, corun: dict | None = None, alone: dict | None = None,
                     max_mem: dict | None = None, errors: list[float] | None = None,
                     forget_corun: Iterable[tuple[str, str, str]] = (), forget_alone: Iterable[str] = (),
                     forget_mem: Iterable[str] = (), errors_add: list[float] = (), errors_keep: int = 0,
                     now: float | None = None, bw: dict | None = None, errors_seen: list[float] | None = None,
                     errors_seen_add: list[float] = (), errors_seen_keep: int = 0) -> None:
        """One user's changed entries in one transaction: `corun` {(p, nb, mode): (runs, factor)},
        `alone` {p: (runs, ratio)}, `max_mem` {p: bytes}; `errors` replaces that user's error list,
        or `errors_add` are appended to it and the newest `errors_keep` kept; the `forget_*`
        entries are removed (pruned); `bw` {(mode, bin): (runs, factor)} the bandwidth curve's steps;
        `errors_seen*` as `errors*`, for the list of seen pairings' errors."""
        now = time.time() if now is None else now
        with self.tx():
            self.db.executemany(
                "INSERT INTO learned_bw(uid, mode, bin, runs, factor, at) VALUES (?,?,?,?,?,?) "
                "ON CONFLICT(uid, mode, bin) DO UPDATE SET runs=excluded.runs, factor=excluded.factor, at=excluded.at",
                [(uid, m, int(b), int(r), float(f), now) for (m, b), (r, f) in (bw or {}).items()])
            self.db.executemany(
                "INSERT INTO learned_corun(uid, profile, neighbour, mode, runs, factor, at) VALUES (?,?,?,?,?,?,?) "
                "ON CONFLICT(uid, profile, neighbour, mode) DO UPDATE SET runs=excluded.runs, factor=excluded.factor, at=excluded.at",
                [(uid, p, nb, m, int(r), float(f), now) for (p, nb, m), (r, f) in (corun or {}).items()])
            self.db.executemany(
                "INSERT INTO learned_profile(uid, profile, alone_runs, alone_ratio, at) VALUES (?,?,?,?,?) "
                "ON CONFLICT(uid, profile) DO UPDATE SET alone_runs=excluded.alone_runs, alone_ratio=excluded.alone_ratio, "
                "at=excluded.at", [(uid, p, int(r), float(x), now) for p, (r, x) in (alone or {}).items()])
            self.db.executemany(
                "INSERT INTO learned_profile(uid, profile, max_mem, at) VALUES (?,?,?,?) "
                "ON CONFLICT(uid, profile) DO UPDATE SET max_mem=excluded.max_mem, at=excluded.at",
                [(uid, p, int(b), now) for p, b in (max_mem or {}).items()])
            for seen, whole, add, keep in ((0, errors, errors_add, errors_keep),
                                           (1, errors_seen, errors_seen_add, errors_seen_keep)):
                if whole is not None:
                    self.db.execute("DELETE FROM learned_error WHERE uid=? AND seen=?", (uid, seen))
                self.db.executemany("INSERT INTO learned_error(uid, error, seen) VALUES (?,?,?)",
                                    [(uid, float(e), seen) for e in (whole if whole is not None else add)])
                if add and keep:
                    self.db.execute("DELETE FROM learned_error WHERE uid=? AND seen=? AND id <= (SELECT id FROM "
                                    "learned_error WHERE uid=? AND seen=? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                                    (uid, seen, uid, seen, keep))
            self.db.executemany("DELETE FROM learned_corun WHERE uid=? AND profile=? AND neighbour=? AND mode=?",
                                [(uid, *k) for k in forget_corun])
            self.db.executemany("UPDATE learned_profile SET alone_runs=NULL, alone_ratio=NULL "
                                "WHERE uid=? AND profile=?", [(uid, p) for p in forget_alone])
            self.db.executemany("UPDATE learned_profile SET max_mem=NULL WHERE uid=? AND profile=?",
                                [(uid, p) for p in forget_mem])
            self.db.execute("DELETE FROM learned_profile WHERE uid=? AND alone_ratio IS NULL AND max_mem IS NULL",
                            (uid,))

    def add_neighbours(self, pairs: Iterable[tuple[int, str]], most: int, fresh: int | None = None) -> None:
        """(job id, profile that shares its GPU), each job keeping at most `most` names; job `fresh`
        (starting again) first forgets those of an earlier attempt. A start stores them in its own
        transaction instead (transition's `neighbours`)."""
        with self.tx():
            if fresh is not None:
                self.db.execute("DELETE FROM job_neighbours WHERE job_id=?", (fresh,))
            self.db.executemany(
                "INSERT OR IGNORE INTO job_neighbours(job_id, profile) SELECT ?, ? "
                "WHERE (SELECT count(*) FROM job_neighbours WHERE job_id=?) < ?",
                [(j, p, j, most) for j, p in pairs])

    def _put_neighbours(self, pairs: Iterable[tuple[int, str]], most: int, fresh: int) -> None:
        """At job `fresh`'s start (in its transaction): the neighbours of ended jobs whose end taught
        nothing are forgotten (prune_neighbours), then add_neighbours."""
        self.prune_neighbours(TERMINAL)
        self.add_neighbours(pairs, most, fresh)

    def neighbours(self, job_id: int) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT profile FROM job_neighbours WHERE job_id=?", (job_id,))}

    def take_neighbours(self, job_id: int) -> set[str]:
        """A job's neighbours, forgotten as they are read (at its end)."""
        with self.tx():
            out = self.neighbours(job_id)
            self.db.execute("DELETE FROM job_neighbours WHERE job_id=?", (job_id,))
        return out

    def prune_neighbours(self, ended: Iterable[State]) -> int:
        """Forget the neighbours of jobs in the `ended` states (ends that taught nothing: failed,
        cancelled, lost)."""
        states = [str(s) for s in ended]
        with self.tx():
            return self.db.execute(
                "DELETE FROM job_neighbours WHERE job_id IN "
                f"(SELECT job_id FROM job_neighbours JOIN jobs ON jobs.id = job_id "
                f"WHERE jobs.state IN ({','.join('?' * len(states))}))", states).rowcount


    # drained GPUs (colo drain) ------------------------------------------------------------------
    def drains(self) -> dict[str, dict]:
        """uuid -> {index, by, reason, at} of every drained GPU."""
        return {r[0]: dict(index=r[1], by=r[2], reason=r[3], at=r[4]) for r in self.db.execute(
            "SELECT uuid, gpu_index, by, reason, at FROM drains ORDER BY gpu_index")}

    def set_drain(self, uuid: str, index: int, by: str, reason: str, now: float | None = None) -> None:
        with self.tx():
            self.db.execute("INSERT OR REPLACE INTO drains(uuid, gpu_index, by, reason, at) VALUES (?,?,?,?,?)",
                            (uuid, index, by, reason, time.time() if now is None else now))

    def undrain(self, uuid: str) -> bool:
        """Whether it was drained."""
        with self.tx():
            return self.db.execute("DELETE FROM drains WHERE uuid=?", (uuid,)).rowcount > 0


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on error; nests as a no-op."""

    def __init__(self, db: sqlite3.Connection, path: Path):
        self.db, self.path = db, path
        self.outer = False

    def __enter__(self):
        if not self.db.in_transaction:
            self.db.execute("BEGIN IMMEDIATE")
            self.outer = True
        return self.db

    def __exit__(self, exc_type, exc, tb):
        if self.outer:
            if exc_type is None:
                try:
                    self.db.execute("COMMIT")
                except sqlite3.Error as e:
                    exc = e  # a failed COMMIT leaves the transaction open: later writes would join it
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
        if _is_full(exc):
            raise StoreFull(f"colo's state disk is full ({self.path.parent}): nothing was stored; "
                            "free some space there") from exc
        if exc is not None and exc_type is None:
            raise exc
        return False
