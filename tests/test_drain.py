"""Issue 42: `colo drain` takes a GPU out of service (root and the admin group only): no new job is
placed there while the other GPU takes them, running jobs finish (or, with --now, start again
elsewhere), waiting jobs say why, and the drain outlasts a daemon restart until `colo undrain`.
One real daemon for the module on two simulated GPUs; the user who tries is a real Unix user.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from colo.client import Client
from colo.node.fakegpu import FakeNode
from harness.daemon import DaemonProc, as_user, burn_path, invoke_as, wait_for
from harness.node import SimNode

HOLDER = Path(__file__).with_name("suspend_holder.py")  # a CUDA program that holds memory (test_suspend's)


def _daemon(n: SimNode):
    """The node's daemon, its metrics on a port of its own (d.metrics_port), its GPUs' controls (d.fake)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dp = n.daemon({"metrics_listen": f"127.0.0.1:{port}", "profile_dirs": [str(n.prof)]}, home=None)
    dp.metrics_port = port
    dp.fake = FakeNode(n.state)
    yield dp
    for go in ("go1", "go2", "go3", "go4", "go5"):
        (n.root / go).touch()


# light: alone on a GPU it runs as an MPS client (test_drain_now_requeues_an_mps_client)
pytestmark = pytest.mark.node("colo-drain-", count=2, per="module", then=_daemon,
                              profiles={"light": dict(sm=0.3, mem=256 << 20, membw=0.2, runtime=600)})


def gated(d: DaemonProc, go: str, *extra: str) -> list[str]:
    """A process job of 1 GiB that runs until the file `go` exists."""
    return ["--process", "--gpu-mem", "1GiB", "--workdir", "/tmp", *extra, "--", "sh", "-c",
            f"while [ ! -e {d.root / go} ]; do sleep 0.05; done"]


def uuids(d: DaemonProc) -> dict[int, str]:
    return {g["index"]: g["uuid"] for g in d.client.gpus()["gpus"]}


def drained(d: DaemonProc) -> dict[int, str | None]:
    return {g["index"]: g["drained"] for g in d.client.gpus()["gpus"]}


