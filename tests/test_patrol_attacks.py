"""Issue 31 items 1-2 (invariants 11, 14): the patrol cannot be pointed at someone else, nor
outwaited, tried as real Unix users against a root daemon on simulated GPUs.

Bob's processes take GPU memory with the interposer bypassed (`env -u LD_PRELOAD`, or a process
started outside colo), as a user who wants more than a budget would. Each test fails on ffbaf2e:
there the patrol took a process whose cgroup path merely ended in colo-<instance>/job-<N> (or
held a container's id anywhere) for that job's, and one sample within the budget restarted the
grace.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from colo.client import Client
from colo.node import cgroup, fakegpu, native, procs
from harness.daemon import DaemonProc, wait_for
from harness.users import run_as


GiB = 1024**3


def _maker(n):
    """make(**config): a root daemon on the node's two 16 GiB simulated GPUs that other users can reach."""
    return lambda **config: n.daemon(config)


pytestmark = pytest.mark.node("colo-patrol-", count=2, then=_maker)


def _native(d: DaemonProc) -> Path:
    return next(d.state_dir.glob("native-*"))  # the daemon's world-readable copy


def _submit(d: DaemonProc, pw, argv: list[str], gpu_mem: int, **more) -> int:
    spec = {"argv": argv, "gpu_mem": gpu_mem, "workdir": "/tmp", **more}
    return run_as(pw, lambda: Client(d.socket).submit(spec)["id"])


def _held(d: DaemonProc, uuid: str, pid: int | None = None) -> int:
    return sum(p["used"] for dev in fakegpu.FakeNode(d.fake_state).read()["devices"] if dev["uuid"] == uuid
               for p in dev["processes"] if pid is None or p["pid"] == pid)


def _gpu(d: DaemonProc, uuid: str) -> dict:
    return next(g for g in d.client.gpus()["gpus"] if g["uuid"] == uuid)


def _outside(pw, d: DaemonProc, uuid: str, script: str) -> subprocess.Popen:
    """`script` (sh) run by user `pw` outside colo, with the simulated driver and no interposer; it
    first reads one line from its stdin (so the caller may place it first)."""
    env = {"PATH": "/usr/bin:/bin", "COLO_FAKEGPU_STATE": str(d.fake_state),
           "LD_LIBRARY_PATH": str(_native(d) / native.FAKEGPU_DIR), "CUDA_VISIBLE_DEVICES": uuid}
    return subprocess.Popen(["sh", "-c", f"read go; {script}"], user=pw.pw_uid, group=pw.pw_gid, extra_groups=[],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd="/tmp",
                            start_new_session=True)


def _go(p: subprocess.Popen) -> None:
    p.stdin.write(b"go\n")
    p.stdin.close()


@contextmanager
def user_subtree(pw):
    """A cgroup subtree delegated to `pw` as systemd delegates user@UID.service: root makes the
    folder and gives the user it, its cgroup.procs, cgroup.subtree_control and cgroup.threads; the
    user may then make folders below it and move their processes between them."""
    mount = cgroup.v2_mount()
    if mount is None:
        pytest.skip("no cgroup v2 hierarchy here")
    sub = mount / f"colotest-user@{pw.pw_uid}.service"
    sub.mkdir(exist_ok=True)
    for f in (sub, sub / "cgroup.procs", sub / "cgroup.subtree_control", sub / "cgroup.threads"):
        os.chown(f, pw.pw_uid, pw.pw_gid)
    try:
        yield sub
    finally:
        for d, _, _ in sorted(os.walk(sub), key=lambda w: -len(w[0])):
            procs_file = Path(d) / "cgroup.procs"
            for _ in range(200):
                pids = procs_file.read_text().split() if procs_file.exists() else []
                if not pids:
                    break
                for p in pids:
                    try:
                        os.kill(int(p), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)
            os.rmdir(d)


