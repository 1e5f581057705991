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


def test_history_and_report_in_sql_give_report_py_figures(tmp_path):
    """`colo report` adds up in SQL (Store.report_users) and from GPU spans read one at a time:
    the same figures report.report() makes from every row, on a random history; history's filters
    and bound in SQL pick the rows a filter over all of them would."""
    import random

    from colo import report as rp
    from colo.jobs import TERMINAL, JobSpec, Mode, State

    st, rnd, now = Store(tmp_path / "colo.db"), random.Random(3), 1_700_000_000.0
    with st.tx():
        for i in range(300):
            spec = JobSpec(argv=["x"], gpu_mem=rnd.choice([0, 1 << 30, 3 << 30]), gpus=rnd.choice([0, 1, 2]))
            j = st.add_job(spec, 1000 + i % 3, 1000, f"u{i % 3}", now=now + i * 100)
            if rnd.random() < 0.2:  # never started
                st.transition(j.id, State.CANCELLED, "x", now=now + i * 100 + 5)
                continue
            t0 = now + i * 100 + rnd.uniform(0, 50)
            st.transition(j.id, State.STARTING, "s", now=t0, gpus=rnd.sample(["A", "B", "C"], k=spec.gpus),
                          mode=Mode.MPS)
            st.transition(j.id, State.RUNNING, "r", now=t0 + 1)
            st.transition(j.id, rnd.choice([State.SUCCEEDED, State.FAILED, State.LOST]), "e",
                          now=t0 + rnd.uniform(1, 5000), exit_code=0)
            if rnd.random() < 0.5:
                st.record_decisions([(j.id, "start", "mps", [], "r", {"profile_runtime": rnd.uniform(100, 3000)})])
    every, left = st.history(TERMINAL)
    assert len(every) == 300 and left == 0 and set(every[0]["spec"]) == {"name", "gpus", "gpu_mem"}

    def close(a, b):
        if isinstance(a, float) and isinstance(b, float):
            return a == pytest.approx(b, rel=1e-9, abs=1e-9)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(map(close, a, b))
        return a == b

    for since in (None, now + 15000):
        for users in (None, ["u1"], ["u0", "u2"]):
            rows, left = st.history(TERMINAL, since, users)
            assert [r["id"] for r in rows] == [r["id"] for r in every if (since is None or r["ended_at"] >= since)
                                               and (users is None or r["user"] in users)] and left == 0
            want = rp.report(rows)
            got = rp.assemble(st.report_users(TERMINAL, since, users), st.report_spans(TERMINAL, since, users))
            assert want["jobs"] and close(got, want), (since, users)
            newest, more = st.history(TERMINAL, since, users, limit=10)
            assert newest == rows[-10:] and more == len(rows) - 10
    plan = " ".join(r[-1] for r in st.db.execute("EXPLAIN QUERY PLAN SELECT count(*) FROM jobs WHERE ended_at >= 1"))
    assert "jobs_ended" in plan, plan


def test_an_array_stores_its_spec_once_and_arrays_stored_before_are_slimmed_keeping_every_task(tmp_path):
    """Issue 52: a 1,000-task array copied its whole spec into every task. Its spec is stored once
    (array_specs), each task's row only what is its own; an edited task keeps what differs; a
    schema-8 database's arrays are slimmed when opened, every task read back as it was stored."""
    from dataclasses import replace

    from colo.jobs import JobSpec, State

    big = JobSpec(argv=["run", *["a" * 200] * 100], env={f"V{i}": "x" * 200 for i in range(100)}, name="sweep",
                  gpu_mem=2**30)
    path = tmp_path / "colo.db"
    db = sqlite3.connect(path)
    for i, step in enumerate(MIGRATIONS[:8]):  # schema 8: each task a whole copy
        db.executescript(f"BEGIN;{step};PRAGMA user_version={i + 1};COMMIT;")
    old = [replace(big, array_job=1, array_index=i, array_size=3) for i in range(3)]
    old[2] = replace(old[2], env={"ONLY": "mine"}, gpu_mem=2**31)  # one that differs
    for s in [*old, big]:
        db.execute("INSERT INTO jobs(spec, uid, gid, user, state, submitted_at) VALUES (?, 1000, 1000, 'ada', "
                   "'queued', 1.0)", (json.dumps(s.to_dict()),))
    db.commit()
    db.close()
    st = Store(path)
    assert [j.spec.to_dict() for j in st.jobs()] == [s.to_dict() for s in [*old, big]]
    size = dict(st.db.execute("SELECT id, length(spec) FROM jobs"))
    assert size[1] < 500 and size[2] < 500 and size[4] > 40_000, size  # the lone job keeps its own

    tasks = st.add_array(big, [4, 7, 9], 2, 1000, 1000, "ada", held_by="ada")
    a = tasks[0].id
    assert [(t.spec.array_job, t.spec.array_index, t.held_by) for t in tasks] == [(a, 4, "ada"), (a, 7, "ada"),
                                                                                  (a, 9, "ada")]
    assert tasks[1].spec.to_dict() == replace(big, array_job=a, array_index=7, array_size=3, array_limit=2).to_dict()
    assert tasks[1].spec.env is tasks[2].spec.env  # one copy in memory too
    assert max(length for (length,) in st.db.execute("SELECT length(spec) FROM jobs WHERE id >= ?", (a,))) < 500
    rows = st.listing(["id", "argv", "array", "name", "budget"], list(State))
    assert rows[-1] == (tasks[2].id, big.argv, f"{a}_9", "sweep", 2**30)
    st.change_queued(tasks[1].id, "edited", spec=replace(tasks[1].spec, name="renamed", env={"E": "1"}))
    again = Store(path)  # as a restarted daemon reads them
    assert [j.spec.to_dict() for j in again.jobs()] == [j.spec.to_dict() for j in st.jobs()]
    assert again.get(tasks[1].id).spec.env == {"E": "1"} and again.get(tasks[2].id).spec.env == big.env
    for t in tasks:
        st.transition(t.id, State.CANCELLED, "x")
    hist, _ = st.history([State.CANCELLED], full=True)
    assert [h["spec"]["env"] for h in hist] == [big.env, {"E": "1"}, big.env]
    assert sorted(st.remove_jobs([t.id for t in tasks], 0.0)) == [t.id for t in tasks]
    assert st.db.execute("SELECT array_job FROM array_specs").fetchall() == [(1,)]  # the removed array's went
    again.close()
    st.close()
