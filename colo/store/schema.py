"""The schema: its migrations, and what is made at every open."""
from __future__ import annotations

import json
import sqlite3
from typing import Callable

from ..jobs import JobSpec


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
    # 13: `colo history --admin`: what root and the admin group (and colo's own fault drains) did,
    # to what and why; held to its newest actions (store/adminlog.py ADMIN_LOG_KEEP)
    """
    CREATE TABLE admin_log (
        id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, by TEXT NOT NULL, action TEXT NOT NULL,
        target TEXT NOT NULL, why TEXT NOT NULL DEFAULT ''
    );
    """,
    # 14: the rest of what the daemon learned (policy.Learned), so a restarted daemon decides as the
    # one before it: the levels of taking turns running groups and ends showed (learned_ts: `slow`
    # 0, explored as predicted, Learned.ts; 1, a group ran slower there, Learned.ts_slow), the early
    # warnings of running MPS groups (learned_live, Learned.live), each user's count of observations
    # (learned_clock, Learned.clock) and when a co-run pairing or bandwidth step was last taught in
    # that count (`clock`, Learned.at; NULL: before this schema, as old as the count's start)
    """
    CREATE TABLE learned_clock (uid INTEGER PRIMARY KEY, clock INTEGER NOT NULL);
    CREATE TABLE learned_ts (
        uid INTEGER NOT NULL, slow INTEGER NOT NULL, bin INTEGER NOT NULL, clock INTEGER NOT NULL,
        PRIMARY KEY (uid, slow, bin)
    );
    CREATE TABLE learned_live (
        uid INTEGER NOT NULL, mode TEXT NOT NULL, bin INTEGER NOT NULL, level REAL NOT NULL,
        clock INTEGER NOT NULL, PRIMARY KEY (uid, mode, bin)
    );
    ALTER TABLE learned_corun ADD COLUMN clock INTEGER;
    ALTER TABLE learned_bw ADD COLUMN clock INTEGER;
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