def _stays(cond, seconds: float, what: str) -> None:
    """cond() holds at every look for `seconds` (what the old patrol needed to act)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert cond(), what
        time.sleep(0.2)


def _patrol_ended(d: DaemonProc, j: int, timeout: float = 60) -> dict:
    job = d.wait_state(j, "cancelled", "failed", "succeeded", timeout=timeout)
    assert job["state"] == "cancelled" and "GPU memory patrol" in job["reason"], job
    return job


def test_a_folder_named_for_alices_job_in_bobs_own_cgroup_subtree_blames_nobody(node, users):
    """Bob makes <his delegated subtree>/colo-<instance>/job-<alice's job> and moves a process that
    holds 3 GiB without the interposer into it. On ffbaf2e his 3 GiB were alice's within a second
    and her job was cancelled by the patrol after the grace; now they are outside any budget."""
    alice, bob = users
    d = node(patrol_grace=2.0)
    burn = str(_native(d) / "colo-burn")
    a = _submit(d, alice, [burn, "--mem", "1GiB", "--duty", "0", "--seconds", "600"], 4 * GiB)
    uuid = d.wait_state(a, "running", timeout=60)["gpus"][0]
    wait_for(lambda: _held(d, uuid) >= GiB, 30, "alice's job to hold its 1 GiB")
    inst = (d.state_dir / "instance").read_text().strip()  # world-readable
    with user_subtree(bob) as sub:
        forged = sub / f"colo-{inst}" / f"job-{a}"
        p = _outside(bob, d, uuid, f"mkdir -p {forged} && echo $$ > {forged}/cgroup.procs && "
                                   f"exec {burn} --mem 3GiB --duty 0 --seconds 600")
        (sub / "cgroup.procs").write_text(str(p.pid))  # where systemd starts the user's processes
        _go(p)
        try:
            wait_for(lambda: _held(d, uuid, p.pid) >= 3 * GiB, 30, "bob's process to hold 3 GiB")
            where = cgroup.places(p.pid)[""]
            assert where.endswith(f"/colo-{inst}/job-{a}") and where.startswith(f"/{sub.name}/"), where
            g = wait_for(lambda: (g := _gpu(d, uuid))["unbudgeted"] >= 3 * GiB and g, 30,
                         "bob's memory to show as outside any budget")
            assert g["over"] == [], g
            top = d.client.top()
            assert any(f["pid"] == p.pid and f["user"] == bob.pw_name for f in top["foreign"]), top["foreign"]
            _stays(lambda: (j := d.job(a))["state"] == "running" and "over its budget" not in (j["reason"] or "")
                   and not _gpu(d, uuid)["over"], 6.0, "alice's job is left alone")
        finally:
            p.kill()
            p.wait()


@pytest.mark.docker
def test_a_folder_named_for_alices_container_blames_nobody(node, users, test_image, docker_client):
    """The same with the id of alice's container (any 64 hex digits in the path matched before)."""
    alice, bob = users
    d = node(patrol_grace=2.0)
    burn = str(_native(d) / "colo-burn")
    a = _submit(d, alice, ["/opt/colo/native/colo-burn", "--mem", "1GiB", "--duty", "0", "--seconds", "600"],
                4 * GiB, image=test_image)
    uuid = d.wait_state(a, "running", timeout=90)["gpus"][0]
    wait_for(lambda: _held(d, uuid) >= GiB, 30, "alice's container to hold its 1 GiB")
    # job ids restart with every test's daemon: another test's container may carry the same colo.job
    instance = (d.state_dir / "instance").read_text().strip()
    (c,) = docker_client.containers.list(filters={"label": [f"colo.job={a}", f"colo.instance={instance}"]})
    with user_subtree(bob) as sub:
        forged = sub / "docker" / c.id
        p = _outside(bob, d, uuid, f"mkdir -p {forged} && echo $$ > {forged}/cgroup.procs && "
                                   f"exec {burn} --mem 3GiB --duty 0 --seconds 600")
        (sub / "cgroup.procs").write_text(str(p.pid))
        _go(p)
        try:
            wait_for(lambda: _held(d, uuid, p.pid) >= 3 * GiB, 30, "bob's process to hold 3 GiB")
            assert c.id in cgroup.places(p.pid)[""]
            wait_for(lambda: _gpu(d, uuid)["unbudgeted"] >= 3 * GiB, 30, "bob's memory outside any budget")
            _stays(lambda: d.job(a)["state"] == "running" and not _gpu(d, uuid)["over"], 6.0,
                   "alice's container is left alone")
        finally:
            p.kill()
            p.wait()


def test_dipping_under_the_budget_now_and_then_does_not_outwait_the_patrol(node, users):
    """Bob's job holds 3 GiB under a 1 GiB budget for 2.4 s, frees it for 0.4 s, and again, for
    about 20 s: each spell is shorter than the 3 s grace. On ffbaf2e every dip restarted the grace
    and the job succeeded; now its time over adds up within the 6 s window and it is killed."""
    _, bob = users
    d = node(patrol_grace=3.0)
    burn = str(_native(d) / "colo-burn")
    loop = (f"i=0; while [ $i -lt 7 ]; do env -u LD_PRELOAD {burn} --mem 3GiB --duty 0 --seconds 2.4 >/dev/null; "
            f"sleep 0.4; i=$((i+1)); done")
    b = _submit(d, bob, ["sh", "-c", loop], GiB)
    job = _patrol_ended(d, b)
    assert "of the last 6 s" in job["reason"], job["reason"]


