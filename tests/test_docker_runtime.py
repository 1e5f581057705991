"""DockerRuntime against the real engine and a locally imported image (no registry)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import docker.errors
import pytest

from colo.jobs import Mount
from colo.runtimes.base import Gone, StartError
from colo.runtimes.docker import DockerRuntime, cursor_path
from colo.runtimes.image import build_local_image
from harness.daemon import wait_for

def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_output_goes_to_log_and_exit_code(rt, launch):
    ln = launch(["sh", "-c", "echo out; echo err >&2; printf no-newline"])
    h = rt.start(ln)
    assert rt.wait(h) == 0
    # stdout and stderr are separate pipes: their relative order is not fixed, their content is.
    text = ln.log_path.read_text()
    assert sorted(text.replace("no-newline", "\nno-newline").split()) == [
        "err",
        "no-newline",
        "out",
    ]
    assert text.endswith("no-newline")
    assert rt.poll(h) == 0


def test_nonzero_exit(rt, launch):
    h = rt.start(launch(["sh", "-c", "exit 7"]))
    assert rt.wait(h) == 7
    assert rt.poll(h) == 7


def test_runs_as_uid_gid_with_env_workdir_and_readonly_mount(rt, launch, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "in.txt").write_text("hello\n")
    ln = launch(
        [
            "sh",
            "-c",
            "id -u; id -g; echo $FOO; pwd; cat /data/in.txt; "
            "(echo x > /data/new) 2>/dev/null && echo WROTE || echo DENIED",
        ],
        env={"FOO": "bar baz"},
        workdir="/tmp",
        mounts=[Mount(str(data), "/data", read_only=True)],
        uid=0,  # root inside: only the read-only mount can stop the write
        gid=0,
    )
    assert rt.wait(rt.start(ln)) == 0
    assert lines(ln.log_path) == ["0", "0", "bar baz", "/tmp", "hello", "DENIED"]
    assert not (data / "new").exists()

    ln2 = launch(["sh", "-c", "id -u; id -g"], uid=4321, gid=2345)
    assert rt.wait(rt.start(ln2)) == 0
    assert lines(ln2.log_path) == ["4321", "2345"]


def test_labels_and_no_privileges(rt, launch, docker_client):
    ln = launch(["sleep", "30"], labels={"colo.user": "alice"})
    h = rt.start(ln)
    info = docker_client.api.inspect_container(h)
    labels = info["Config"]["Labels"]
    assert (
        labels["colo.job"] == str(ln.job_id)
        and labels["colo.managed"] == "1"
        and labels["colo.user"] == "alice"
    )
    hc = info["HostConfig"]
    assert hc["Privileged"] is False and not hc["CapAdd"] and not hc["Devices"]
    assert "no-new-privileges" in hc["SecurityOpt"]
    assert hc["NetworkMode"] != "host" and hc["PidMode"] != "host" and hc["IpcMode"] != "host"
    assert not hc["AutoRemove"]
    assert info["Config"]["User"] == "1234:1234"
    assert not hc.get(
        "DeviceRequests"
    )  # no NVIDIA runtime given: simulated GPUs come as mounts/env
    rt.stop(h, 0)


def test_share_host_shm(rt, launch):
    name = f"colo-test-{uuid.uuid4().hex[:12]}"
    shm = Path("/dev/shm") / name
    shm.write_text("shared\n")
    try:
        ln = launch(["cat", f"/dev/shm/{name}"], uid=0, gid=0, share_host_shm=True)
        assert rt.wait(rt.start(ln)) == 0
        assert lines(ln.log_path) == ["shared"]
        ln2 = launch(
            ["cat", f"/dev/shm/{name}"], uid=0, gid=0
        )  # without it: the container's own /dev/shm
        assert rt.wait(rt.start(ln2)) != 0
    finally:
        shm.unlink()


def test_stop_with_grace_term_handled(rt, launch):
    ln = launch(["sh", "-c", "trap 'echo got-term; exit 5' TERM; echo ready; sleep 1000 & wait"])
    h = rt.start(ln)
    wait_for(lambda: "ready" in lines(ln.log_path), what="the trap to be set")
    rt.stop(h, grace=20)
    assert rt.wait(h) == 5  # its own exit code after its TERM trap: it left on SIGTERM, not SIGKILL
    assert lines(ln.log_path) == ["ready", "got-term"]


def test_stop_with_grace_term_ignored(rt, launch):
    ln = launch(["sh", "-c", "trap '' TERM; echo ready; sleep 1000 & wait"])
    h = rt.start(ln)
    wait_for(lambda: "ready" in lines(ln.log_path), what="the trap to be set")
    t0 = time.monotonic()
    rt.stop(h, grace=1)
    took = time.monotonic() - t0
    assert rt.poll(h) == 137  # SIGKILL
    assert took >= 1  # the grace was given before the SIGKILL (a lower bound: no slower machine fails it)


def test_pids_are_host_pids_of_the_container(rt, launch):
    h = rt.start(launch(["sleep", "1000"]))
    pids = wait_for(lambda: rt.pids(h), what="the container's processes")
    for pid in pids:
        assert h in Path(f"/proc/{pid}/cgroup").read_text()
    assert any(Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"sleep\0") for p in pids)
    rt.stop(h, 0)
    assert rt.pids(h) == []


def test_adopt_and_resume_logs_without_duplicates(rt, launch, docker_client, tmp_path):
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    script = (
        "i=0; while [ $i -lt 100 ]; do echo line$i; i=$((i+1)); done; "
        # the job waits for the test here, not the other way round
        "while [ ! -e /ctl/go ]; do sleep 0.05; done; "
        "while [ $i -lt 200 ]; do echo line$i; i=$((i+1)); done"
    )
    ln = launch(["sh", "-c", script], mounts=[Mount(str(ctl), "/ctl", read_only=True)])
    h = rt.start(ln)
    wait_for(lambda: len(lines(ln.log_path)) == 100, what="the first 100 lines")
    rt.close()  # the daemon goes away (its followers stop)
    with open(ln.log_path, "ab") as f:
        f.write(b"half-written-after-the-last-cursor-save")  # what a crash can leave behind

    fresh = DockerRuntime(docker_client)
    try:
        adopted = fresh.adopt()
        assert adopted[ln.job_id] == h
        fresh.follow_logs(h, ln.log_path)
        (ctl / "go").touch()
        assert fresh.wait(h) == 0
        assert lines(ln.log_path) == [f"line{i}" for i in range(200)]
    finally:
        fresh.close()


def test_resume_from_any_cursor_is_exact(rt, launch, docker_client):
    """Cut the cursor back to every kind of position, including inside a run of equal timestamps."""
    ln = launch(["sh", "-c", "i=0; while [ $i -lt 300 ]; do echo l$i; i=$((i+1)); done"])
    h = rt.start(ln)
    assert rt.wait(h) == 0
    want = ln.log_path.read_bytes()
    assert want.decode().splitlines() == [f"l{i}" for i in range(300)]
    stamped = [fr.partition(b" ") for fr in docker_client.api.logs(h, timestamps=True, stream=True)]
    positions = [0, 1, 150, 299, 300]
    equal_runs = [i for i in range(1, 300) if stamped[i][0] == stamped[i - 1][0]]
    positions += equal_runs[:3]
    for k in positions:  # k messages already written
        if k:
            ts = stamped[k - 1][0].decode()
            n = sum(1 for s, _, _ in stamped[:k] if s.decode() == ts)
        else:
            ts, n = "", 0
        offset = sum(len(m) for _, _, m in stamped[:k])
        cursor_path(ln.log_path).write_text(json.dumps({"ts": ts, "n": n, "offset": offset}))
        with open(ln.log_path, "r+b") as f:
            f.truncate(offset)
            f.seek(offset)
            f.write(b"stale tail\n" * 3)
        again = DockerRuntime(docker_client)
        again.follow_logs(h, ln.log_path)
        again._drain(h)
        assert ln.log_path.read_bytes() == want, f"resumed after {k} messages"


def test_removed_behind_our_back_is_gone(rt, launch, docker_client):
    h = rt.start(launch(["sleep", "1000"]))
    docker_client.api.remove_container(h, force=True)
    with pytest.raises(Gone):
        rt.wait(h)
    with pytest.raises(Gone):
        rt.poll(h)
    with pytest.raises(Gone):
        rt.pids(h)
    rt.cleanup(h)  # nothing left to remove: no error
    rt.stop(h, 1)


def test_unknown_image(rt, launch):
    with pytest.raises(
        StartError, match=r"image 'colo-test/nonexistent:9' not found locally \(colo does not pull"
    ):
        rt.start(launch(["true"], image="colo-test/nonexistent:9"))


def test_image_without_shell(rt, launch, docker_client):
    image = build_local_image(docker_client, "colo-test/noshell:1", with_shell=False)
    ln = launch(["sh", "-c", "echo hi"], image=image)
    with pytest.raises(StartError) as e:
        rt.start(ln)
    assert str(e.value) == "command 'sh' not found in image 'colo-test/noshell:1'"
    # The half-created container was removed.
    assert not docker_client.api.containers(all=True, filters={"label": f"colo.job={ln.job_id}"})
    # The same image still runs what it has.
    ok = launch(["echo", "fine"], image=image)
    assert rt.wait(rt.start(ok)) == 0 and lines(ok.log_path) == ["fine"]


def test_cleanup_keeps_the_log(rt, launch, docker_client):
    ln = launch(["sh", "-c", "echo kept"])
    h = rt.start(ln)
    assert rt.wait(h) == 0
    assert ln.job_id in rt.adopt()  # exited but not removed: still found
    rt.cleanup(h)
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_container(h)
    assert ln.job_id not in rt.adopt()
    assert lines(ln.log_path) == ["kept"]


def test_local_image_is_reused(docker_client, test_image):
    before = docker_client.api.inspect_image(test_image)["Id"]
    assert build_local_image(docker_client, test_image) == test_image
    assert docker_client.api.inspect_image(test_image)["Id"] == before
