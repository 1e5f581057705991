"""Every process job in a cgroup of its own (issue 12, items 1 and 4; invariant 11): nothing a job
started runs on after its end, a cancel or its --time; --cpus/--mem limits where the controllers
exist; a job's output cannot fill the state disk. Real daemon, real cgroups, real processes.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import psutil
import pytest

from colo.node.cgroup import places
from colo.client import Client
from harness.daemon import DaemonProc, wait_for
from harness.users import ensure_users, run_as, shared_root


MiB = 1024**2


@pytest.fixture(autouse=True)
def _root():
    if os.geteuid() != 0:
        pytest.skip("cgroups and other users need root")


def _burn(d: DaemonProc) -> str:
    """colo-burn as published for jobs (world-readable)."""
    (path,) = d.state_dir.glob("native-*/colo-burn")
    return str(path)


def _pids_file_alive(path: Path) -> list[int]:
    pids = [int(x) for x in path.read_text().split()] if path.exists() else []
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _gpu_pids(fakegpu) -> set[int]:
    return {p["pid"] for dev in fakegpu.read()["devices"] for p in dev["processes"]}


def test_setsid_and_double_forked_children_end_with_the_job(daemon, fakegpu, tmp_path):
    """A job that leaves a `setsid` child holding GPU memory outside its budget (LD_PRELOAD unset)
    and a double-forked one, then exits: both are killed when it ends; the same on cancel."""
    burn, pids, gate = _burn(daemon), tmp_path / "pids", tmp_path / "go"
    leave = (f'setsid env -u LD_PRELOAD {burn} --mem 256MiB --seconds 600 & echo $! >> {pids}; '
             f'(sleep 600 & echo $! >> {pids}) & '
             f'until [ "$(wc -l < {pids})" -ge 2 ]; do sleep 0.05; done; ')
    j = daemon.client.submit({"argv": ["sh", "-c", leave + f"until [ -e {gate} ]; do sleep 0.05; done"],
                              "gpus": 1, "gpu_mem": "64MiB"})["id"]
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 2, 30, "the job to start its children")
    left = [int(x) for x in pids.read_text().split()]
    wait_for(lambda: left[0] in _gpu_pids(fakegpu), 30, "the setsid child to hold GPU memory")
    gate.touch()
    job = daemon.wait_state(j, "succeeded", "failed")
    assert job["state"] == "succeeded", job
    wait_for(lambda: not _pids_file_alive(pids), 20, "the job's children to be killed")
    wait_for(lambda: not set(left) & _gpu_pids(fakegpu), 20, "the GPU memory to be released")

    pids.unlink()
    j = daemon.client.submit({"argv": ["sh", "-c", leave + "echo ready; sleep 600"], "gpus": 1,
                              "gpu_mem": "64MiB"})["id"]
    wait_for(lambda: "ready" in "".join(daemon.client.logs(j)), 30, "the job to start its children")
    left = [int(x) for x in pids.read_text().split()]
    wait_for(lambda: left[0] in _gpu_pids(fakegpu), 30, "the setsid child to hold GPU memory")
    contained = "without a cgroup of their own" not in daemon.log.read_text()  # else: the shim's subreaper
    assert all(_in_leaf(p, daemon, j) == contained for p in left)
    daemon.client.cancel(j)
    daemon.wait_state(j, "cancelled")
    wait_for(lambda: not _pids_file_alive(pids), 20, "the cancelled job's children to be killed")
    wait_for(lambda: not set(left) & _gpu_pids(fakegpu), 20, "the GPU memory to be released")
    assert not any(_in_leaf(p, daemon, j) for p in left)


def _instance(d: DaemonProc) -> str:
    return (d.state_dir / "instance").read_text().strip()


def _in_leaf(pid: int, d: DaemonProc, job: int) -> bool:
    """Is the process in the job's leaf of this daemon's cgroup folder?"""
    return any(path.endswith(f"/colo-{_instance(d)}/job-{job}") for path in places(pid).values())


def test_time_limit_stops_the_job_and_its_children(daemon, tmp_path):
    pids = tmp_path / "pids"
    r = daemon.cli("submit", "--process", "--gpus", "0", "--time", "0:02", "--", "sh", "-c",
                   f"(setsid sleep 600 & echo $! > {pids}); sleep 600", check=True)
    j = int(r.stdout.strip())
    job = daemon.wait_state(j, "failed", "succeeded", timeout=60)
    assert job["state"] == "failed" and job["reason"].startswith("stopped at its time limit of 2s"), job
    assert job["ended_at"] - job["started_at"] >= 2
    wait_for(lambda: not _pids_file_alive(pids), 20, "its setsid child to be killed")
    bad = daemon.cli("submit", "--process", "--gpus", "0", "--time", "soon", "--", "true")
    assert bad.returncode != 0 and "malformed --time" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_a_chatty_job_is_capped_and_others_still_submit(fakegpu):
    """`yes` for a while: its log stops at the cap with one marked line; another user submits and
    runs meanwhile. Then a daemon whose disk reserve cannot be met drops output with a marked line."""
    alice, bob = ensure_users(2)
    root = shared_root("colo-cap-")
    d = DaemonProc(root, fakegpu.state, config={"log_cap": "1MiB"}).start()
    os.chmod(d.socket.parent, 0o755)
    try:
        j = run_as(alice, lambda: Client(d.socket).submit({"argv": ["yes"], "gpus": 0, "workdir": "/"})["id"])
        log = d.state_dir / "logs" / f"{j}.log"
        wait_for(lambda: log.exists() and b"[colo: the log reached its cap" in log.read_bytes()[-200:], 60, "the cap")
        size = log.stat().st_size
        other = run_as(bob, lambda: Client(d.socket).submit({"argv": ["echo", "hi"], "gpus": 0, "workdir": "/"})["id"])
        assert d.wait_state(other, "succeeded") and "".join(d.client.logs(other)) == "hi\n"
        assert d.job(j)["state"] == "running" and log.stat().st_size == size  # dropped, not written
        assert MiB <= size < MiB + 200 and log.read_bytes().count(b"[colo:") == 1
        d.client.cancel(j)
        d.wait_state(j, "cancelled")
    finally:
        d.stop()
    d = DaemonProc(root, fakegpu.state, config={"log_reserve": "1000000TiB"}).start()
    try:
        j = d.client.submit({"argv": ["sh", "-c", "echo one; echo two"], "gpus": 0})["id"]
        d.wait_state(j, "succeeded")
        out = "".join(d.client.logs(j))
        assert "one" not in out and out.count("[colo: output dropped: less than") == 1, out
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def _cgroup_file(pid: int, v1: str, v2name: str) -> Path | None:
    """The file of `pid`'s cgroup that holds a limit: v1 hierarchy `v1` or the v2 file `v2name`."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if v1.split(".")[0] in ctrls.split(","):
            return Path("/sys/fs/cgroup") / v1.split(".")[0] / path.lstrip("/") / v1
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                f = mount / line[3:].lstrip("/") / v2name
                if f.exists():
                    return f
    return None