def test_memory_on_another_jobs_gpu_ends_the_job_at_once(node, users):
    """Bob's job, given GPU1, puts 2 GiB on GPU0, alice's: with a 10-minute grace, it is ended at
    the next sample (on ffbaf2e: warned, and left for the grace)."""
    alice, bob = users
    d = node(patrol_grace=600.0)
    burn = str(_native(d) / "colo-burn")
    a = _submit(d, alice, [burn, "--mem", "1GiB", "--duty", "0", "--seconds", "600"], 4 * GiB, gpu_ids=[0])
    theirs = d.wait_state(a, "running", timeout=60)["gpus"][0]
    b = _submit(d, bob, ["sh", "-c", f"CUDA_VISIBLE_DEVICES={theirs} env -u LD_PRELOAD {burn} --mem 2GiB "
                                     "--duty 0 --seconds 600"], GiB, gpu_ids=[1])
    job = _patrol_ended(d, b)
    assert "GPU0 is not one of its GPUs" in job["reason"], job["reason"]
    assert d.job(a)["state"] == "running"
    wait_for(lambda: _held(d, theirs) < 2 * GiB, 30, "bob's memory to be freed")


def test_over_the_budget_where_a_neighbour_could_no_longer_get_its_own_ends_the_job_at_once(node, users):
    """Alice's job (4 GiB budget, 1 GiB held) and bob's (4 GiB) share GPU0 (16 GiB). Bob takes
    14 GiB past his budget: 1 GiB is left where alice may still take 3 GiB, so her next in-budget
    allocation would fail. He is ended at the next sample despite a 10-minute grace, and alice's
    job then takes its 3 GiB."""
    alice, bob = users
    d = node(patrol_grace=600.0)
    burn = str(_native(d) / "colo-burn")
    gate = d.root / "more"
    more = (f"{burn} --mem 1GiB --duty 0 --seconds 600 & until [ -e {gate} ]; do sleep 0.1; done; "
            f"{burn} --mem 3GiB --duty 0 --seconds 0.1; r=$?; kill $!; exit $r")
    a = _submit(d, alice, ["sh", "-c", more], 4 * GiB, gpu_ids=[0])
    uuid = d.wait_state(a, "running", timeout=60)["gpus"][0]
    wait_for(lambda: _held(d, uuid) >= GiB, 30, "alice's job to hold its 1 GiB")
    b = _submit(d, bob, ["sh", "-c", f"env -u LD_PRELOAD {burn} --mem 14GiB --duty 0 --seconds 600"], 4 * GiB,
                gpu_ids=[0])
    job = _patrol_ended(d, b)
    assert "other jobs may still take 3.0GiB within their budgets" in job["reason"], job["reason"]
    wait_for(lambda: _held(d, uuid) < 2 * GiB, 30, "bob's memory to be freed")
    gate.touch()
    done = d.wait_state(a, "succeeded", "failed", timeout=60)
    assert done["state"] == "succeeded", done


def test_a_process_of_no_job_is_killed_only_when_configured_and_only_that_process(node, users):
    """patrol_kill_foreign: bob's process outside colo holding 2 GiB is killed (by pid, checked
    through a pidfd). Under the default it is only reported (test_patrol.py)."""
    _, bob = users
    d = node(patrol_grace=1.0, patrol_kill_foreign=True)
    uuid = fakegpu.FakeNode(d.fake_state).uuids()[0]
    burn = str(_native(d) / "colo-burn")
    p = _outside(bob, d, uuid, f"exec {burn} --mem 2GiB --duty 0 --seconds 600")
    _go(p)
    try:
        assert p.wait(60) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "killed (patrol_kill_foreign)" in d.log.read_text()


def test_kill_exact_spares_a_process_that_is_not_the_one_looked_at(users):
    """A pid whose start time (or uid) is not the one recorded is another process: no signal."""
    _, bob = users
    p = subprocess.Popen(["sleep", "600"], user=bob.pw_uid, group=bob.pw_gid, extra_groups=[])
    try:
        start, uid = procs.identity(p.pid)
        assert uid == bob.pw_uid
        assert not procs.kill_exact(p.pid, start + 1, uid) and not procs.kill_exact(p.pid, start, 0)
        assert p.poll() is None
        assert procs.kill_exact(p.pid, start, uid)
        assert p.wait(10) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
