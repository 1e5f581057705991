"""Ended jobs do not pile up for ever: `colo clean` (pueue's clean) and the daemon's own purge
after `history_keep_days` (Slurm's PurgeJobAfter). A real daemon on simulated GPUs, the real CLI;
the other user is a real Unix user (a forked child that setuids)."""
from __future__ import annotations

import json
import os
import time

import pytest

from colo.client import Client
from colo.config import Config, ConfigError
from colo.jobs import TERMINAL, JobSpec, State
from colo.store import Store
from harness.daemon import DaemonProc, as_user, client_error, invoke_as, wait_for
from harness.node import SimNode

GiB, MiB = 1024**3, 1024**2



def ids(d: DaemonProc) -> set[int]:
    return {j["id"] for j in d.client.ls(all=True)}


def logs_of(d: DaemonProc, job_id: int) -> list[str]:
    return sorted(p.name for p in (d.state_dir / "logs").glob(f"{job_id}.*"))


def test_clean_removes_only_ended_jobs_of_their_owner_with_their_logs(shared, other_user):
    d = shared
    gate = d.root / "go"
    ok = d.submit("--process", "--gpus", "0", "--name", "ok", "--", "echo", "fine")
    bad = d.submit("--process", "--gpus", "0", "--", "sh", "-c", "echo no; exit 3")
    run = d.submit("--process", "--gpus", "0", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    after = d.submit("--process", "--gpus", "0", "--after-any", str(ok), "--after-any", str(run), "--", "true")
    arr = json.loads(d.cli("submit", "--json", "--process", "--gpus", "0", "--array", "0-1", "--", "sh", "-c",
                           f'[ "$COLO_ARRAY_INDEX" = 0 ] || while [ ! -e {gate} ]; do sleep 0.05; done',
                           check=True).stdout)["tasks"]
    spec = {"argv": ["echo", "theirs"], "gpus": 0, "workdir": "/tmp"}
    kind, theirs = as_user(other_user, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", theirs
    for j, st in ((ok, "succeeded"), (bad, "failed"), (theirs, "succeeded"), (arr[0], "succeeded")):
        d.wait_state(j, st)
    d.wait_state(run, "running")
    assert logs_of(d, ok) == [f"{ok}.log"]

    # another user may not clean root's jobs, named or by --user; their own `clean` takes only theirs
    code, out = invoke_as(other_user, d, "clean", str(ok))
    assert code == 1 and out == f"colo: job {ok} belongs to root; you may not clean it\n", out
    code, out = invoke_as(other_user, d, "clean", "-u", "root")
    assert code == 1 and "only root and the admin group may clean other users' jobs" in out, out
    code, out = invoke_as(other_user, d, "clean", "ok")  # a name means their own jobs: they have none so named
    assert code == 1 and "no job 'ok' of yours" in out and out.count("\n") == 1, out
    assert invoke_as(other_user, d, "clean") == (0, "removed 1 ended job\n")
    assert theirs not in ids(d) and logs_of(d, theirs) == [] and logs_of(d, ok) == [f"{ok}.log"]

    # bad input: one line, exit 1, nothing removed
    before = ids(d)
    for args, said in ((("clean", str(run)), f"job {run} is running: only ended jobs are cleaned"),
                       (("clean", str(bad), "nosuch"), "no job 'nosuch'"),
                       (("clean", str(bad), str(run)), f"job {run} is running"),
                       (("clean", str(arr[0])), f"job {arr[0]} is a task of array {arr[0]}"),  # the array's id: all tasks
                       (("clean", f"{arr[0]}_0"), f"job {arr[0]} is a task of array {arr[0]}, which has tasks not ended"),
                       (("clean", str(ok)), f"queued job {after} depends on job {ok}"),
                       (("clean", "--before", "yesterday"), "malformed --before 'yesterday'"),
                       (("clean", "--failed-only", "--succeeded-only"), "exclude each other")):
        r = d.cli(*args)
        assert r.returncode == 1 and said in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    assert ids(d) == before
    # the socket request is checked whatever a client sends
    for bad_args in ({"states": ["running"]}, {"refs": str(ok)}, {"refs": [""]}, {"before": -1}, {"before": "1d"},
                     {"users": [7]}, {"refs": [str(i) for i in range(1001)]}, {"all": True}):
        err = client_error(lambda: d.client.call("clean", **bad_args))
        assert err is not None and err[1] == "bad_request", (bad_args, err)
    assert ids(d) == before

    # a symlink or a folder where a job's files would be is never followed: the link goes, not its target
    outside = d.root / "outside"
    outside.write_text("keep me")
    os.symlink(outside, d.state_dir / "logs" / f"{bad}.times")
    (d.state_dir / "logs" / f"{bad}.cursor").mkdir()
    assert d.cli("clean", "--failed-only", "--before", "2099-01-01", f"00{bad}", check=True).stdout == \
        "removed 1 ended job\n"
    assert bad not in ids(d) and logs_of(d, bad) == [f"{bad}.cursor"] and outside.read_text() == "keep me"
    # ok is kept while a queued job depends on it; the running job, its array's open task and the queued one stay
    assert d.cli("clean", check=True).stdout == ("removed 0 ended jobs (2 kept for now: queued jobs depend on them, "
                                                 "their arrays have tasks not ended, or their containers are still "
                                                 "to be removed)\n")
    assert ids(d) == before - {bad}
    gate.touch()
    for j in (run, after, arr[1]):
        d.wait_state(j, "succeeded", "failed")
    n = len(ids(d))
    assert d.cli("clean", check=True).stdout == f"removed {n} ended jobs\n"
    assert ids(d) == set() and d.client.history(0)["jobs"] == []
    assert not any(p.name.split(".")[0] in {str(j) for j in before} and p.name != f"{bad}.cursor"
                   for p in (d.state_dir / "logs").iterdir())
    # a restarted daemon brings none back, never hands their ids out again, and refuses --after one
    d.stop()
    d.start()
    assert ids(d) == set()
    new = d.submit("--process", "--gpus", "0", "--", "true")
    assert new > max(before)
    r = d.cli("submit", "--process", "--gpus", "0", "--after", str(ok), "--", "true")
    assert r.returncode == 1 and f"--after {ok}: no such job" in r.stderr and "colo clean" in r.stderr, r.stderr


def _with_home(n: SimNode):
    (n.root / "d").mkdir(mode=0o755)
    return n.parts()


pytestmark = pytest.mark.node("colo-retain-", profiles={"pair": dict(sm=0.3, mem=256 * MiB, membw=0.2, runtime=2.0)},
                              then=_with_home)


def test_learned_data_and_fair_share_outlive_cleaned_jobs_and_history_keep_days_purges(node):
    root, state, prof = node
    cfg = {"profile_dirs": [str(prof)]}
    d = DaemonProc(root / "d", state, cfg).start()
    try:
        burn = str(next(d.state_dir.glob("native-*")) / "colo-burn")
        # the user's own copy of the profile (as `colo profile record` hands it over), so that one
        # exists whatever this run's samples teach under load
        d.client.profile_put((prof / "pair.profile").read_text())
        own = d.state_dir / "profiles" / "users" / "0" / "pair.profile"
        assert own.is_file()
        gpu = d.submit("--process", "--gpu-mem", "1GiB", "--profile", "pair", "--", burn, "--mem", "300MiB",
                       "--duty", "30", "--seconds", "2")
        d.wait_state(gpu, "succeeded", timeout=60)

        def shown():
            return json.loads(d.cli("profile", "show", "pair", "--json", check=True).stdout)

        # its run alone against the profile's (stored in the same step as all it taught; no samples needed)
        learned = wait_for(lambda: (s := shown())["learned"].get("alone") and s["learned"], 30, "its end learned")
        runs = shown()["runs"]
        job = d.job(gpu)
        assert d.cli("clean", str(gpu), check=True).stdout == "removed 1 ended job\n"
        assert gpu not in ids(d) and (shown()["learned"], shown()["runs"]) == (learned, runs) and own.is_file()
        # jobs to age: one that ended "3 days ago", one that ended now. The old one runs until the
        # sampler has noted its line (logs/ID.times), so the purge is seen to take that file too;
        # whether the sampler sees the short new one alive is the machine's timing: it may have both.
        gate = root / "old-may-end"
        old = d.submit("--process", "--gpus", "0", "--", "sh", "-c",
                       f"echo old; while [ ! -e {gate} ]; do sleep 0.1; done")
        wait_for(lambda: (d.state_dir / "logs" / f"{old}.times").is_file(), 60, "the sampler's note of old's line")
        gate.touch()
        new = d.submit("--process", "--gpus", "0", "--", "echo", "new")
        for j in (old, new):
            d.wait_state(j, "succeeded")
        assert logs_of(d, old) == [f"{old}.log", f"{old}.times"]
    finally:
        d.stop()
    st = Store(d.state_dir / "colo.db")
    # the cleaned job's GPU use still counts for fair share after a restart (read where the daemon reads it)
    assert (0, GiB, 1, pytest.approx(job["started_at"]), pytest.approx(job["ended_at"]), 0.0) in st.gpu_use(0)
    st.set_fields(old, ended_at=time.time() - 3 * 86400)
    st.close()
    d = DaemonProc(root / "d", state, {**cfg, "history_keep_days": 1}).start()
    try:
        wait_for(lambda: old not in ids(d), 30, "the purge of the job that ended 3 days ago")
        assert ids(d) == {new} and logs_of(d, old) == [] and logs_of(d, new) in ([f"{new}.log"], [f"{new}.log", f"{new}.times"])
        assert (shown()["learned"], shown()["runs"]) == (learned, runs)
    finally:
        d.stop()


def test_store_removes_only_ended_jobs_and_keeps_what_counts_for_fair_share(tmp_path):
    st = Store(tmp_path / "colo.db")
    spec = JobSpec(argv=["true"], gpu_mem=GiB)
    a, b, c = (st.add_job(spec, 1000, 1000, "alice", now=100.0).id for _ in range(3))
    for j in (a, b):
        st.transition(j, State.STARTING, now=100.0)
        st.transition(j, State.RUNNING, now=110.0, gpus=["GPU-0"])
        st.add_samples([(j, 111.0, 0.5, 1, 0.1), (j, 112.0, 0.5, 1, 0.1)])
    st.transition(a, State.SUCCEEDED, now=200.0, exit_code=0)
    st.record_decisions([(a, "start", "mps", ["GPU-0"], "x", {})], now=100.0)
    assert st.cleanable([State.SUCCEEDED, State.QUEUED], user="alice") == [(a, None, 200.0)]
    assert st.cleanable(TERMINAL, before=200.0) == [] and st.cleanable(TERMINAL, before=201.0) == [(a, None, 200.0)]
    assert st.cleanable(TERMINAL, user="bob") == [] and st.cleanable(TERMINAL, user="alice", uid=1) == []
    assert st.remove_samples([a, b, c], most=1) == 1  # a's, never the running b's
    assert st.remove_jobs([a, b, c], keep_use_since=150.0) == [a]  # b runs, c is queued: kept
    assert [j.id for j in st.jobs()] == [b, c] and len(st.samples(b)) == 2 and st.decision(a) is None
    assert st.gpu_use(0) == [(1000, GiB, 1, 110.0, 200.0, 0.0)]  # from cleaned_use
    st.record_decisions([(a, "wait", None, [], "late", {})])  # a late writer's row for it: skipped
    st.add_samples([(a, 300.0, 0.1, 1, 0.1)])
    assert st.decision(a) is None and st.samples(a) == []
    st.transition(b, State.FAILED, now=300.0)
    assert st.remove_jobs([b], keep_use_since=250.0) == [b]  # a's use is older than that: dropped
    assert st.gpu_use(0) == [(1000, GiB, 1, 110.0, 300.0, 0.0)]
    st.transition(c, State.CANCELLED, now=300.0)
    assert st.remove_jobs([c], keep_use_since=250.0) == [c]  # never started: no use to keep
    assert st.jobs() == [] and len(st.gpu_use(0)) == 1
    assert st.add_job(spec, 1000, 1000, "alice").id == c + 1  # the newest id removed is never handed out again
    st.close()


def test_history_keep_days_must_be_a_number_of_days(tmp_path):
    for bad in ("-1", "true", '"30d"', "nan"):
        (tmp_path / "c.toml").write_text(f"history_keep_days = {bad}\n")
        with pytest.raises(ConfigError, match="history_keep_days"):
            Config.load(tmp_path / "c.toml")
    (tmp_path / "c.toml").write_text("history_keep_days = 0.5\n")
    assert Config.load(tmp_path / "c.toml").history_keep_days == 0.5
    assert Config().history_keep_days == 90  # a quarter, unless told


def test_a_jobs_time_suspended_is_kept_with_it_cleaned_or_not_and_starts_again_when_requeued(tmp_path):
    st = Store(tmp_path / "colo.db")
    spec = JobSpec(argv=["true"], gpu_mem=GiB)
    a, b = (st.add_job(spec, 1000, 1000, "alice", now=100.0).id for _ in range(2))
    for j in (a, b):
        st.transition(j, State.STARTING, now=100.0)
        st.transition(j, State.RUNNING, now=110.0, gpus=["GPU-0"])
        st.set_fields(j, off_gpu=20.0, suspended=json.dumps({"phase": "suspended", "by": "alice", "at": 150.0}))
    st.transition(a, State.CANCELLED, now=200.0)  # ends suspended: 20 s before, 50 s since its checkpoint
    assert st.get(a).off_gpu == 70.0 and st.get(a).suspended is None
    assert st.remove_jobs([a], keep_use_since=0.0) == [a]
    assert st.gpu_use(0) == [(1000, GiB, 1, 110.0, 200.0, 70.0)]  # from cleaned_use
    st.transition(b, State.QUEUED, "requeued", now=200.0)  # a new run: nothing suspended yet
    assert st.get(b).off_gpu == 0.0 and st.get(b).suspended is None