def test_cpu_and_memory_limits(daemon, tmp_path):
    pidf = tmp_path / "pid"
    r = daemon.cli("submit", "--process", "--gpus", "0", "--cpus", "0.5", "--mem", "64MiB", "--", "sh", "-c",
                   f"echo $$ > {pidf}; sleep 600")
    if r.returncode != 0:
        assert "cannot be enforced here" in r.stderr, r.stderr
        pytest.skip(r.stderr.strip())
    j = int(r.stdout.strip())
    job = daemon.wait_state(j, "running", "failed")
    if job["state"] == "failed":
        assert "cannot be enforced here" in job["reason"], job
        pytest.skip(job["reason"])
    pid = int(wait_for(lambda: pidf.exists() and pidf.read_text().strip(), 20, "the job's pid"))
    quota = _cgroup_file(pid, "cpu.cfs_quota_us", "cpu.max").read_text().split()
    assert quota[0] == "50000" and (len(quota) == 1 or quota[1] == "100000"), quota
    limit = _cgroup_file(pid, "memory.limit_in_bytes", "memory.max").read_text().strip()
    assert int(limit) == 64 * MiB
    daemon.client.cancel(j)
    daemon.wait_state(j, "cancelled")
    # the limit holds: a job that takes 256 MiB under --mem 64MiB is killed by the kernel
    grab = [sys.executable, "-c", "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096]); print('kept')"]
    j = daemon.client.submit({"argv": grab, "gpus": 0, "mem": "64MiB"})["id"]
    job = daemon.wait_state(j, "failed", "succeeded", timeout=60)
    assert job["state"] == "failed" and job["exit_code"] == 137, job
    assert "kept" not in "".join(daemon.client.logs(j))


def test_container_limits_and_time(daemon, test_image, docker_client):
    """Containers take --cpus/--mem as Docker's own limits, and --time as process jobs do."""
    r = daemon.cli("submit", "--image", test_image, "--gpus", "0", "--cpus", "0.5", "--mem", "64MiB",
                   "--time", "3s", "--", "sleep", "600", check=True)
    j = int(r.stdout.strip())
    daemon.wait_state(j, "running", timeout=60)
    (c,) = docker_client.containers.list(filters={"label": [f"colo.job={j}", f"colo.instance={_instance(daemon)}"]})
    host = c.attrs["HostConfig"]
    assert host["NanoCpus"] == 500_000_000 and host["Memory"] == 64 * MiB, host
    job = daemon.wait_state(j, "failed", "succeeded", timeout=60)
    assert job["state"] == "failed" and job["reason"].startswith("stopped at its time limit of 3s"), job
