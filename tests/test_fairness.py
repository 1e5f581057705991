"""No user can take the node from the others (issue 12, item 3): fair share across users and
per-user limits, as real users through a real daemon; the pure computation on its own."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from harness.daemon import DaemonProc, as_user, wait_for

from colo.sched import fairshare
from colo.client import Client

GiB = 1024**3


# the pure part ----------------------------------------------------------------------------------
def test_users_take_turns_least_recent_use_first_priority_within_a_user():
    jobs = [(1, 10, 0, 1), (2, 10, 0, 2), (3, 10, 5, 3), (4, 20, 0, 4), (5, 30, 0, 5), (6, 20, 0, 6)]
    assert fairshare.fair_order(jobs, {10: 0.0, 20: 5.0, 30: 1.0}) == [3, 5, 4, 1, 6, 2]
    assert fairshare.fair_order(jobs[:3], {}) == [3, 1, 2]  # one user: priority, then FIFO


def test_use_decays_with_the_half_life():
    led = fairshare.Ledger(half_life=3600.0)
    led.add(7, 4.0, 0.0, 3600.0)  # 4 GiB held for an hour
    now = led.usage(3600.0)[7]
    assert 2.0 < now < 4.0  # the early part of the hour has decayed already
    assert led.usage(3600.0 + 3600.0)[7] == pytest.approx(now / 2)
    running = led.usage(7200.0, running=[(8, 1.0, 7200.0 - 60)])
    assert 0 < running[8] < 1.0 / 60 + 1e-9


def test_limits_say_which_one_in_a_line():
    lim = fairshare.Limits(queued=2, running=1, gpu_mem=8 * GiB)
    assert "max_queued_per_user" in fairshare.submit_refusal(lim, "bob", 2)
    assert fairshare.submit_refusal(lim, "bob", 1) is None
    assert "max_running_per_user" in fairshare.start_refusal(lim, "bob", fairshare.UserLoad(1, GiB), GiB, 1)
    assert "max_gpu_mem_per_user" in fairshare.start_refusal(lim, "bob", fairshare.UserLoad(0, 6 * GiB), GiB, 3)
    assert fairshare.start_refusal(lim, "bob", fairshare.UserLoad(0, 6 * GiB), GiB, 2) is None


# real users, real daemon ------------------------------------------------------------------------
pytestmark = pytest.mark.users(2, prefix="colofair")


@pytest.fixture
def shared_root():
    root = Path(tempfile.mkdtemp(prefix="colo-fair-"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _stop(d: DaemonProc, running: list[int]) -> None:
    """Cancel the running jobs only, then stop the daemon (the queued ones stay in its store)."""
    for j in running:
        try:
            d.client.cancel(j)
        except Exception:  # noqa: BLE001 - already ended
            pass
    wait_for(lambda: all(d.job(j)["state"] not in ("starting", "running") for j in running), 60, "jobs to stop")
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(60)


def _gate(path: Path) -> list[str]:
    return ["sh", "-c", f"while [ ! -e {path} ]; do sleep 0.1; done"]


def test_bob_queues_1000_and_alices_job_starts_next(shared_root, fakegpu, users):
    alice, bob = users
    d = DaemonProc(shared_root, fakegpu.state).start()
    os.chmod(d.socket.parent, 0o755)
    gates = [shared_root / "g0", shared_root / "g1"]
    hogs: list[int] = []
    try:
        def bob_fills():
            c = Client(d.socket, timeout=120)
            # bob holds both GPUs (his recent use grows), then queues 1,000 more
            ids = [c.submit({"argv": _gate(g), "gpu_mem": 16 * GiB, "workdir": "/tmp"})["id"] for g in gates]
            ids += [c.submit({"argv": ["true"], "gpu_mem": 16 * GiB, "workdir": "/tmp"})["id"] for _ in range(1000)]
            return ids

        kind, ids = as_user(bob, bob_fills)
        assert kind == "ok", ids
        hogs, queued = ids[:2], ids[2:]
        for h in hogs:
            d.wait_state(h, "running")
        kind, mine = as_user(alice, lambda: Client(d.socket).submit(
            {"argv": ["true"], "gpu_mem": 16 * GiB, "workdir": "/tmp"})["id"])
        assert kind == "ok", mine
        why = d.cli("explain", str(queued[0]), check=True).stdout
        assert "waiting for fair share: 1 job(s) of other users" in why, why
        gates[0].touch()  # one GPU frees: the next job is alice's, not bob's first of 1,000
        d.wait_state(mine, "succeeded", timeout=60)
        first = wait_for(lambda: [e for e in d.job(queued[0])["events"] if e["new"] == "starting"], 60,
                         "bob's next job to start")
        alices = next(e for e in d.job(mine)["events"] if e["new"] == "starting")
        assert alices["at"] <= first[0]["at"]
    finally:
        for g in gates:
            g.touch()
        _stop(d, [*hogs, *([queued[0]] if hogs else [])])


def _submit_as(d: DaemonProc, pw, spec: dict):
    """("ok", id) or ("err", (kind, message, code)): a submit through the socket as that user."""
    kind, v = as_user(pw, lambda: Client(d.socket).submit({"workdir": "/tmp", **spec})["id"])
    return kind, v


def test_per_user_limits_refuse_at_submit_and_hold_starts(shared_root, fakegpu, users):
    alice, bob = users
    d = DaemonProc(shared_root, fakegpu.state, config={"max_queued_per_user": 3, "max_running_per_user": 1,
                                                       "max_gpu_mem_per_user": "20GiB"}).start()
    os.chmod(d.socket.parent, 0o755)
    gate = shared_root / "go"
    try:
        kind, a = _submit_as(d, bob, {"argv": _gate(gate), "gpu_mem": 4 * GiB})
        assert kind == "ok", a
        kind, b = _submit_as(d, bob, {"argv": ["true"], "gpu_mem": 4 * GiB})
        assert kind == "ok", b
        d.wait_state(a, "running")
        why = wait_for(lambda: "waiting for a limit" in (r := d.job(b)["reason"]) and r, 30, "the limit's reason")
        assert "max_running_per_user" in why
        assert "max_running_per_user" in d.cli("explain", str(b), check=True).stdout
        more = [_submit_as(d, bob, {"argv": ["true"], "gpu_mem": GiB}) for _ in range(2)]
        assert all(k == "ok" for k, _ in more), more
        kind, err = _submit_as(d, bob, {"argv": ["true"], "gpu_mem": GiB})  # a 4th queued
        assert kind == "err" and err[2] == "forbidden", err
        assert "max_queued_per_user" in err[1] and "\n" not in err[1]
        # bob's limits do not hold alice; a job past the memory limit waits for it
        kind, c = _submit_as(d, alice, {"argv": ["true"], "gpu_mem": 12 * GiB, "gpus": 2})
        assert kind == "ok", c
        why = wait_for(lambda: "waiting for a limit" in (r := d.job(c)["reason"]) and r, 30, "the memory limit")
        assert "max_gpu_mem_per_user" in why
        kind, e = _submit_as(d, alice, {"argv": ["true"], "gpu_mem": GiB})
        assert kind == "ok", e
        d.wait_state(e, "succeeded", timeout=60)  # while bob's wait
        gate.touch()
        for j in (a, b, *(i for _, i in more)):
            d.wait_state(j, "succeeded", timeout=60)
        assert d.job(c)["state"] == "queued"
    finally:
        gate.touch()
        _stop(d, [])
