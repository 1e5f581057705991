"""The engines colo stands on failing under it (issue 8): dockerd stopped and started again, and
NVML failing mid-run. Each must end in a clear state with a clear message, harming no other job."""
from __future__ import annotations


import psutil
from harness.daemon import DaemonProc, wait_for

from colo.runtimes.image import build_local_image


def _daemon(tmp_path, fakegpu, engine) -> DaemonProc:
    build_local_image(engine.client(), "colo-test/base:1")
    return DaemonProc(tmp_path, fakegpu.state, env={"DOCKER_HOST": engine.url}).start()


def _running_script(needle: str) -> bool:
    return any(needle in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


def _colo_containers(engine) -> list:
    # the raw listing: the SDK's list() looks at each container, and 404s on one removed meanwhile
    return engine.client().api.containers(all=True, filters={"label": "colo.managed=1"})


def test_dockerd_restarted_jobs_end_clearly_and_queued_ones_wait(tmp_path, fakegpu, make_dockerd):
    engine = make_dockerd()
    d = _daemon(tmp_path, fakegpu, engine)
    try:
        gate = tmp_path / "gate"
        a = d.submit("--image", "colo-test/base:1", "--gpus", "0", "--", "sh", "-c",
                     "trap 'echo stopped; exit 3' TERM; echo before; while :; do sleep 0.1; done")
        p = d.submit("--process", "--gpus", "0", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done")
        b = d.submit("--image", "colo-test/base:1", "--gpus", "0", "--after", str(p), "--", "echo", "b ran")
        wait_for(lambda: "before" in d.cli("logs", str(a)).stdout, what="container output")

        engine.stop()  # as `systemctl restart docker` begins: the engine stops its containers
        job = d.wait_state(a, "failed", "succeeded", "lost", "cancelled", timeout=60)
        assert job["state"] == "failed" and job["exit_code"] == 3, job
        assert job["reason"].startswith("exited with code 3"), job

        r = d.cli("submit", "--image", "colo-test/base:1", "--gpus", "0", "--", "true")
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r
        assert "Docker engine not reachable" in r.stderr and "cannot be submitted" in r.stderr
        assert "Docker engine not reachable" in d.client.hello()["docker_error"]  # what `colo demo` and scripts read

        gate.touch()  # the process job ends: b may start now, but there is no engine to start it in
        assert d.wait_state(p, "succeeded")["exit_code"] == 0
        wait_for(lambda: "Docker engine" in d.job(b)["reason"], 30, "b to wait for the engine")
        assert d.job(b)["state"] == "queued"
        assert len(d.client.ls()) == 3  # the daemon answers all along; the refused submit left nothing

        engine.start()
        job = d.wait_state(b, "succeeded", "failed", timeout=60)
        assert d.client.hello()["docker_error"] is None
        assert job["state"] == "succeeded", job
        assert d.cli("logs", str(b), check=True).stdout == "b ran\n"
        assert "stopped" in d.cli("logs", str(a), check=True).stdout
        wait_for(lambda: not _colo_containers(engine), 30, "colo's containers to be removed")
    finally:
        d.stop()


def test_dockerd_restart_with_live_restore_follows_the_job_to_its_end(tmp_path, fakegpu, make_dockerd):
    engine = make_dockerd(live_restore=True)
    d = _daemon(tmp_path, fakegpu, engine)
    try:
        gates = tmp_path / "gates"
        gates.mkdir()
        gates.chmod(0o777)
        script = "echo before; while [ ! -e /gate/{0} ]; do sleep 0.05; done; echo after; exit {1}"
        early, late = (d.submit("--image", "colo-test/base:1", "--gpus", "0", "--mount", f"{gates}:/gate", "--",
                                "sh", "-c", script.format(name, code)) for name, code in (("early", 8), ("late", 9)))
        for j in (early, late):
            wait_for(lambda: "before" in d.cli("logs", str(j)).stdout, what="container output")
        engine.stop()  # with live-restore the containers run on without their engine
        (gates / "early").touch()
        wait_for(lambda: not _running_script("/gate/early"), 30, "the early container to end while the engine is away")
        assert d.job(late)["state"] == "running" and d.job(early)["state"] == "running"
        engine.start()
        (gates / "late").touch()
        for j, code in ((early, 8), (late, 9)):
            job = d.wait_state(j, "failed", "succeeded", "lost", timeout=60)
            assert job["state"] == "failed" and job["exit_code"] == code, job
            assert "Docker engine stopped or restarted while it ran" in job["reason"], job
        assert d.cli("logs", str(late), check=True).stdout == "before\nafter\n"  # nothing lost or doubled
        # What the early one wrote while the engine was away is lost by Docker itself (no reader on
        # its log pipe then); what colo had already copied is all there, once.
        assert d.cli("logs", str(early), check=True).stdout.startswith("before\n")
        wait_for(lambda: not _colo_containers(engine), 30, "colo's containers to be removed")
    finally:
        d.stop()


def test_nvml_failing_mid_run_drains_the_gpu_and_requeues_its_job(tmp_path, fakegpu, daemon):
    """Issue 42: a GPU NVML stops answering for is drained with that reason, its job requeued (and
    told in its log); it stays drained when it answers again, until an admin's undrain."""
    d = daemon
    gate = tmp_path / "gate"
    hold = f"while [ ! -e {gate} ]; do sleep 0.05; done"
    a = d.submit("--process", "--gpu-mem", "10GiB", "--name", "a", "--", "sh", "-c", hold)
    on = d.wait_state(a, "running")["gpus"][0]
    idx = {g: i for i, g in enumerate(fakegpu.uuids())}
    mine, other = idx[on], 1 - idx[on]
    lost = "drained by colo: NVML error: GPU is lost"

    fakegpu.fail_nvml(other, "lost")  # the empty GPU falls off the bus
    wait_for(lambda: [g["drained"] for g in d.client.gpus()["gpus"]][other] == lost, 120,
             "colo to drain the lost GPU")
    out = d.cli("gpus", check=True).stdout
    assert f"GPU{other} is out of service: NVML error: GPU is lost" in out and f"GPU{other} is {lost}" in out
    assert "NVML ERR" in d.cli("top", "--once", check=True).stdout
    b = d.submit("--process", "--gpu-mem", "10GiB", "--name", "b", "--", "true")
    wait_for(lambda: f"GPU{other} is out of service (NVML error: GPU is lost)" in d.job(b)["reason"], 120,
             "b to say why it waits")
    assert d.job(b)["state"] == "queued"
    assert d.job(a)["state"] == "running"  # the other GPU's job was not touched

    fakegpu.fail_nvml(mine, "unknown")  # now the driver fails for the running job's GPU as well
    said = f"requeued: GPU {mine} drained by colo: NVML error: Unknown Error"
    wait_for(lambda: any(e["reason"] == said for e in d.client.show(a)["events"]), 120, "a to be requeued")
    wait_for(lambda: f"[colo: {said}]" in d.cli("logs", str(a)).stdout, 120, "a's log to say so")
    wait_for(lambda: d.job(a)["state"] == "queued", 120, "a's attempt to end")

    fakegpu.fail_nvml("all", "off")  # they answer again, but stay drained
    wait_for(lambda: "answers again (it stays drained until colo undrain)" in d.log.read_text(), 120,
             "colo to see the GPUs answer")
    wait_for(lambda: "drained by colo" in d.job(b)["reason"] and "NVML error: GPU is lost)" not in d.job(b)["reason"],
             120, "b's reason to say the drain, not the error")
    assert d.job(b)["state"] == "queued" and d.job(a)["state"] == "queued"
    gate.touch()
    d.cli("undrain", "0", "1", check=True)
    assert d.wait_state(b, "succeeded", "failed")["state"] == "succeeded"
    assert d.wait_state(a, "succeeded", "failed")["exit_code"] == 0
    log = d.log.read_text()
    assert f"GPU{other} " in log and "GPU is lost" in log
    assert "Traceback" not in log


def test_daemon_started_before_dockerd_takes_container_jobs_once_it_answers(tmp_path, fakegpu, make_dockerd):
    """Boot order: colo may come up before the engine it will use."""
    engine = make_dockerd()
    build_local_image(engine.client(), "colo-test/base:1")
    engine.stop()
    d = DaemonProc(tmp_path, fakegpu.state, env={"DOCKER_HOST": engine.url}).start()
    try:
        r = d.cli("submit", "--image", "colo-test/base:1", "--gpus", "0", "--", "echo", "hi")
        assert r.returncode != 0 and "Docker engine not reachable" in r.stderr and len(r.stderr.splitlines()) == 1
        engine.start()
        j = wait_for(lambda: (r := d.cli("submit", "--image", "colo-test/base:1", "--gpus", "0", "--", "echo", "hi"))
                     .returncode == 0 and int(r.stdout), 30, "colo to find the engine")
        assert d.wait_state(j, "succeeded", "failed")["state"] == "succeeded"
        assert d.cli("logs", str(j), check=True).stdout == "hi\n"
        assert "Docker engine found" in d.log.read_text()
    finally:
        d.stop()
