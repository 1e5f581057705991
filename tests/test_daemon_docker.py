"""Container jobs through the whole daemon: real dockerd, the local test image, simulated GPUs."""
from __future__ import annotations

import os
import subprocess

import pytest

from harness.daemon import wait_for

pytestmark = pytest.mark.docker


@pytest.fixture
def ddaemon(daemon, test_image):
    daemon.image = test_image
    return daemon


def burn(*args: str) -> list[str]:
    return ["--", "/opt/colo/native/colo-burn", *args]


def ours(d, j: int) -> list[str]:
    """`docker ps` filters for job J's container of this daemon: job ids repeat across daemons on
    one engine (an earlier run's container left behind matched `colo.job=J` alone)."""
    instance = (d.state_dir / "instance").read_text().strip()
    return ["--filter", f"label=colo.job={j}", "--filter", f"label=colo.instance={instance}"]


def gated_container(d, tmp_path, before: str, after: str):
    """A container job that runs the shell text BEFORE, waits until the test creates the path it
    returns (/gate/go inside), then runs AFTER. Returns (job id, that path)."""
    gate = tmp_path / "gate"
    gate.mkdir()
    os.chmod(gate, 0o777)
    j = d.submit("--image", d.image, "--gpus", "0", "--mount", f"{gate}:/gate", "--", "sh", "-c",
                 f"{before}while [ ! -e /gate/go ]; do sleep 0.05; done; {after}")
    return j, gate / "go"


def test_container_job_lifecycle_logs_exit_and_user(ddaemon):
    d = ddaemon
    j = d.submit("--image", d.image, "--gpus", "0", "--env", "GREETING=hi", "--", "sh", "-c",
                 'echo "$GREETING from $(id -u)"; exit 6')
    assert d.cli("wait", str(j)).returncode == 6
    assert d.cli("logs", str(j), check=True).stdout == "hi from 0\n"
    job = d.job(j)
    assert job["state"] == "failed" and job["exit_code"] == 6
    assert not d.client.gpus()["gpus"][0]["jobs"]


def test_gpu_container_is_held_to_its_budget_and_lives_on(ddaemon):
    d = ddaemon
    j = d.submit("--image", d.image, "--gpu-mem", "1GiB", *burn("--mem", "768MiB", "--over", "512MiB"))
    assert d.cli("wait", str(j)).returncode == 0  # the over-budget allocation was refused, as it expected
    out = d.cli("logs", str(j), check=True).stdout
    assert "allocated 768MiB" in out and "refused" in out and "colo: allocation of" in out
    assert "1 allocation(s) refused" in d.job(j)["reason"]


def test_cancel_running_container(ddaemon, tmp_path):
    d = ddaemon
    j = d.submit("--image", d.image, "--gpus", "0", "--", "sh", "-c",
                 "trap 'echo bye; exit 0' TERM; echo up; while true; do sleep 0.1; done")
    wait_for(lambda: "up" in d.cli("logs", str(j)).stdout, what="container output")
    d.cli("cancel", str(j), check=True)
    job = d.wait_state(j, "cancelled")
    assert "bye" in d.cli("logs", str(j)).stdout and job["reason"].startswith("cancelled by")


def test_unknown_image_and_image_without_shell(ddaemon, docker_client):
    d = ddaemon
    r = d.cli("submit", "--image", "no/such-image:0", "--gpus", "0", "--", "true")
    assert r.returncode == 1 and "not found locally" in r.stderr and len(r.stderr.splitlines()) == 1
    from colo.runtimes.image import build_local_image

    noshell = build_local_image(docker_client, "colo-test/noshell:1", with_shell=False)
    j = d.submit("--image", noshell, "--gpus", "0", "--", "sh", "-c", "echo hi")
    job = d.wait_state(j, "failed")
    assert "failed to start" in job["reason"] and "sh" in job["reason"]


def test_running_container_is_found_again_after_kill9(ddaemon, tmp_path):
    d = ddaemon
    j, go = gated_container(d, tmp_path, "echo before; ", "echo after; exit 9")
    wait_for(lambda: "before" in d.cli("logs", str(j)).stdout, what="container output")
    d.kill9()
    d.start()
    assert d.job(j)["state"] == "running"
    go.touch()
    job = d.wait_state(j, "failed")
    assert job["exit_code"] == 9
    assert d.cli("logs", str(j), check=True).stdout == "before\nafter\n"  # nothing lost or doubled


