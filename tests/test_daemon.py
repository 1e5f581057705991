"""The daemon end to end with host-process jobs: a real daemon, real CLI, real SQLite, real processes.

Jobs that must stay running wait for a file the test creates ("gate"), so no test sleeps to
synchronise.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from colo.client import Client, DaemonUnavailable
from harness.daemon import DaemonProc, as_user, wait_for

GiB = 1024**3


def gate_cmd(gate, then: str = "exit 0") -> list[str]:
    return ["--", "sh", "-c", f"echo started; while [ ! -e {gate} ]; do sleep 0.05; done; {then}"]


def test_process_job_lifecycle_logs_and_exit_code(daemon, tmp_path):
    j = daemon.submit("--process", "--gpus", "0", "--name", "hello", "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    r = daemon.cli("wait", str(j))
    assert r.returncode == 3
    job = daemon.job(j)
    assert job["state"] == "failed" and job["exit_code"] == 3 and "exited with code 3" in job["reason"]
    why = daemon.cli("explain", str(j), check=True).stdout.splitlines()
    # how it ended comes first, then where it had been placed
    assert why[0].startswith(f"job {j} (failed): ") and "exited with code 3" in why[0], why
    assert why[1] == "placed: needs no GPU", why
    out = daemon.cli("logs", str(j), check=True).stdout
    assert "out\n" in out and "err\n" in out
    states = [e["new"] for e in job["events"]]
    assert states == ["queued", "starting", "running", "failed"]


def test_wait_returns_first_nonzero_and_ls_json(daemon):
    a = daemon.submit("--process", "--gpus", "0", "--", "true")
    b = daemon.submit("--process", "--gpus", "0", "--", "sh", "-c", "exit 7")
    assert daemon.cli("wait", str(a)).returncode == 0
    assert daemon.cli("wait", str(a), str(b)).returncode == 7
    rows = json.loads(daemon.cli("ls", "--all", "--json", check=True).stdout)
    assert {r["id"]: r["state"] for r in rows} == {a: "succeeded", b: "failed"}
    table = daemon.cli("ls", "--all", check=True).stdout.splitlines()
    assert table[0].split()[:5] == ["ID", "NAME", "USER", "STATE", "GPU"] and len(table) == 3


def test_logs_follow_streams_until_end(daemon, tmp_path):
    gate = tmp_path / "go"
    j = daemon.submit("--process", "--gpus", "0", *gate_cmd(gate, "echo finished"))
    daemon.wait_state(j, "running")
    p = subprocess.Popen(daemon.cli_args("logs", "-f", str(j)), stdout=subprocess.PIPE, text=True, env=daemon.env())
    assert p.stdout.readline() == "started\n"
    gate.touch()
    rest = p.stdout.read()
    assert p.wait(30) == 0 and "finished" in rest


def test_budget_admission_best_fit_and_backfill(daemon, tmp_path):
    gate = tmp_path / "go"
    big = [daemon.submit("--process", "--gpu-mem", "10GiB", *gate_cmd(gate)) for _ in range(3)]
    daemon.wait_state(big[0], "running")
    daemon.wait_state(big[1], "running")
    j0, j1 = daemon.job(big[0]), daemon.job(big[1])
    assert j0["gpus"] != j1["gpus"]  # 10 + 10 > 16: one per GPU
    waiting = daemon.job(big[2])
    assert waiting["state"] == "queued" and "waiting for memory" in waiting["reason"]
    small = daemon.submit("--process", "--gpu-mem", "6GiB", *gate_cmd(gate))  # backfills behind the big one
    daemon.wait_state(small, "running")
    gpus = daemon.client.gpus()["gpus"]
    for g in gpus:  # invariant 1
        assert g["budgeted"] <= g["usable"]
    gate.touch()
    for j in [*big, small]:
        daemon.wait_state(j, "succeeded")
    assert "CUDA_VISIBLE_DEVICES" not in daemon.job(small)["spec"]["env"]


def test_priority_then_fifo(daemon, tmp_path):
    gates = [tmp_path / "go0", tmp_path / "go1"]
    hog = [daemon.submit("--process", "--gpu-mem", "16GiB", *gate_cmd(g)) for g in gates]
    for h in hog:
        daemon.wait_state(h, "running")
    low = daemon.submit("--process", "--gpu-mem", "16GiB", "--", "true")
    high = daemon.submit("--process", "--gpu-mem", "16GiB", "--priority", "5", "--", "true")
    # one GPU frees at a time, so only one of them can take it: the higher priority one, though
    # submitted last (were both to free in one pass, both would start in it, in either order)
    gates[0].touch()
    daemon.wait_state(low, "succeeded")
    daemon.wait_state(high, "succeeded")

    def at(j, state):  # when the job entered `state` (the daemon's clock, from its events)
        return next(e["at"] for e in daemon.job(j)["events"] if e["new"] == state)

    assert at(high, "starting") < at(low, "starting")
    assert at(low, "starting") >= at(high, "succeeded")  # low had to wait for the GPU high freed
    gates[1].touch()
    daemon.wait_state(hog[1], "succeeded")


def test_a_big_job_passed_over_too_long_gets_a_gpu_drained_for_it(tmp_path, fakegpu):
    d = DaemonProc(tmp_path, fakegpu.state, config={"hold_after": 1.0}).start()
    try:
        gates = [tmp_path / "g0", tmp_path / "g1"]
        first = [d.submit("--process", "--gpu-mem", "10GiB", *gate_cmd(g)) for g in gates]
        on = {d.wait_state(j, "running")["gpus"][0]: j for j in first}  # one per GPU: 6 GiB left on each
        big = d.submit("--process", "--gpu-mem", "16GiB", "--", "true")
        why = wait_for(lambda: "held for it" in (r := d.job(big)["reason"]) and r, 20, "a GPU to be held")
        held = int(why.split("; GPU")[-1].split(" ")[0])
        uuid = {g["index"]: g["uuid"] for g in d.client.gpus()["gpus"]}
        small = d.submit("--process", "--gpu-mem", "4GiB", *gate_cmd(tmp_path / "g2"))
        assert d.wait_state(small, "running")["gpus"] == [uuid[1 - held]]  # not on the held GPU
        more = d.submit("--process", "--gpu-mem", "4GiB", "--", "true")
        wait_for(lambda: f"GPU{held} is held for job {big}" in d.job(more)["reason"], 20, "the hold to be named")
        gates[first.index(on[uuid[held]])].touch()  # the held GPU drains: the big job takes it
        assert d.wait_state(big, "succeeded")["gpus"] == [uuid[held]]
        for g in (*gates, tmp_path / "g2"):
            g.touch()
        for j in (*first, small, more):
            d.wait_state(j, "succeeded")
    finally:
        d.stop()


def test_after_dependency(daemon, tmp_path):
    gate = tmp_path / "go"
    first = daemon.submit("--process", "--gpus", "0", *gate_cmd(gate))
    second = daemon.submit("--process", "--gpus", "0", "--after", str(first), "--", "true")
    daemon.wait_state(first, "running")
    assert daemon.job(second)["state"] == "queued"
    assert "waiting for job" in daemon.cli("explain", str(second), check=True).stdout
    gate.touch()
    daemon.wait_state(second, "succeeded")
    bad = daemon.submit("--process", "--gpus", "0", "--", "false")
    dep = daemon.submit("--process", "--gpus", "0", "--after", str(bad), "--", "true")
    j = daemon.wait_state(dep, "failed")
    assert f"dependency failed: job {bad}" in j["reason"]


def test_cancel_queued_and_running(daemon, tmp_path):
    gate = tmp_path / "never"
    run = daemon.submit("--process", "--gpus", "0", "--", "sh", "-c", "trap 'echo got TERM; exit 143' TERM; "
                        "echo started; while true; do sleep 0.05; done")
    daemon.wait_state(run, "running")
    wait_for(lambda: "started" in daemon.cli("logs", str(run)).stdout, what="job output")
    hog = [daemon.submit("--process", "--gpu-mem", "16GiB", *gate_cmd(gate)) for _ in range(2)]
    queued = daemon.submit("--process", "--gpu-mem", "16GiB", "--", "true")
    r = daemon.cli("cancel", str(queued))
    assert r.returncode == 0 and r.stdout == f"job {queued}: cancelled\n"
    assert daemon.job(queued)["state"] == "cancelled"
    r = daemon.cli("cancel", str(run))
    assert r.returncode == 0 and r.stdout in (f"job {run}: stopping\n", f"job {run}: cancelled\n"), r.stdout
    j = daemon.wait_state(run, "cancelled")
    assert "cancelled by" in j["reason"]
    assert "got TERM" in daemon.cli("logs", str(run)).stdout
    for h in hog:
        daemon.cli("cancel", str(h), check=True)
        daemon.wait_state(h, "cancelled")


def test_cancel_forces_after_grace(daemon):
    j = daemon.submit("--process", "--gpus", "0", "--", "sh", "-c", "trap '' TERM; echo started; "
                      "while true; do sleep 0.05; done")
    wait_for(lambda: "started" in daemon.cli("logs", str(j)).stdout, what="job output")
    daemon.cli("cancel", str(j), check=True)
    job = daemon.wait_state(j, "cancelled", timeout=20)
    assert job["exit_code"] == 137  # SIGKILL after the grace period


@pytest.mark.parametrize("args,needle", [
    (["--gpu-mem", "4XB"], "malformed size"),
    (["--gpu-mem", "-1G"], "malformed size"),
    (["--gpu-mem", "0"], "greater than zero"),
    (["--gpu-mem", "64GiB"], "can never run here"),
    (["--gpus", "3", "--gpu-mem", "1GiB"], "needs 3 GPUs"),
    (["--env", "LD_PRELOAD=/x.so", "--gpu-mem", "1GiB"], "set by colo itself"),
    (["--env", "COLO_GPU_BUDGET=99", "--gpu-mem", "1GiB"], "set by colo itself"),
    (["--after", "999", "--gpus", "0"], "no such job"),
])
def test_bad_submit_is_refused_and_stores_nothing(daemon, args, needle):
    r = daemon.cli("submit", "--process", *args, "--", "true")
    assert r.returncode != 0 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert daemon.client.ls() == []


def test_missing_command_and_unknown_job(daemon):
    r = daemon.cli("submit", "--process", "--gpus", "0")
    assert r.returncode != 0 and "missing command" in r.stderr
    for cmd in (["show", "42"], ["cancel", "42"], ["logs", "42"], ["wait", "42"]):
        r = daemon.cli(*cmd)
        assert r.returncode == 1 and r.stderr.strip() == "colo: no job 42", (cmd, r.stderr)


def test_job_that_cannot_exec(daemon):
    j = daemon.submit("--process", "--gpus", "0", "--", "/nonexistent/prog")
    assert daemon.cli("wait", str(j)).returncode == 127
    assert "cannot run /nonexistent/prog" in daemon.cli("logs", str(j)).stdout


def test_daemon_not_running_says_how_to_start(tmp_path):
    d = DaemonProc(tmp_path)
    r = d.cli("ls")
    assert r.returncode == 1 and "daemon is not running" in r.stderr and "colo daemon" in r.stderr


def test_second_daemon_on_same_state_dir_is_refused(daemon, tmp_path):
    other = DaemonProc(tmp_path)  # same state dir, other socket
    other.socket = tmp_path / "other.sock"
    r = other.cli("daemon", "--state-dir", str(daemon.state_dir), "--socket", str(other.socket))
    assert r.returncode == 1 and "another colo daemon" in r.stderr


def test_corrupt_database_refused_and_kept(tmp_path):
    d = DaemonProc(tmp_path)
    d.state_dir.mkdir(parents=True)
    db = d.state_dir / "colo.db"
    db.write_bytes(b"this is not sqlite" * 100)
    r = d.cli("daemon", "--state-dir", str(d.state_dir), "--socket", str(d.socket))
    assert r.returncode == 1 and str(db) in r.stderr
    assert db.read_bytes() == b"this is not sqlite" * 100


def test_restart_after_kill9_recovers_everything(daemon, tmp_path):
    gate = tmp_path / "go"
    done = daemon.submit("--process", "--gpus", "0", "--", "true")
    daemon.wait_state(done, "succeeded")
    running = daemon.submit("--process", "--gpu-mem", "12GiB", *gate_cmd(gate, "exit 5"))
    finishes_while_down = daemon.submit("--process", "--gpus", "0", *gate_cmd(tmp_path / "go2", "exit 4"))
    hog = daemon.submit("--process", "--gpu-mem", "12GiB", *gate_cmd(gate))
    queued = daemon.submit("--process", "--gpu-mem", "12GiB", "--", "true")
    for j in (running, finishes_while_down, hog):
        daemon.wait_state(j, "running")
    daemon.kill9()
    (tmp_path / "go2").touch()
    wait_for(lambda: (daemon.state_dir / "jobs" / str(finishes_while_down) / "exit").exists(),
             what="job to finish while the daemon is down")
    daemon.start()
    assert daemon.job(done)["state"] == "succeeded"
    assert daemon.job(running)["state"] == "running"
    j = daemon.wait_state(finishes_while_down, "failed")
    assert j["exit_code"] == 4
    assert daemon.job(queued)["state"] == "queued"
    gate.touch()
    assert daemon.wait_state(running, "failed")["exit_code"] == 5
    daemon.wait_state(queued, "succeeded")
    ids = [r["id"] for r in daemon.client.ls()]
    assert sorted(ids) == sorted({done, running, finishes_while_down, hog, queued})


def test_a_cancel_cut_short_by_a_daemon_crash_is_finished_at_restart(daemon):
    import threading

    # ignores SIGTERM (inherited by its children), so only the forced stop after the grace ends it
    j = daemon.submit("--process", "--gpus", "0", "--", "sh", "-c",
                      "trap '' TERM; echo started; while :; do sleep 0.05; done")
    wait_for(lambda: "started" in daemon.cli("logs", str(j)).stdout, what="the job to start")
    asking = threading.Thread(target=lambda: daemon.cli("cancel", str(j)), daemon=True)
    asking.start()
    wait_for(lambda: daemon.job(j)["cancel_by"], what="the cancel to be stored")
    daemon.kill9()  # within the grace: SIGTERM was sent and ignored, SIGKILL never came
    asking.join(30)
    daemon.start()
    job = daemon.wait_state(j, "cancelled", "failed", "lost", timeout=30)
    assert job["state"] == "cancelled" and job["reason"].startswith("cancelled by"), job
    assert job["exit_code"] == 137  # SIGKILL, after the grace, from the restarted daemon


def test_job_killed_with_its_shim_while_down_is_lost(daemon, tmp_path):
    j = daemon.submit("--process", "--gpus", "0", *gate_cmd(tmp_path / "never"))
    daemon.wait_state(j, "running")
    pid = _handle_pid(daemon, j)
    daemon.kill9()
    os.killpg(pid, 9)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
             what="job to die")
    daemon.start()
    job = daemon.wait_state(j, "lost")
    assert "lost" in job["reason"]


def _handle_pid(daemon, job_id) -> int:
    import sqlite3

    db = sqlite3.connect(daemon.state_dir / "colo.db")
    (handle,) = db.execute("SELECT handle FROM jobs WHERE id=?", (job_id,)).fetchone()
    db.close()
    return int(handle.split(":")[0])


def test_permissions_between_two_users(shared_daemon, other_user):
    d = shared_daemon
    mine = d.submit("--process", "--gpus", "0", *gate_cmd(d.root / "never"))
    spec = {"argv": ["id", "-u"], "gpus": 0, "workdir": "/tmp"}
    kind, theirs = as_user(other_user, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", theirs
    kind, final = as_user(other_user, lambda: Client(d.socket).wait([theirs]))
    assert kind == "ok" and final[0]["state"] == "succeeded", final
    kind, out = as_user(other_user, lambda: "".join(Client(d.socket).logs(theirs)))
    assert out.strip() == str(other_user.pw_uid)  # it ran as them
    kind, rows = as_user(other_user, lambda: Client(d.socket).ls())
    assert {r["id"] for r in rows} == {mine, theirs}  # everyone sees the queue
    for op in (lambda c: c.cancel(mine), lambda c: "".join(c.logs(mine)), lambda c: c.show(mine),
               lambda c: c.explain(mine)):
        kind, err = as_user(other_user, lambda: op(Client(d.socket)))
        assert kind == "err" and err[2] == "forbidden" and f"job {mine} belongs to root" in err[1], err
    assert d.job(mine)["state"] == "running"
    secret = d.root / "secret"
    secret.mkdir(mode=0o700)
    bad = {"argv": ["true"], "image": "x", "gpus": 0, "mounts": [f"{secret}:/data"]}
    kind, err = as_user(other_user, lambda: Client(d.socket).submit(bad))
    assert kind == "err" and err[2] == "forbidden" and "cannot read" in err[1], err
    for hostile, needle in (({"privileged": True}, "not allowed in a job"),
                            ({"mounts": ["/var/run/docker.sock:/s"]}, "not allowed"),
                            ({"mounts": [f"{d.state_dir}:/s"]}, "not allowed"),
                            ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "set by colo itself")):
        kind, err = as_user(other_user, lambda: Client(d.socket).submit({**bad, "mounts": [], **hostile}))
        assert kind == "err" and needle in err[1], (hostile, err)
    assert len(d.client.ls()) == 2  # nothing stored
    d.cli("cancel", str(mine), check=True)  # root may
    d.wait_state(mine, "cancelled")


def test_client_sees_daemon_going_away(daemon, tmp_path):
    j = daemon.submit("--process", "--gpus", "0", *gate_cmd(tmp_path / "never"))
    daemon.wait_state(j, "running")
    stream = Client(daemon.socket).stream("wait", ids=[j])
    assert next(stream) == {"waiting": [j]}  # the daemon holds the request now
    daemon.kill9()
    with pytest.raises(DaemonUnavailable, match="closed the connection"):
        next(stream)
    r = daemon.cli("wait", str(j))
    assert r.returncode == 1 and "daemon is not running" in r.stderr
    daemon.start()
    daemon.cli("cancel", str(j), check=True)
    daemon.wait_state(j, "cancelled")


def test_unwritable_database_refused_at_start_naming_the_file(other_user):
    tmp_path = Path(tempfile.mkdtemp(prefix="colo-ro-"))  # pytest's own tmp dirs are private to root
    d = DaemonProc(tmp_path)
    d.state_dir.mkdir(parents=True)
    from colo.store import Store

    Store(d.state_dir / "colo.db").close()
    for p in (tmp_path, d.state_dir):
        os.chmod(p, 0o755)
    os.chown(d.state_dir, other_user.pw_uid, other_user.pw_gid)  # the daemon's user owns its dir...
    os.chmod(d.state_dir / "colo.db", 0o444)  # ...but the database is read-only to it
    before = (d.state_dir / "colo.db").read_bytes()

    from colo.store import StoreError  # imported here: the other user cannot read the interpreter's files

    def start_as_other():  # what the daemon does first with its state dir
        try:
            Store(d.state_dir / "colo.db")
        except StoreError as e:
            return str(e)
        return "started"

    kind, msg = as_user(other_user, start_as_other)
    assert kind == "ok" and msg.startswith(f"state database {d.state_dir / 'colo.db'}"), msg
    assert "readonly" in msg or "Permission denied" in msg, msg
    assert (d.state_dir / "colo.db").read_bytes() == before
    shutil.rmtree(tmp_path)


def test_with_mps_off_the_gpus_are_read_and_set_up_before_the_first_request(tmp_path, fakegpu):
    """use_mps = false still reads the devices and their compute modes at start (they were read
    only when MPS was on: until the first sample, a submit found "this node has 0" GPUs, and an
    EXCLUSIVE_PROCESS GPU was never set to DEFAULT, so a second time-sliced job could not start)."""
    fakegpu.set_compute_mode(0, "exclusive_process")
    d = DaemonProc(tmp_path, fakegpu.state, config={"use_mps": False, "set_default_compute_mode": True,
                                                    "sample_interval": 3600}).start()
    try:
        assert fakegpu.read()["devices"][0]["compute_mode"] == "default"
        j = d.client.submit({"argv": ["true"], "gpus": 1, "gpu_mem": GiB, "name": "first"})["id"]
        assert d.wait_state(j, "succeeded", timeout=30)["mode"] == "timesliced"
    finally:
        d.stop()
