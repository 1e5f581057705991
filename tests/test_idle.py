"""Idle holders (issue 32, item 4): a job holding GPU memory with no GPU activity for idle_after
is marked idle in ls, top and report; an idle interactive session is told, then ended (policy)."""
from __future__ import annotations

import json

import pytest

from colo import report as rp
from colo.daemon.sampler import idle_step
from harness.daemon import DaemonProc, wait_for

MiB = 1024**2


def test_idle_gpu_hours_count_stretches_of_held_memory_without_activity_past_idle_after():
    h = 3600.0
    samples = [  # (user, job, GPUs, at, SM, memory)
        ("alice", 1, 2, 0.0, 0.0, MiB), ("alice", 1, 2, 0.5 * h, 0.0, MiB), ("alice", 1, 2, h, 0.0, MiB),
        ("alice", 1, 2, 1.5 * h, 0.4, MiB),  # busy again: the stretch of 1 h on 2 GPUs counts
        ("alice", 1, 2, 1.6 * h, 0.0, MiB), ("alice", 1, 2, 1.7 * h, 0.0, MiB),  # 0.1 h: under idle_after
        ("bob", 2, 1, 0.0, 0.0, 0), ("bob", 2, 1, h, 0.0, 0),  # no memory held: not idle
        ("bob", 3, 1, 0.0, None, MiB), ("bob", 3, 1, h, None, MiB),  # activity unknown: not idle
        ("carol", 4, 1, 0.0, 0.0, MiB), ("carol", 4, 1, 0.4 * h, 0.0, MiB),  # the daemon was away:
        ("carol", 4, 1, 2.4 * h, 0.0, MiB), ("carol", 4, 1, 3.0 * h, 0.0, MiB),  # 0.4 h, then 0.6 h
    ]
    got = rp.idle_hours(samples, idle_after=0.25 * h, gap=h)
    assert got == {"alice": pytest.approx(2.0), "carol": pytest.approx(1.0)}
    assert rp.idle_hours(samples, idle_after=0) == {}  # 0: never marked
    r = rp.assemble([{"user": "alice", "jobs": 1, "gpu_hours": 3.4}, {"user": "bob", "jobs": 2, "gpu_hours": 2.0}],
                    [], got)
    assert [(u["user"], u["gpu_hours_idle"]) for u in r["users"]] == [("alice", pytest.approx(2.0)), ("bob", 0.0)]
    assert r["gpu_hours_idle"] == pytest.approx(2.0)


def test_an_idle_session_is_told_then_ended_after_the_grace_and_a_batch_job_only_marked():
    grace = 600.0
    assert idle_step("end", True, None, None, 1000.0, grace) is None  # not idle
    assert idle_step("end", False, 100.0, None, 1000.0, grace) is None  # a batch job: marked only
    assert idle_step("off", True, 100.0, None, 1000.0, grace) is None
    assert idle_step("notify", True, 100.0, None, 1000.0, grace) == "tell"
    assert idle_step("notify", True, 100.0, 1000.0, 5000.0, grace) is None  # told once, never ended
    assert idle_step("end", True, 100.0, None, 1000.0, grace) == "tell"
    assert idle_step("end", True, 100.0, 1000.0, 1599.0, grace) is None
    assert idle_step("end", True, 100.0, 1000.0, 1600.0, grace) == "end"


def test_the_idle_keys_are_checked_at_load(tmp_path):
    from colo.config import Config, ConfigError

    for text, msg in (('idle_sessions = "kill"', "idle_sessions: 'kill' is not one of off, notify, end"),
                      ("idle_after = -1", "idle_after: -1 is not a number of seconds"),
                      ('idle_grace = "10m"', "idle_grace: '10m' is not a number of seconds"),
                      ('gpu_group = ""', "gpu_group: '' is not a group name")):
        (tmp_path / "c.toml").write_text(text + "\n")
        with pytest.raises(ConfigError, match=msg):
            Config.load(tmp_path / "c.toml")


@pytest.fixture
def idle_daemon(tmp_path, fakegpu):
    d = DaemonProc(tmp_path, fakegpu.state, {"idle_after": 1.0}).start()
    yield d
    d.stop()


def test_a_job_holding_memory_without_gpu_activity_is_marked_idle_in_ls_top_and_report(idle_daemon, tmp_path):
    d = idle_daemon
    go = tmp_path / "go"
    burn = str(next(d.state_dir.glob("native-*")) / "colo-burn")
    wait = f"while [ ! -e {go} ]; do sleep 0.05; done"
    idle = d.submit("--process", "--gpu-mem", "256MiB", "--name", "holder", "--", "sh", "-c",
                    f"{burn} --mem 64MiB --duty 0 --seconds 600 --quiet & b=$!; {wait}; kill $b; wait $b; true")
    busy = d.submit("--process", "--gpu-mem", "256MiB", "--name", "worker", "--", "sh", "-c",
                    f"{burn} --mem 64MiB --duty 50 --seconds 600 --quiet & b=$!; {wait}; kill $b; wait $b; true")
    wait_for(lambda: "idle" in d.job(idle)["reason"], 30, "the holder to be marked idle")
    j = d.job(idle)
    assert j["idle_since"] is not None and "holds 64MiB, no GPU activity" in j["reason"]
    listed = {r["id"]: r for r in json.loads(d.cli("ls", "--json", check=True).stdout)}
    assert "idle" in listed[idle]["reason"] and listed[busy]["idle_since"] is None and "idle" not in listed[busy]["reason"]
    plain = d.cli("ls", "-o", "id,reason", check=True).stdout
    assert any(line.split()[0] == str(idle) and "idle" in line for line in plain.splitlines())
    frame = d.cli("top", "--once", "--lines", "0", check=True).stdout
    rows = {line.split()[0]: line for line in frame.splitlines() if line.split()[:1] in ([str(idle)], [str(busy)])}
    assert rows[str(idle)].split()[-1] == "idle" and rows[str(busy)].split()[-1] == "running"  # STATE
    go.touch()
    for x in (idle, busy):
        d.wait_state(x, "succeeded", timeout=60)
    r = json.loads(d.cli("report", "--json", check=True).stdout)
    [me] = r["users"]
    assert 0 < me["gpu_hours_idle"] < me["gpu_hours"] / 2  # the holder's idle stretch, none of the worker's
    assert r["gpu_hours_idle"] == me["gpu_hours_idle"]
    assert "IDLE GPU-H" in d.cli("report", check=True).stdout.splitlines()[0]
