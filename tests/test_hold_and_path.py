"""Issue 31 items 5-6: one user's queued job cannot keep another user's ended job in the store
(so her `colo clean` and retention always work), and jobs get a clean PATH, not the root daemon's.
As real Unix users against a real daemon; each attack test fails on ffbaf2e.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from colo.client import Client
from harness.daemon import DaemonProc, as_user, wait_for
from harness.users import run_as


ROOT_ONLY = "/root/colo-only-bin"  # stands for root's own tool folders in the daemon's PATH


pytestmark = pytest.mark.shared("colo-hold-", env={"PATH": f"{ROOT_ONLY}:{os.environ['PATH']}"})


def _submit(d: DaemonProc, pw, argv: list[str], **more) -> int:
    spec = {"argv": argv, "gpus": 0, "workdir": "/tmp", **more}
    return run_as(pw, lambda: Client(d.socket).submit(spec)["id"])


def _clean(d: DaemonProc, pw, job: int):
    return as_user(pw, lambda: Client(d.socket).clean(refs=[str(job)]))


def test_bobs_queued_job_depending_on_alices_does_not_keep_hers_from_her(shared, users):
    """On ffbaf2e bob's `--after-any <alice's ended job>`, queued behind a gate job of his, held her
    job in the store: her `colo clean` refused for as long as he liked. Now she cleans it, and his
    job fails at once, its dependency gone; his own ended job is still kept by his queued one."""
    d = shared
    alice, bob = users
    hers = _submit(d, alice, ["true"])
    his = _submit(d, bob, ["true"])
    d.wait_state(hers, "succeeded")
    d.wait_state(his, "succeeded")
    gate = _submit(d, bob, ["sh", "-c", f"while [ ! -e {d.root / 'go'} ]; do sleep 0.1; done"])
    d.wait_state(gate, "running")
    waits = _submit(d, bob, ["true"], after=[gate], after_any=[hers, his])
    kind, out = _clean(d, bob, his)
    assert kind == "err" and f"queued job {waits} depends on job {his}" in out[1], out
    kind, out = _clean(d, alice, hers)
    assert kind == "ok" and out["removed"] == 1, out
    job = d.wait_state(waits, "failed", "succeeded", "cancelled", timeout=30)
    assert job["state"] == "failed" and f"job {hers} does not exist" in job["reason"], job


def test_retention_removes_her_ended_job_whatever_another_users_job_waits_for(fakegpu, users):
    """history_keep_days: the same through the daemon's own purge (the dependent is root's)."""
    root = Path(tempfile.mkdtemp(prefix="colo-hold-"))
    os.chmod(root, 0o755)
    d = DaemonProc(root, fakegpu.state).start()
    os.chmod(d.socket.parent, 0o755)
    try:
        alice, _ = users
        hers = _submit(d, alice, ["true"])
        d.wait_state(hers, "succeeded")
        gate = d.submit("--process", "--gpus", "0", "--", "sh", "-c", f"while [ ! -e {root / 'go'} ]; do sleep 0.1; done")
        mine = d.submit("--process", "--gpus", "0", "--after", str(gate), "--after-any", str(hers), "--", "true")
        d.kill9()  # jobs outlive their daemon: the next one purges with the queue as it is
        d = DaemonProc(root, fakegpu.state, config={"history_keep_days": 1e-6}).start()
        wait_for(lambda: hers not in {j["id"] for j in d.client.ls(all=True)}, 30, "the purge to remove her job")
        job = d.wait_state(mine, "failed", "succeeded", "cancelled", timeout=30)
        assert job["state"] == "failed" and f"job {hers} does not exist" in job["reason"], job
    finally:
        (root / "go").touch()
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_process_job_gets_a_clean_path_not_the_daemons(shared, users):
    """On ffbaf2e bob's job ran with the daemon's PATH (root's, ROOT_ONLY first)."""
    d = shared
    _, bob = users
    j = _submit(d, bob, ["sh", "-c", 'echo "$PATH"'])
    d.wait_state(j, "succeeded")
    assert "".join(d.client.logs(j)) == "/usr/local/bin:/usr/bin:/bin\n"
    j = _submit(d, bob, ["sh", "-c", 'echo "$PATH"'], env={"PATH": "/opt/tools/bin:/usr/bin:/bin"})
    d.wait_state(j, "succeeded")
    assert "".join(d.client.logs(j)) == "/opt/tools/bin:/usr/bin:/bin\n"


@pytest.mark.docker
def test_a_container_job_keeps_its_images_path(shared, users, test_image, docker_client):
    d = shared
    _, bob = users
    want = docker_client.containers.run(test_image, ["sh", "-c", 'echo "$PATH"'], remove=True).decode()
    j = _submit(d, bob, ["sh", "-c", 'echo "$PATH"'], image=test_image)
    wait_for(lambda: d.job(j)["state"] == "succeeded", 60, "the container job")
    got = "".join(d.client.logs(j))
    assert got == want and ROOT_ONLY not in got, got
