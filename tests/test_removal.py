"""Removing colo strands no job: `colo cancel --all-users` (root and the admin group) stops every
user's open jobs, which the package's prerm runs before removal (packaging/debian/prerm)."""
from __future__ import annotations

from colo.client import Client
from harness.daemon import as_user, wait_for
from user_cli import colo_as


def _submit_as(pw, sock) -> int:
    kind, value = as_user(pw, lambda: Client(sock).submit({"argv": ["sleep", "300"], "gpus": 0, "workdir": "/tmp",
                                                            "name": "long"})["id"])
    assert kind == "ok", value
    return value


def test_cancel_all_users_is_for_admins_and_stops_every_users_jobs(shared_daemon, users):
    alice, bob = users
    d = shared_daemon
    ids = [_submit_as(alice, d.socket), _submit_as(bob, d.socket)]
    for i in ids:
        d.wait_state(i, "running", timeout=60)

    r = colo_as(bob, ["cancel", "--all-users"], {"COLO_SOCKET": str(d.socket), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and r.stderr.strip() == \
        "colo: --all-users is for root and members of the admin group (admin_group)", r.stderr
    assert all(d.client.show(i)["state"] == "running" for i in ids)  # nothing was touched

    r = d.cli("cancel", "--all-users")
    assert r.returncode == 0, r.stderr
    assert sorted(ln.split(":")[0] for ln in r.stdout.splitlines()) == sorted(f"job {i}" for i in ids), r.stdout
    wait_for(lambda: all(d.client.show(i)["state"] == "cancelled" for i in ids), 60, "both users' jobs to stop")
    r = d.cli("cancel", "--all-users")
    assert r.returncode == 0 and r.stdout == "no open jobs\n", r.stdout
