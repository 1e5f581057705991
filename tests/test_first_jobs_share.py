"""Sharing from the first job (issue 30): on a fresh daemon, unprofiled light jobs of one family
(the same program, other arguments) all run at once: the first runs alone, its first samples make
a provisional profile, and its family is placed beside it while it runs, not after its end."""
from __future__ import annotations

import shutil

import pytest

from harness.daemon import DaemonProc, gpu_node, wait_for

GiB = 1024**3


@pytest.fixture
def big_node():
    root, state, _ = gpu_node("colo-first-", count=1, mem=80 * GiB)
    yield root, state
    shutil.rmtree(root, ignore_errors=True)


def test_three_light_unprofiled_jobs_of_a_family_end_up_running_at_once(big_node):
    root, state = big_node
    d = DaemonProc(root, state, {"unprofiled_share": False, "check_alone": True, "mps_idle_stop": 600.0}).start()  # the defaults, but check_alone (off by default since issue 39)
    try:
        native = next(d.state_dir.glob("native-*"))
        burn = str(native / "colo-burn")
        # a few GiB each, 10 % of the GPU's SMs: three new hyperparameters of one program
        ids = [d.submit("--process", "--gpu-mem", "4GiB", "--", burn, "--mem", "3GiB", "--duty", "10",
                        "--seconds", str(600 + k)) for k in range(3)]
        first = d.wait_state(ids[0], "running")
        # the others wait while the first has no profile, and say how to get past that
        wait_for(lambda: "ways out" in (d.job(ids[1])["reason"] or ""), 30, "the wait to name the ways out")
        assert d.job(ids[1])["state"] == d.job(ids[2])["state"] == "queued"
        # within its first minute the first one's samples speak for its family: the others start
        rows = wait_for(lambda: (r := [d.job(i) for i in ids]) and all(j["state"] == "running" for j in r) and r,
                        240, "all three jobs running at once")
        assert {j["gpus"][0] for j in rows} == {first["gpus"][0]}
        explained = d.cli("explain", str(ids[1]), check=True).stdout
        assert "provisional" in explained, explained
        log = d.log.read_text()
        assert f"job {ids[0]}: a provisional profile from its first" in log
    finally:
        d.stop()
