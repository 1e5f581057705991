"""The database itself: opening and migrating it, transactions, the errors, a row as a Job."""
from __future__ import annotations

import json
import os
import sqlite3
from collections import OrderedDict
from dataclasses import replace
from sys import intern
from pathlib import Path
from typing import Any, Iterable

from ..jobs import Job, JobSpec, Mode, State, shared_int
from .schema import _COUNTERS, _INDEXES, _SLIM, _SPEC_FIELDS, MIGRATIONS, _slim

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
        id=r[0], spec=spec, uid=shared_int(r[2]), gid=shared_int(r[3]), user=intern(r[4]),
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


class Base:
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
