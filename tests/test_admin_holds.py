"""Issue 52: an admin's hold or pause of a user's job only an admin lifts, and its owner sees who
holds it; `history` shows another user only what `ls` shows; the per-user queue limit is on by
default and counts an array's tasks. One real daemon for the module, on a simulated GPU; users are
real Unix users (forked children that setuid: harness.daemon.as_user), root is the admin.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from colo.client import Client
from colo.config import Config
from harness.daemon import DaemonProc, as_user, wait_for
from harness.node import SimNode

LIMIT = 12  # this daemon's max_queued_per_user (the default, 10,000, is checked apart)


def _daemon(n: SimNode):
    dp = n.daemon({"max_queued_per_user": LIMIT}, home=None)
    out = n.root / "out"
    out.mkdir(mode=0o777)
    os.chmod(out, 0o777)
    yield dp
    (n.root / "go").touch()  # the gated jobs end as the daemon stops


pytestmark = pytest.mark.node("colo-adminholds-", then=_daemon, per="module", needs=("users",))


def as_(pw, d: DaemonProc, op: str, **args):
    """Op `op` asked by user `pw` over the socket: ("ok", reply) or ("err", (type, message, code))."""
    return as_user(pw, lambda: Client(d.socket).call(op, **args))


def gated(d: DaemonProc) -> dict:
    return {"argv": ["sh", "-c", f"while [ ! -e {d.root / 'go'} ]; do sleep 0.05; done"], "gpus": 0,
            "workdir": "/tmp"}


def reason_seen_by(pw, d: DaemonProc, job: int) -> str:
    kind, rows = as_(pw, d, "ls", all=False)
    assert kind == "ok", rows
    return next(r["reason"] for r in rows if r["id"] == job)


def test_an_admins_hold_and_pause_of_her_job_only_an_admin_lifts(node, users):
    d = node
    alice = users[0]
    kind, job = as_(alice, d, "submit", spec={**gated(d), "hold": True})
    assert kind == "ok", job
    j = job["id"]
    # her own hold she may lift; root's hold replaces hers, and then she may not
    d.client.hold(j)
    assert d.job(j)["held_by"] == "root"
    kind, why = as_(alice, d, "release", id=j)
    assert kind == "err" and why[2] == "forbidden" and why[1] == \
        f"job {j} was held by root, an admin: only an admin may undo it", why
    held = f"held by root, an admin (only an admin may colo release {j})"
    assert reason_seen_by(alice, d, j) == held
    kind, ex = as_(alice, d, "explain", id=j)
    assert kind == "ok" and ex["reason"] == held, ex
    kind, again = as_(alice, d, "hold", id=j)  # her hold now changes nothing
    assert kind == "ok" and again["held_by"] == "root", again
    assert d.job(j)["held_by"] == "root"
    d.client.release(j)
    d.wait_state(j, "running")
    # a pause: the same, and an admin's pause replaces her own
    for first in (d.client, None):
        if first is None:
            kind, own = as_(alice, d, "pause", id=j)
            assert kind == "ok" and own["paused_by"] == alice.pw_name, own
            assert reason_seen_by(alice, d, j) == f"paused by {alice.pw_name} (colo resume {j})"
        d.client.pause(j)
        assert d.job(j)["paused_by"] == "root"
        kind, why = as_(alice, d, "resume", id=j)
        assert kind == "err" and why[2] == "forbidden" and "paused by root, an admin: only an admin" in why[1], why
        assert reason_seen_by(alice, d, j) == f"paused by root, an admin (only an admin may colo resume {j})"
        d.client.resume(j)
        assert d.job(j)["paused_by"] is None
    kind, _ = as_(alice, d, "cancel", id=j)
    assert kind == "ok"
    d.wait_state(j, "cancelled")


def test_history_shows_another_user_only_what_ls_shows(node, users):
    d = node
    alice, bob = users
    secret = "Bearer s3cr3t-token"
    spec = {"argv": ["true"], "gpus": 0, "workdir": "/tmp", "name": "private", "env": {"TOKEN": secret},
            "on_end": f"true '{secret}'", "output": str(d.root / "out" / "secret-%j.out"), "mail_type": "NONE",
            "mail_user": "alice@example.org"}
    kind, job = as_(alice, d, "submit", spec=spec)
    assert kind == "ok", job
    d.wait_state(job["id"], "succeeded", timeout=60)

    def row_for(pw):
        kind, h = as_user(pw, lambda: Client(d.socket).history(full=True))
        assert kind == "ok", h
        return next(r["spec"] for r in h["jobs"] if r["id"] == job["id"])

    mine, admins, theirs = row_for(alice), d.client.history(full=True)["jobs"], row_for(bob)
    admins = next(r["spec"] for r in admins if r["id"] == job["id"])
    for own in (mine, admins):
        assert (own["on_end"], own["mail_user"], own["env"]) == (spec["on_end"], "alice@example.org", {"TOKEN": secret})
        assert own["output"].endswith("secret-%j.out")
    assert (theirs["on_end"], theirs["output"], theirs["error"], theirs["mail_user"], theirs["env"],
            theirs["workdir"]) == (None, None, None, None, {}, None), theirs
    assert (theirs["name"], theirs["argv"]) == ("private", ["true"])  # what ls shows her
    assert "s3cr3t" not in repr(theirs) and "secret-" not in repr(theirs)


def test_the_queue_limit_is_on_by_default_and_counts_an_arrays_tasks(node, users):
    d = node
    assert Config(state_dir=Path("/var/lib/colo"), socket=Path("/run/colo/colo.sock")).max_queued_per_user == 10_000
    bob = users[1]
    env = {f"V{i}": "x" * 500 for i in range(100)}  # 50 KiB, stored once for all of the array's tasks
    spec = {**gated(d), "hold": True, "env": env}
    kind, first = as_(bob, d, "submit", spec={**spec, "array": "0-7"})
    assert kind == "ok" and len(first["tasks"]) == 8, first
    kind, why = as_(bob, d, "submit", spec={**spec, "array": "0-4"})
    assert kind == "err" and why[2] == "forbidden" and "\n" not in why[1], why
    assert why[1].startswith(f"{bob.pw_name} has 8 jobs queued and asks for 5 more, past {LIMIT}"), why
    kind, second = as_(bob, d, "submit", spec={**spec, "array": "0-3"})
    assert kind == "ok", second
    kind, why = as_(bob, d, "submit", spec=spec)
    assert kind == "err" and "has 12 jobs queued" in why[1] and "max_queued_per_user" in why[1], why
    kind, shown = as_(bob, d, "show", id=first["tasks"][5])
    assert kind == "ok" and shown["spec"]["env"] == env and shown["spec"]["array_index"] == 5
    for t in (*first["tasks"], *second["tasks"]):
        assert as_(bob, d, "cancel", id=t)[0] == "ok"
    wait_for(lambda: not [j for j in d.client.ls(all=False) if j["user"] == bob.pw_name], 60, "bob's jobs to go")
