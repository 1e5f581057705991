"""A container's anonymous volumes (an image's VOLUME) go with it: when its job ends, when its
start fails, and when the sweep after a restart removes what colo left."""
from __future__ import annotations

import docker.errors
import pytest

from colo.runtimes.base import StartError
from colo.runtimes.image import build_local_image
from harness.daemon import wait_for

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def volume_image(docker_client):
    return build_local_image(docker_client, "colo-test/volume:1", with_shell=True, volumes=("/data",))


def volumes_of(docker_client, handle: str) -> list[str]:
    mounts = docker_client.api.inspect_container(handle)["Mounts"]
    return [m["Name"] for m in mounts if m["Type"] == "volume" and m["Destination"] == "/data"]


def gone(docker_client, volume: str) -> bool:
    try:
        docker_client.api.inspect_volume(volume)
        return False
    except docker.errors.NotFound:
        return True


def test_five_jobs_leave_no_volume(rt, launch, docker_client, volume_image):
    vols = []
    for i in range(5):
        h = rt.start(launch(["sh", "-c", f"head -c 1048576 /dev/zero > /data/f{i}"], image=volume_image, uid=0, gid=0))
        vols += volumes_of(docker_client, h)
        assert rt.wait(h) == 0
        rt.cleanup(h)
    assert len(vols) == 5 and all(gone(docker_client, v) for v in vols)


def test_a_failed_start_leaves_no_volume(rt, launch, docker_client, volume_image):
    ln = launch(["/no/such/program"], image=volume_image)
    before = {v["Name"] for v in docker_client.api.volumes()["Volumes"] or []}
    with pytest.raises(StartError, match="not found in image"):
        rt.start(ln)
    assert {v["Name"] for v in docker_client.api.volumes()["Volumes"] or []} - before == set()
    assert not docker_client.api.containers(all=True, filters={"label": f"colo.job={ln.job_id}"})


def test_the_daemon_removes_them_with_its_containers_after_a_restart_too(daemon, docker_client, volume_image,
                                                                         tmp_path):
    d = daemon
    gates = [tmp_path / "a", tmp_path / "b"]
    jobs = []
    for g in gates:
        g.mkdir()
        g.chmod(0o777)
        jobs.append(d.submit("--image", volume_image, "--gpus", "0", "--mount", f"{g}:/gate", "--", "sh", "-c",
                             "echo kept > /data/f; while [ ! -e /gate/go ]; do sleep 0.05; done"))
    instance = (d.state_dir / "instance").read_text().strip()

    def container(j):
        found = docker_client.api.containers(filters={"label": [f"colo.job={j}", f"colo.instance={instance}"]})
        return found[0]["Id"] if found else None

    vols = [v for j in jobs for v in volumes_of(docker_client, wait_for(lambda: container(j), what="its container"))]
    assert len(vols) == 2
    (gates[0] / "go").touch()  # ends with the daemon up
    d.wait_state(jobs[0], "succeeded")
    d.kill9()
    (gates[1] / "go").touch()  # ends while colo is away: found ended and removed at the restart
    d.start()
    d.wait_state(jobs[1], "succeeded")
    wait_for(lambda: all(gone(docker_client, v) for v in vols), what="the jobs' volumes to go")
