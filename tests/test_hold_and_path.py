"""Issue 31 items 5-6: one user's queued job cannot keep another user's ended job in the store
(so her `colo clean` and retention always work), and jobs get a clean PATH, not the root daemon's.
As real Unix users against a real daemon; each attack test fails on ffbaf2e.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from colo.client import Client
from daemon_util import DaemonProc, as_user, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from load_bench import run_as  # noqa: E402

ROOT_ONLY = "/root/colo-only-bin"  # stands for root's own tool folders in the daemon's PATH


@pytest.fixture
def shared(fakegpu):
    root = Path(tempfile.mkdtemp(prefix="colo-hold-"))
    os.chmod(root, 0o755)
    d = DaemonProc(root, fakegpu.state, env={"PATH": f"{ROOT_ONLY}:{os.environ['PATH']}"}).start()
    os.chmod(d.socket.parent, 0o755)
    yield d
    (root / "go").touch()
    d.stop()
    shutil.rmtree(root, ignore_errors=True)


def _submit(d: DaemonProc, pw, argv: list[str], **more) -> int:
    spec = {"argv": argv, "gpus": 0, "workdir": "/tmp", **more}
    return run_as(pw, lambda: Client(d.socket).submit(spec)["id"])


def _clean(d: DaemonProc, pw, job: int):
    return as_user(pw, lambda: Client(d.socket).clean(refs=[str(job)]))


def test_bob_cannot_make_a_job_of_his_depend_on_alices(shared, users):
    """On ffbaf2e bob's `--after-any <alice's job>`, queued behind a gate job of his, held her ended
    job in the store: her `colo clean` refused for as long as he liked."""
    d = shared
    alice, bob = users
    hers = _submit(d, alice, ["true"])
    d.wait_state(hers, "succeeded")
    gate = _submit(d, bob, ["sh", "-c", f"while [ ! -e {d.root / 'go'} ]; do sleep 0.1; done"])
    kind, err = as_user(bob, lambda: Client(d.socket).submit(
        {"argv": ["true"], "gpus": 0, "workdir": "/tmp", "after": [gate], "after_any": [hers]})["id"])
    assert kind == "err" and err[2] == "forbidden", err
    assert err[1] == f"--after-any {hers}: job {hers} is {alice.pw_name}'s; a job may depend only on jobs of its own user"
    kind, out = _clean(d, alice, hers)
    assert kind == "ok" and out["removed"] == 1, out


def test_a_dependency_of_an_admin_on_her_job_does_not_keep_it_from_her(shared, users):
    """Root (or an admin) may make a job depend on alice's; it does not keep her ended job: she
    cleans it, and root's job then fails, its dependency gone."""
    d = shared
    alice, _ = users
    hers = _submit(d, alice, ["true"])
    d.wait_state(hers, "succeeded")
    gate = d.submit("--process", "--gpus", "0", "--", "sh", "-c",
                    f"while [ ! -e {d.root / 'go'} ]; do sleep 0.1; done")
    mine = d.submit("--process", "--gpus", "0", "--after", str(gate), "--after-any", str(hers), "--", "true")
    kind, out = _clean(d, alice, hers)
    assert kind == "ok" and out["removed"] == 1, out
    (d.root / "go").touch()
    job = d.wait_state(mine, "failed", "succeeded", "cancelled", timeout=30)
    assert job["state"] == "failed" and f"job {hers} does not exist" in job["reason"], job


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
