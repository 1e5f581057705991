"""MPS or time-sliced or wait, decided from profiles, end to end: a real daemon on the simulated
driver with its fake MPS control daemon, jobs running the colo-burn load tool."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from colo.node import fakegpu
from colo import profiles
from colo.client import Client
from harness.daemon import DaemonProc, as_user, burn, wait_for
from harness.node import SimNode

GiB = 1024**3


def _profile(sm: float, membw: float, cache_bound: bool) -> dict:
    return dict(sm=sm, mem=512 * 1024**2, membw=membw, runtime=600, n=30, cache_bound=cache_bound)


# One simulated 16 GiB GPU in a world-traversable dir (MPS servers and other uids reach it).
pytestmark = pytest.mark.node("colo-place-", profiles={"light": _profile(0.30, 0.20, False),
                                                       "heavy": _profile(0.95, 0.90, True)}, then=SimNode.parts)


def start(node, **cfg) -> DaemonProc:
    root, state, prof = node
    home = root / f"d{len(list(root.glob('d*')))}"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)
    return DaemonProc(home, state, {"profile_dirs": [str(prof)], "mps_idle_stop": 600.0, **cfg}).start()


def procs(state: Path) -> dict[int, str]:
    return {p["pid"]: p["kind"] for p in fakegpu.FakeNode(state).read()["devices"][0]["processes"]}


def job_pids(d: DaemonProc, job_id: int) -> set[int]:
    import sqlite3

    db = sqlite3.connect(d.state_dir / "colo.db")
    (handle,) = db.execute("SELECT handle FROM jobs WHERE id=?", (job_id,)).fetchone()
    db.close()
    if handle is None:  # not started (again) yet: no processes
        return set()
    shim = int(handle.split(":")[0])
    import psutil

    return {c.pid for c in psutil.Process(shim).children(recursive=True)}


def mps_clients_of(d, state, job_id) -> bool:
    kinds = procs(state)
    return any(kinds.get(p) == "mps_client" for p in job_pids(d, job_id))


def test_light_pair_shares_under_mps_and_explains_why(node):
    d = start(node)
    try:
        a = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--mem", "256MiB", "--duty", "30", "--seconds", "60"))
        b = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--mem", "256MiB", "--duty", "30", "--seconds", "60"))
        for j in (a, b):
            assert d.wait_state(j, "running")["mode"] == "mps"
        wait_for(lambda: mps_clients_of(d, node[1], a) and mps_clients_of(d, node[1], b),
                 what="both jobs listed as MPS clients by NVML")
        why = d.cli("explain", str(b), check=True).stdout
        assert "MPS on GPU0: predicted peak SM" in why and "< 85 %" in why, why
        gpus = d.client.gpus()["gpus"]
        assert gpus[0]["mps"] == "active"
    finally:
        d.stop()


def test_a_profile_never_run_alone_here_runs_alone_once_then_shares(node):
    """check_alone (on here; off by default since issue 39): a configured profile no run has shown alone on this node runs
    alone once, so that its alone time here is learned; after that run its jobs share."""
    d = start(node, check_alone=True)
    try:
        args = ("--process", "--gpu-mem", "2GiB", "--profile", "light")
        a = d.submit(*args, *burn(d, "--mem", "256MiB", "--duty", "30", "--seconds", "4"))
        b = d.submit(*args, *burn(d, "--mem", "256MiB", "--duty", "30", "--seconds", "60"))
        d.wait_state(a, "running")
        assert "alone this once" in d.cli("explain", str(a), check=True).stdout
        assert d.job(b)["state"] == "queued"
        d.wait_state(a, "succeeded", timeout=60)
        d.wait_state(b, "running", timeout=60)
        c = d.submit(*args, *burn(d, "--mem", "256MiB", "--duty", "30", "--seconds", "60"))
        assert d.wait_state(c, "running")["mode"] == "mps"  # checked: it shares from now on
        assert d.job(b)["state"] == "running"
    finally:
        d.stop()


def test_saturating_cache_bound_pair_does_not_share(node):
    d = start(node)
    try:
        a = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "heavy", *burn(d, "--seconds", "60"))
        d.wait_state(a, "running")
        b = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "heavy", *burn(d, "--seconds", "60"))
        wait_for(lambda: "co-running" in (d.job(b)["reason"] or ""), what="a placement decision for job b")
        jb = d.job(b)
        assert jb["state"] == "queued" and "predicted to cost more than it gains" in jb["reason"], jb["reason"]
        d.cli("cancel", str(a), check=True)
        d.wait_state(b, "running")  # it runs once it has the GPU alone
    finally:
        d.stop()


def test_job_without_profile_runs_alone_and_leaves_a_profile(node):
    d = start(node, unprofiled_share=False)
    try:
        light = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--seconds", "60"))
        assert d.wait_state(light, "running")["mode"] == "mps"
        j = d.submit("--process", "--gpu-mem", "1GiB", "--profile", "fresh", *burn(d, "--mem", "512MiB", "--duty", "40", "--seconds", "6"))
        wait_for(lambda: "runs alone or beside one well-known job" in (d.job(j)["reason"] or ""),
                 what="the job with no profile kept off the busy GPU")
        assert d.job(j)["state"] == "queued"
        d.cli("cancel", str(light))
        job = d.wait_state(j, "running")
        assert not mps_clients_of(d, node[1], j)  # its pipe dir leads nowhere: an ordinary context
        # time-sliced, and alone on its GPU: shown as "exclusive" (issue 36)
        assert job["mode"] == "exclusive" and "no profile yet, runs alone" in d.cli("explain", str(j)).stdout
        d.wait_state(j, "succeeded", timeout=30)
        learned = profiles.load(d.state_dir / "profiles" / "users" / "0" / "fresh.profile")  # root ran it: its own
        assert learned.runs == 1 and learned.runtime >= 5
        assert 0.2 <= float(np.max(learned.sm)) <= 0.6  # the 40 % duty cycle it declared
        assert int(np.max(learned.mem)) == 512 * 1024**2  # from its ledger
    finally:
        d.stop()


def test_two_uids_are_not_colocated_under_mps_without_multi_user(node, other_user):
    d = start(node)
    os.chmod(d.socket.parent, 0o755)
    try:
        mine = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--seconds", "60"))
        assert d.wait_state(mine, "running")["mode"] == "mps"
        spec = {"argv": burn(d, "--seconds", "60")[1:], "gpu_mem": "2GiB", "profile": "light", "workdir": "/tmp"}
        kind, theirs = as_user(other_user, lambda: Client(d.socket).submit(spec)["id"])
        assert kind == "ok", theirs
        wait_for(lambda: d.job(theirs)["state"] != "queued" or "uid" in d.job(theirs)["reason"],
                 what="a decision for the other user's job")
        jt = d.job(theirs)
        assert jt["mode"] != "mps", jt
        assert "uid 0" in (d.cli("explain", str(theirs), user=None).stdout + jt["reason"])
    finally:
        d.stop()


def test_cancel_sends_terminate_client_before_the_kill(node):
    d = start(node)
    try:
        j = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--duty", "30", "--seconds", "60"))
        d.wait_state(j, "running")
        wait_for(lambda: mps_clients_of(d, node[1], j), what="job to be an MPS client")
        client = next(p for p in job_pids(d, j) if procs(node[1]).get(p) == "mps_client")
        d.cli("cancel", str(j), check=True)
        d.wait_state(j, "cancelled")
        log = next((d.state_dir / "mps").glob("*/log/control.log")).read_text()
        assert any("terminate_client" in line and str(client) in line for line in log.splitlines()), log[-2000:]
    finally:
        d.stop()


def test_mps_fault_fails_its_clients_and_holds_mps_placement(node):
    d = start(node)
    try:
        j = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--duty", "30", "--seconds", "60"))
        again = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", "--retries", "1",
                         *burn(d, "--duty", "30", "--seconds", "20"))  # still a client when looked at, under load too
        for x in (j, again):
            d.wait_state(x, "running")
            wait_for(lambda: mps_clients_of(d, node[1], x), what="job to be an MPS client")
        pipe = next((d.state_dir / "mps").glob("*/pipe"))
        env = {**os.environ, **fakegpu.FakeNode(node[1]).env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
        ctl = str(fakegpu.FakeNode(node[1]).mps_control)
        server = subprocess.run([ctl], input="get_server_list\n", capture_output=True, text=True, env=env).stdout.split()[0]
        subprocess.run([ctl], input=f"fake_fault {server}\n", capture_output=True, text=True, env=env, check=True)
        job = d.wait_state(j, "failed")
        assert job["reason"] == "MPS server fault"
        retried = d.wait_state(again, "succeeded", timeout=120)  # requeued once, then ran to its end
        assert retried["attempts"] == 2
        assert any("MPS server fault; requeued" in e["reason"] for e in retried["events"])
        wait_for(lambda: d.client.gpus()["gpus"][0]["mps"] in ("active", "off"), what="the server to leave FAULT")
        k = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--seconds", "2"))
        d.wait_state(k, "succeeded")
    finally:
        d.stop()


def test_mps_daemon_killed_behind_colos_back_is_restarted(node):
    d = start(node)
    try:
        j = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--seconds", "1"))
        d.wait_state(j, "succeeded")
        pidfile = next((d.state_dir / "mps").glob("*/pipe/nvidia-cuda-mps-control.pid"))
        old = int(pidfile.read_text())
        os.kill(old, 9)
        def new_pid():
            try:
                pid = int(pidfile.read_text())
            except (OSError, ValueError):
                return None
            return pid != old and os.path.exists(f"/proc/{pid}") and pid

        wait_for(new_pid, what="a new MPS control daemon")
        wait_for(lambda: "restarted" in (d.root / "daemon.log").read_text(), what="the restart to be logged")
    finally:
        d.stop()


def test_exclusive_process_gpu_takes_mps_clients_only(node):
    root, state, prof = node
    fakegpu.FakeNode(state).set_compute_mode(0, "exclusive_process")
    d = start(node)
    try:
        a = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--seconds", "60"))
        assert d.wait_state(a, "running")["mode"] == "mps"
        b = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "nothing-known", *burn(d, "--seconds", "60"))
        wait_for(lambda: "EXCLUSIVE_PROCESS" in (d.job(b)["reason"] or ""), what="a decision for job b")
        jb = d.job(b)
        assert jb["state"] == "queued" or jb["mode"] == "mps", jb
    finally:
        d.stop()


def test_sim_from_history_replays_what_the_daemon_ran(node):
    d = start(node)
    try:
        for _ in range(2):
            j = d.submit("--process", "--gpu-mem", "1GiB", "--profile", "light", *burn(d, "--seconds", "1"))
            d.wait_state(j, "succeeded")
        r = d.cli("sim", "--from-history", "--policy", "colo", "--policy", "exclusive-fifo")
        assert r.returncode == 0, r.stderr
        rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.split()}
        assert "colo" in rows and "exclusive-fifo" in rows and "history" in r.stdout
    finally:
        d.stop()


def test_explain_shows_predicted_vs_observed_and_shared_runs_do_not_teach_the_alone_profile(node):
    d = start(node)
    try:
        a = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--mem", "600MiB", "--duty", "30", "--seconds", "2"))
        b = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", *burn(d, "--mem", "256MiB", "--duty", "30", "--seconds", "2"))
        for j in (a, b):
            d.wait_state(j, "succeeded", timeout=60)
        assert d.job(a)["mode"] == d.job(b)["mode"] == "mps"
        out = wait_for(lambda: "observed" in (o := d.cli("explain", str(a)).stdout) and o,
                       what="the observation in explain")
        assert re.search(r"predicted slowdown 1\.00x, observed 0\.0\dx of its profile's 600 s alone \(shared with light\)", out), out
        assert "suggested budget for its profile: 768MiB" in out, out  # 600 MiB + 10 %, in 256 MiB steps
        # both shared the GPU: the stored profile's alone series and run time were not learned from them
        assert not list((d.state_dir / "profiles").rglob("light.profile"))  # not in anyone's own copy
    finally:
        d.stop()


def test_grow_requeues_a_job_refused_by_its_budget_once_with_a_larger_one(node):
    d = start(node, lend=1.0)  # nothing lent at its start (tests/test_grow.py): it is refused first
    try:
        plain = d.submit("--process", "--gpu-mem", "1GiB", *burn(d, "--mem", "1200MiB", "--seconds", "1"))
        grown = d.submit("--process", "--gpu-mem", "1GiB", "--grow", *burn(d, "--mem", "1200MiB", "--seconds", "1"))
        assert d.wait_state(plain, "failed", timeout=60)["budget"] == GiB  # without --grow: its failure, as before
        job = d.wait_state(grown, "succeeded", timeout=90)
        assert job["budget"] == 1280 * 1024**2 and job["spec"]["grow"] is False  # 1.25x, once
        events = [e["reason"] for e in job["events"]]
        assert any("refused by its budget of 1.0GiB; requeued with budget 1.2GiB (--grow)" in r for r in events), events
        with pytest.raises(Exception, match="grow must be true or false"):
            d.client.submit({"argv": ["true"], "gpu_mem": "1GiB", "grow": "yes", "workdir": "/tmp"})
    finally:
        d.stop()