def drained_metric(d: DaemonProc) -> dict[str, float]:
    """colo_gpu_drained per GPU index, as scraped."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10).read().decode()
    return {s.labels["gpu"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "colo_gpu_drained"}


def test_a_user_may_not_drain_or_undrain(node, users):
    d = node
    alice = users[0]
    for op, args in (("drain", {"gpus": ["0"], "reason": "mine now"}), ("undrain", {"gpus": ["0"]})):
        kind, why = as_user(alice, lambda: Client(d.socket).call(op, **args))
        assert kind == "err" and why[2] == "forbidden", why
        assert f"only root and the admin group may {op} GPUs" in why[1]
    assert drained(d) == {0: None, 1: None}


def test_a_drained_gpu_gets_no_new_job_while_the_other_does(node):
    d = node
    first = d.submit(*gated(d, "go1"))
    on = d.wait_state(first, "running")["gpus"]
    by_uuid = {u: i for i, u in uuids(d).items()}
    g = by_uuid[on[0]]
    other = 1 - g
    r = d.cli("drain", str(g), "--reason", "driver update", check=True)
    assert f"GPU {g}: drained by root: driver update" in r.stdout
    later = [d.submit(*gated(d, "go1")) for _ in range(4)]
    for j in later:
        assert d.wait_state(j, "running")["gpus"] == [uuids(d)[other]], j
    pinned = d.submit(*gated(d, "go1", "--gpu-id", str(g)))
    wait_for(lambda: f"GPU {g} drained by root: driver update" in d.cli("explain", str(pinned)).stdout, 60,
             "the pinned job to say the GPU is drained")
    assert d.job(pinned)["state"] == "queued"
    assert f"GPU{g} is drained by root: driver update" in d.cli("gpus", check=True).stdout
    assert d.job(first)["state"] == "running"  # running jobs finish where they are
    (d.root / "go1").touch()
    assert d.wait_state(first, "succeeded")["gpus"] == on
    for j in later:
        d.wait_state(j, "succeeded")
    assert d.job(pinned)["state"] == "queued" and drained(d)[g] == "drained by root: driver update"
    d.client.cancel(pinned)
    d.cli("undrain", str(g), check=True)
    assert drained(d) == {0: None, 1: None}


def test_drain_now_requeues_the_running_jobs_elsewhere(node):
    d = node
    j = d.submit(*gated(d, "go2"))
    on = d.wait_state(j, "running")["gpus"]
    by_uuid = {u: i for i, u in uuids(d).items()}
    g = by_uuid[on[0]]
    r = d.cli("drain", str(g), "--reason", "Xid 79", "--now", "--json", check=True)
    assert json.loads(r.stdout)["requeued"] == [j]
    wait_for(lambda: (x := d.job(j))["state"] == "running" and x["gpus"] == [uuids(d)[1 - g]], 120,
             "the requeued job to run on the other GPU")
    assert any("Xid 79 (--now)" in e["reason"] and e["new"] == "queued" for e in d.client.show(j)["events"])
    (d.root / "go2").touch()
    d.wait_state(j, "succeeded")
    d.cli("undrain", str(g), check=True)


def test_a_drain_outlasts_a_restart_and_undrain_lets_jobs_in(node):
    d = node
    u0 = uuids(d)[0]
    d.cli("drain", u0, "--reason", "demo on Friday", check=True)  # by UUID
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(60)
    d.start()
    assert drained(d)[0] == "drained by root: demo on Friday"
    assert drained_metric(d) == {"0": 1.0, "1": 0.0}
    assert "drained by root: demo on Friday, colo undrain 0" in d.cli("doctor").stdout
    pinned = d.submit(*gated(d, "go3", "--gpu-id", "0"))
    wait_for(lambda: "GPU 0 drained by root: demo on Friday" in d.cli("explain", str(pinned)).stdout, 60,
             "the pinned job to wait for the drained GPU")
    free = d.submit(*gated(d, "go3"))
    assert d.wait_state(free, "running")["gpus"] == [uuids(d)[1]]
    r = d.cli("undrain", "0", check=True)
    assert "GPU 0: back in service" in r.stdout
    assert d.wait_state(pinned, "running", timeout=60)["gpus"] == [u0]
    wait_for(lambda: drained_metric(d) == {"0": 0.0, "1": 0.0}, 60, "colo_gpu_drained to drop to 0")
    assert d.cli("undrain", "0", check=True).stdout.strip() == "GPU 0: was not drained"
    bad = d.cli("drain", "7", "--reason", "x")
    assert bad.returncode == 1 and "no GPU '7' on this node" in bad.stderr
    assert d.cli("drain", "0").returncode != 0  # no --reason
    (d.root / "go3").touch()
    d.wait_state(pinned, "succeeded")
    d.wait_state(free, "succeeded")


def admin_log(d: DaemonProc) -> list[dict]:
    return json.loads(d.cli("history", "--admin", "--json", check=True).stdout)


def test_the_admin_log_shows_drains_newest_first_and_only_to_admins(node, users):
    d = node
    d.cli("drain", "0", "--reason", "fan swap", check=True)
    d.cli("undrain", "0", check=True)
    u0 = uuids(d)[0]
    got = [(a["by"], a["action"], a["target"], a["why"]) for a in admin_log(d)[:2]]
    assert got == [("root", "undrain", f"GPU 0 ({u0})", ""), ("root", "drain", f"GPU 0 ({u0})", "fan swap")]
    shown = d.cli("history", "--admin", check=True).stdout.splitlines()
    assert shown[0].split()[:5] == ["WHEN", "BY", "ACTION", "TARGET", "WHY"] and "undrain" in shown[1], shown
    code, out = invoke_as(users[0], d, "history", "--admin")
    assert code != 0 and out.strip() == "colo: only root and the admin group may read the admin log", out


def _holder(d: DaemonProc, pw, name: str, *extra: str) -> tuple[int, Path]:
    """A job of `pw`'s that holds 256 MiB of GPU memory through CUDA (suspendable), and its folder."""
    work = d.root / name
    work.mkdir(mode=0o777)
    os.chmod(work, 0o777)
    prog = shutil.copy(HOLDER, d.root / HOLDER.name)  # where the job's user can read it
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    spec = {"argv": [python, str(prog), "256", str(work)], "gpus": 1, "gpu_mem": 1 << 30, "name": name,
            "workdir": "/tmp", **dict.fromkeys(extra, True)}
    kind, job = as_user(pw, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", job
    wait_for(lambda: (work / "ready").exists(), 120, f"{name} to hold its GPU memory")
    return job, work


def test_drain_now_suspends_what_it_can_and_requeues_a_no_suspend_job(node, users):
    d = node
    alice = users[0]
    d.cli("drain", "1", "--reason", "both jobs on GPU 0", check=True)
    held, work = _holder(d, alice, "keep")
    moved, _ = _holder(d, alice, "nosusp", "no_suspend")
    r = json.loads(d.cli("drain", "0", "--reason", "driver update", "--now", "--json", check=True).stdout)
    did = {m["id"]: m for m in r["moved"]}
    assert did[held]["did"] == "suspended" and r["suspended"] == [held], r
    assert did[moved]["did"] == "requeued" and "--no-suspend" in did[moved]["why"] and r["requeued"] == [moved], r
    j = d.job(held)
    assert j["state"] == "running" and j["suspended"] is not None, j
    assert d.job(moved)["state"] in ("queued", "starting", "running")
    # its next CUDA call asks for its resume: it waits for its GPU to be undrained, then is restored
    (work / "poke-1").touch()
    wait_for(lambda: "waits for GPU 0 to be undrained (drained by root: driver update)"
             in json.loads(d.cli("explain", str(held), "--json").stdout)["reason"], 120,
             "the suspended job to wait for its GPU")
    assert not (work / "done-1").exists()
    d.cli("undrain", "0", check=True)
    wait_for(lambda: (work / "done-1").exists(), 120, "the suspended job to be restored once undrained")
    assert (work / "done-1").read_text().split()[0] == "0"
    d.cli("undrain", "1", check=True)
    d.cli("cancel", str(held), str(moved), check=True)  # alice's jobs, cancelled by root: an admin action
    log = admin_log(d)
    assert [(a["action"], a["target"]) for a in log[:2]] == [("cancel", f"job {moved} of {alice.pw_name}"),
                                                              ("cancel", f"job {held} of {alice.pw_name}")], log[:4]
    assert any(a["action"] == "drain" and a["why"] == f"driver update; jobs suspended {held}; requeued {moved}"
               for a in log), log



def test_drain_now_requeues_an_mps_client(node):
    """The driver cannot checkpoint an MPS client: --now requeues it, and says why."""
    d = node
    d.cli("drain", "1", "--reason", "the MPS job on GPU 0", check=True)
    j = d.submit("--process", "--gpu-mem", "1GiB", "--profile", "light", "--workdir", "/tmp", "--", "sh", "-c",
                 f"{burn_path(d)} --mem 256MiB --duty 30 --seconds 600 --quiet & b=$!; "
                 f"while [ ! -e {d.root / 'go5'} ]; do sleep 0.05; done; kill $b; wait $b; exit 0")
    x = d.wait_state(j, "running", timeout=60)
    assert x["mode"] == "mps" and x["gpus"] == [uuids(d)[0]], x
    r = json.loads(d.cli("drain", "0", "--reason", "driver update", "--now", "--json", check=True).stdout)
    assert r["requeued"] == [j] and r["suspended"] == [], r
    assert "MPS client" in r["moved"][0]["why"], r
    assert d.job(j)["suspended"] is None
    d.cli("undrain", "1", check=True)
    wait_for(lambda: (x := d.job(j))["state"] == "running" and x["gpus"] == [uuids(d)[1]], 120,
             "the requeued MPS client to run on the other GPU")
    assert any("driver update (--now)" in e["reason"] and e["new"] == "queued" for e in d.client.show(j)["events"])
    (d.root / "go5").touch()
    d.wait_state(j, "succeeded")
    d.cli("undrain", "0", check=True)

def test_a_gpu_that_reports_an_xid_drains_itself_and_its_job_runs_elsewhere(node):
    d = node
    j = d.submit(*gated(d, "go4"))
    on = d.wait_state(j, "running")["gpus"]
    g = {u: i for i, u in uuids(d).items()}[on[0]]
    d.fake.xid(g, 79)  # fallen off the bus, as NVML's event set reports it
    wait_for(lambda: drained(d)[g] == "drained by colo: Xid 79", 120, "colo to drain the failing GPU")
    wait_for(lambda: (x := d.job(j))["state"] == "running" and x["gpus"] == [uuids(d)[1 - g]], 120,
             "its job to run again on the other GPU")
    said = f"requeued: GPU {g} drained by colo: Xid 79"
    assert any(e["reason"] == said and e["new"] == "queued" for e in d.client.show(j)["events"])
    assert f"[colo: {said}]" in d.cli("logs", str(j), check=True).stdout  # its owner is told in its log
    assert f"GPU{g} is drained by colo: Xid 79" in d.cli("gpus", check=True).stdout
    assert any(x["by"] == "colo" and x["action"] == "drain" and x["why"] == f"Xid 79; jobs requeued {j}"
               for x in admin_log(d))  # colo's own drain, in the admin log
    (d.root / "go4").touch()
    d.wait_state(j, "succeeded")
    assert f"GPU {g}: back in service" in d.cli("undrain", str(g), check=True).stdout
    assert drained(d) == {0: None, 1: None}