def test_container_that_ends_while_daemon_is_down_keeps_its_exit_code_and_output(ddaemon, tmp_path):
    d = ddaemon
    j, go = gated_container(d, tmp_path, "echo start; ", "echo end; exit 3")
    wait_for(lambda: "start" in d.cli("logs", str(j)).stdout, what="container output")
    d.kill9()
    go.touch()  # it writes its last line and ends while no daemon follows it
    cid = subprocess.run(["docker", "ps", "-aq", *ours(d, j)], capture_output=True, text=True,
                         check=True).stdout.split()
    subprocess.run(["docker", "wait", *cid], check=True, capture_output=True)
    d.start()
    job = d.wait_state(j, "failed")
    assert job["exit_code"] == 3
    assert d.cli("logs", str(j), check=True).stdout == "start\nend\n"  # copied before the container went
    wait_for(lambda: not subprocess.run(["docker", "ps", "-aq", *ours(d, j)], capture_output=True,
                                        text=True).stdout.strip(),
             what="the ended container to be removed")


def test_container_removed_behind_colos_back_is_lost(ddaemon):
    d = ddaemon
    j = d.submit("--image", d.image, "--gpus", "0", "--", "sh", "-c", "echo up; sleep 60")
    wait_for(lambda: "up" in d.cli("logs", str(j)).stdout, what="container output")
    d.kill9()
    cid = subprocess.run(["docker", "ps", "-aq", *ours(d, j)], capture_output=True, text=True,
                         check=True).stdout.split()
    subprocess.run(["docker", "rm", "-f", *cid], check=True, capture_output=True)
    d.start()
    job = d.wait_state(j, "lost")
    assert "lost" in job["reason"]


def test_another_daemon_on_the_same_engine_leaves_our_containers_alone(ddaemon, tmp_path, fakegpu):
    from harness.daemon import DaemonProc

    d = ddaemon
    j = d.submit("--image", d.image, "--gpus", "0", "--", "sh", "-c", "echo up; sleep 60")
    wait_for(lambda: "up" in d.cli("logs", str(j)).stdout, what="container output")
    (tmp_path / "other").mkdir()
    other = DaemonProc(tmp_path / "other", fakegpu.state).start()  # its recovery scans the same engine
    try:
        assert other.client.ls() == []
        assert d.job(j)["state"] == "running"
        assert subprocess.run(["docker", "ps", "-q", *ours(d, j)], capture_output=True, text=True).stdout.strip()
    finally:
        other.stop()


def test_mount_swapped_for_a_symlink_after_submit_is_refused_at_start(ddaemon, tmp_path):
    d = ddaemon
    gate = tmp_path / "never"
    hogs = [d.submit("--process", "--gpu-mem", "16GiB", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done")
            for _ in range(2)]
    for h in hogs:
        d.wait_state(h, "running")
    data = tmp_path / "data"
    data.mkdir()
    j = d.submit("--image", d.image, "--gpu-mem", "1GiB", "--mount", f"{data}:/data:ro", "--", "ls", "/data")
    data.rmdir()
    data.symlink_to("/var/run/docker.sock")  # swapped while the job waits in the queue
    for h in hogs:
        d.cli("cancel", str(h), check=True)
    job = d.wait_state(j, "failed")
    assert "failed to start" in job["reason"] and "not allowed" in job["reason"], job["reason"]


def test_daemon_stops_at_once_with_jobs_running_and_finds_them_again(ddaemon, tmp_path):
    """SIGTERM (systemctl stop) must not wait for running jobs: they run on and are followed again."""
    d = ddaemon
    c, go = gated_container(d, tmp_path, "", "exit 5")
    p = d.submit("--process", "--gpus", "0", "--", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done")
    for j in (c, p):
        d.wait_state(j, "running")
    d.proc.terminate()
    d.proc.wait(timeout=20)  # before the fix it waited for both jobs to end
    assert "Traceback" not in d.log.read_text()
    d.start()
    assert [d.job(j)["state"] for j in (c, p)] == ["running", "running"]
    go.touch()
    assert d.wait_state(c, "failed")["exit_code"] == 5
    assert d.wait_state(p, "succeeded")["exit_code"] == 0


def test_a_child_started_late_in_a_container_with_a_mount_is_held_to_its_budget(ddaemon, tmp_path):
    # The user's mount is staged and its staging removed once the container has started: colo's own
    # mounts (the interposer, the run folder) must stay for every process the job starts later.
    d = ddaemon
    gate = tmp_path / "gate"
    gate.mkdir()
    os.chmod(gate, 0o777)
    go = gate / "go"
    j = d.submit("--image", d.image, "--gpu-mem", "1GiB", "--mount", f"{gate}:/gate:ro", "--", "sh", "-c",
                 "while [ ! -e /gate/go ]; do sleep 0.05; done; /opt/colo/native/colo-burn --mem 768MiB --over 512MiB")
    d.wait_state(j, "running")
    go.touch()
    assert d.cli("wait", str(j)).returncode == 0, d.cli("logs", str(j)).stdout
    out = d.cli("logs", str(j), check=True).stdout
    assert "cannot be preloaded" not in out and "colo: allocation of" in out, out
    assert "1 allocation(s) refused" in d.job(j)["reason"]
