"""The patrol (issue 12, item 2): GPU memory NVML sees per process, reconciled with budgets.

Real daemon, real processes, the real pynvml on the simulated driver; the memory is held with
the interposer bypassed (`env -u LD_PRELOAD`), as a job that wants more than its budget would.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess

from harness.daemon import DaemonProc, wait_for

from colo.node import native

GiB = 1024**3


def _held(fakegpu, uuid: str) -> int:
    return sum(p["used"] for d in fakegpu.read()["devices"] if d["uuid"] == uuid for p in d["processes"])


def test_a_job_holding_past_its_budget_behind_the_interposer_is_reported_then_killed(tmp_path, fakegpu):
    d = DaemonProc(tmp_path, fakegpu.state, config={"patrol_grace": 6.0}).start()
    try:
        burn = native.path("colo-burn")
        # the job's child drops the interposer and takes 3 GiB under a 1 GiB budget
        j = d.submit("--process", "--gpu-mem", "1GiB", "--", "sh", "-c",
                     f"env -u LD_PRELOAD {burn} --mem 3GiB --duty 0 --seconds 600")
        uuid = d.wait_state(j, "running")["gpus"][0]
        why = wait_for(lambda: "over its budget" in (r := d.job(j)["reason"]) and r, 60, "the patrol's report")
        assert "3.0GiB" in why and "budget of 1.0GiB" in why and "killed in" in why
        assert "over its budget" in d.cli("explain", str(j), check=True).stdout
        gpus = wait_for(lambda: [g for g in d.client.gpus()["gpus"] if g["uuid"] == uuid and g["over"]], 30,
                        "colo gpus to name the job")
        assert gpus[0]["over"] == [j] and gpus[0]["unbudgeted"] >= 2 * GiB
        assert "outside any budget" in d.cli("gpus", check=True).stdout
        done = d.wait_state(j, "cancelled", "failed", timeout=60)
        assert "GPU memory patrol" in done["reason"], done["reason"]
        wait_for(lambda: _held(fakegpu, uuid) == 0, 30, "the memory to be freed")
    finally:
        d.stop()


def test_patrol_kill_off_reports_but_leaves_the_job(tmp_path, fakegpu):
    d = DaemonProc(tmp_path, fakegpu.state, config={"patrol_grace": 0.0, "patrol_kill": False}).start()
    try:
        burn = native.path("colo-burn")
        gate = tmp_path / "go"
        j = d.submit("--process", "--gpu-mem", "1GiB", "--", "sh", "-c",
                     f"env -u LD_PRELOAD {burn} --mem 2GiB --duty 0 --seconds 600 & "
                     f"while [ ! -e {gate} ]; do sleep 0.1; done; kill $!; wait")
        wait_for(lambda: "patrol_kill is off" in d.job(j)["reason"], 60, "the patrol's report")
        assert d.job(j)["state"] == "running"
        gate.touch()
        d.wait_state(j, "succeeded", timeout=60)
    finally:
        d.stop()


def test_memory_held_by_a_process_of_no_job_is_not_given_out(daemon, fakegpu):
    """12 GiB of GPU0 held by a process colo did not start: an 8 GiB job, which best fit would
    put on GPU0 (both look empty to the budgets) and which would fail there out of memory, goes
    to GPU1."""
    burn = native.path("colo-burn")
    uuids = fakegpu.uuids()
    env = {**os.environ, **fakegpu.env, "CUDA_VISIBLE_DEVICES": uuids[0]}
    env.pop("LD_PRELOAD", None)
    hog = subprocess.Popen([str(burn), "--mem", "12GiB", "--duty", "0", "--seconds", "600"], env=env,
                           stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: _held(fakegpu, uuids[0]) >= 12 * GiB, 30, "the foreign process to hold its memory")
        g0 = wait_for(lambda: (g := daemon.client.gpus()["gpus"][0])["unbudgeted"] >= 12 * GiB and g, 30,
                      "colo gpus to show the unbudgeted use")
        assert g0["budgeted"] == 0 and not g0["jobs"]
        top = daemon.client.top()
        assert any(f["pid"] == hog.pid and f["used"] >= 12 * GiB for f in top["foreign"])
        j = daemon.submit("--process", "--gpu-mem", "8GiB", "--", str(burn), "--mem", "8GiB")
        done = daemon.wait_state(j, "succeeded", "failed", timeout=60)
        assert done["state"] == "succeeded", done["reason"]
        assert done["gpus"] == [uuids[1]]
    finally:
        os.killpg(hog.pid, signal.SIGKILL)
        hog.wait()


def test_memory_of_a_job_that_just_ended_is_not_outside_any_budget_within_the_grace(tmp_path, fakegpu, native_dir):
    """NVML may list a process of a job that just ended while the driver releases its memory: for
    patrol_grace seconds it is neither unbudgeted (the next job, one Slurm put into the shards
    just freed, would be requeued for it) nor a stray; after that it is both."""
    from colo.config import Config
    from colo.daemon.gpus import Gpus
    from colo.daemon.jobtable import JobTable
    from colo.daemon.patrol import Patrol, PatrolReport
    from colo.jobs import JobSpec, State
    from colo.store import Store

    cfg = Config(state_dir=tmp_path / "state", fakegpu_state=fakegpu.state, patrol_grace=5.0)
    gpus = Gpus(cfg, native_dir)
    gpus.open()
    uuid = gpus.devices[0].uuid
    table = JobTable(Store(tmp_path / "colo.db"))

    async def never(*_):
        raise AssertionError("nothing here is over its budget")

    async def run() -> None:  # the table tells its waiters on the daemon's loop
        patrol = Patrol(cfg, table, gpus, None, stop=never)
        j = table.add(JobSpec(argv=["x"], gpu_mem=GiB), 1000, 1000, "u").id
        table.transition(j, State.STARTING, "placed", gpus=[uuid])
        table.transition(j, State.RUNNING, "running")
        patrol.check(PatrolReport({j: {uuid: GiB}}, {j: {4242}}, [], {}), 100.0)
        assert gpus.unbudgeted == {}
        left = [{"gpu": uuid, "pid": 4242, "used": GiB, "uid": 1000}]
        # still running, the same pid outside its job is another matter: counted at once
        patrol.check(PatrolReport({}, {}, list(left), {uuid: GiB}), 101.0)
        assert gpus.unbudgeted == {uuid: GiB}
        table.transition(j, State.SUCCEEDED, "done")
        patrol.check(PatrolReport({}, {}, list(left), {uuid: GiB}), 104.0)
        assert gpus.unbudgeted == {} and patrol.foreign == []
        patrol.check(PatrolReport({}, {}, list(left), {uuid: GiB}), 106.0)  # 6 s after it was last seen in its job
        assert gpus.unbudgeted == {uuid: GiB} and [f["pid"] for f in patrol.foreign] == [4242]

    asyncio.run(run())
