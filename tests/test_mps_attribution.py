"""Issue 13 item 5: a real driver may give MPS clients' SM activity to the MPS server's pid. The
simulated driver does either (COLO_FAKEGPU_MPS_ATTRIBUTION=client|server); colo apportions the
server's activity to its MPS jobs, so a job's samples and the profile learned from them are the
same under both."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from colo.node import fakegpu
from colo import profiles
from harness.daemon import DaemonProc, wait_for
from harness.node import SimNode

GiB, MiB = 1024**3, 1024**2

NVML_SAMPLES = """
import json, sys
from colo.node import fakegpu
fakegpu.use_fake_nvml(sys.argv[1])
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({s.pid: s.smUtil for s in n.nvmlDeviceGetProcessUtilization(h, 0)}))
"""


def nvml_samples(state: Path, env: dict) -> dict[int, int]:
    r = subprocess.run([sys.executable, "-c", NVML_SAMPLES, str(state)], capture_output=True, text=True,
                       env=env, check=True)
    return {int(k): v for k, v in json.loads(r.stdout).items()}


pytestmark = pytest.mark.node("colo-attr-", profiles={"solo": dict(sm=0.3, mem=256 * MiB, membw=0.2, runtime=4.0)},
                              then=SimNode.parts)


@pytest.mark.parametrize("attribution", ["client", "server"])
def test_mps_job_is_sampled_and_learned_alike_whoever_nvml_names(node, attribution):
    root, state, prof = node
    (root / "d").mkdir(mode=0o755)
    env = {"COLO_FAKEGPU_MPS_ATTRIBUTION": attribution}
    d = DaemonProc(root / "d", state, {"profile_dirs": [str(prof)], "mps_idle_stop": 600.0}, env=env).start()
    try:
        burn = str(next(d.state_dir.glob("native-*")) / "colo-burn")
        gate = root / "go"  # the job runs 3 s at least (samples to learn from), and until the test has looked
        j = d.submit("--process", "--gpu-mem", "1GiB", "--profile", "solo", "--", "sh", "-c",
                     f"{burn} --mem 256MiB --duty 60 --seconds 600 --quiet & b=$!; sleep 3; "
                     f"while [ ! -e {gate} ]; do sleep 0.05; done; kill $b; wait $b; exit 0")
        assert d.wait_state(j, "running", timeout=60)["mode"] == "mps"  # alone, as the server's only client
        procs = wait_for(lambda: (ps := fakegpu.FakeNode(state).read()["devices"][0]["processes"])
                         and any(p["kind"] == "mps_client" and p["sm"] for p in ps) and ps, 30, "the MPS client busy")
        client = next(p for p in procs if p["kind"] == "mps_client")  # the truth: its activity (MPS thread cap included)
        server = next(p["pid"] for p in procs if p["kind"] == "mps_server")
        truth = client["sm"]
        seen = nvml_samples(state, {**os.environ, **fakegpu.FakeNode(state).env, **env})
        if attribution == "server":  # what NVML says: the server did the work
            assert client["pid"] not in seen and seen[server] == truth, seen
        else:
            assert seen[client["pid"]] == truth and seen.get(server, 0) == 0, seen
            # the state file's switch (colo-fakegpu mps-attribution), which the variable overrides
            fakegpu.FakeNode(state).set_mps_attribution("server")
            plain = {k: v for k, v in os.environ.items() if k != "COLO_FAKEGPU_MPS_ATTRIBUTION"}
            assert nvml_samples(state, {**plain, **fakegpu.FakeNode(state).env})[server] == truth
            assert nvml_samples(state, {**plain, **fakegpu.FakeNode(state).env, **env})[client["pid"]] == truth
            fakegpu.FakeNode(state).set_mps_attribution("client")
        # colo's sample of the job is its own activity either way
        wait_for(lambda: d.job(j).get("sm_util") == truth, 30, f"the job's SM sample to be {truth} %")
        gate.touch()
        d.wait_state(j, "succeeded", timeout=60)
        own = d.state_dir / "profiles" / "users" / "0" / "solo.profile"
        learned = wait_for(lambda: own.exists() and (p := profiles.load(own)).runs == 2 and p, 30, "the run learned")
        # the mean of the stored 30 % and this run's own (not 0 %: the server's samples went to the job)
        assert abs(learned.mean_sm - (0.3 + truth / 100) / 2) < 0.06, (learned.mean_sm, truth)
    finally:
        d.stop()



def test_server_activity_is_split_equally_among_that_gpus_mps_jobs():
    from colo.daemon.learner import mps_server_shares

    per_gpu = {"GPU-a": {10: (60, 30), 77: (20, 10)}, "GPU-b": {11: (0, 0)}}  # 10, 11: colo's servers
    got = mps_server_shares(per_gpu, {10, 11}, {1: ("GPU-a",), 2: ("GPU-a",), 3: ("GPU-b",)})
    assert got == {1: (30.0, 15.0), 2: (30.0, 15.0)}  # 77 (a time-sliced job's own pid) is not shared out
    assert mps_server_shares({"GPU-a": {77: (20, 10)}}, {10}, {1: ("GPU-a",)}) == {}  # per-client attribution
