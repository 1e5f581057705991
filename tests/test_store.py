"""The state database across colo versions: older schemas are migrated in place, nothing lost."""
from __future__ import annotations

import json
import sqlite3

import pytest

from colo.store import MIGRATIONS, Store, StoreError


def _v1_db(path):
    """A database as the first colo release left it: schema 1, one running job with events."""
    db = sqlite3.connect(path)
    db.executescript(f"BEGIN;{MIGRATIONS[0]};PRAGMA user_version=1;COMMIT;")
    spec = {"argv": ["sleep", "100"], "gpus": 1, "gpu_mem": 2**30, "runtime": "process"}
    db.execute("INSERT INTO jobs(spec, uid, gid, user, state, reason, submitted_at, started_at, gpus, mode, handle, "
               "attempts) VALUES (?, 1000, 1000, 'ada', 'running', 'started (process)', 1.0, 2.0, ?, 'mps', "
               "'123:4.5', 1)", (json.dumps(spec), json.dumps(["GPU-x"])))
    db.execute("INSERT INTO events(job_id, at, old_state, new_state, reason) VALUES (1, 2.0, 'starting', 'running', "
               "'started (process)')")
    db.commit()
    db.close()


def test_schema_1_is_migrated_and_keeps_every_job(tmp_path):
    path = tmp_path / "colo.db"
    _v1_db(path)
    s = Store(path)
    job = s.get(1)
    assert (job.state, job.user, job.gpus, job.handle, job.attempts) == ("running", "ada", ["GPU-x"], "123:4.5", 1)
    assert job.cancel_by is None and job.spec.argv == ["sleep", "100"]
    assert [e["new"] for e in s.events(1)] == ["running"]
    s.set_fields(1, cancel_by="ada")
    assert s.get(1).cancel_by == "ada"
    s.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)


def test_a_newer_schema_is_refused_and_left_as_it_is(tmp_path):
    path = tmp_path / "colo.db"
    _v1_db(path)
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this colo"):
        Store(path)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) + 1  # not "migrated" back
    assert db.execute("SELECT id, user, state FROM jobs").fetchall() == [(1, "ada", "running")]


def test_a_second_store_in_the_daemon_keeps_its_commits_seen_by_other_processes(tmp_path):
    """The daemon opens the database twice (its store and the decision writer's). Opening the
    second once dropped the first's locks, so the next reader in another process to close took
    the WAL as its own and deleted it: later commits were unseen outside (and lost in a crash)."""
    import subprocess
    import sys

    from colo.jobs import JobSpec

    path = tmp_path / "colo.db"
    main = Store(path)
    other = Store(path)  # as DecisionWriter does, in the same process
    read = [sys.executable, "-c", "import sqlite3, sys; db = sqlite3.connect(sys.argv[1]); "
            "print(db.execute('SELECT count(*) FROM jobs').fetchone()[0]); db.close()", str(path)]
    spec = JobSpec(argv=["true"])
    seen = []
    for _ in range(2):
        main.add_job(spec, 0, 0, "root")
        seen.append(int(subprocess.run(read, capture_output=True, text=True, check=True).stdout))
    assert seen == [1, 2]
    other.close()
    main.close()
