"""Sharing from the first job (issue 30): on a fresh daemon, unprofiled light jobs of one family
(the same program, other arguments) all run at once: the first runs alone, its first samples make
a provisional profile, and its family is placed beside it while it runs, not after its end."""
from __future__ import annotations

import os
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


def test_a_gpu_that_frees_goes_to_a_family_with_none_running_before_a_second_of_one_that_runs(tmp_path):
    """Two GPUs, each taken by a blocker; queued behind them, two jobs of one family and one of
    another, none profiled. The first GPU freed takes the first of the family; the second goes to
    the other family's job, not to the second of the first family, which joins its first once a
    provisional profile speaks for them (here never: its first computes nothing)."""
    root, state, _ = gpu_node("colo-kin-", count=2, mem=40 * GiB)
    d = DaemonProc(root, state, {"unprofiled_share": False}).start()  # the default
    try:
        burn = str(next(d.state_dir.glob("native-*")) / "colo-burn")
        other = root / "other-solver"  # another program: another family
        shutil.copy(burn, other)
        os.chmod(root / "other-solver", 0o755)
        block = [d.submit("--process", "--gpu-mem", "30GiB", "--", "/bin/sleep", str(3600 + k)) for k in range(2)]
        gpus = {d.wait_state(b, "running")["gpus"][0] for b in block}
        assert len(gpus) == 2
        idle = ["--duty", "0", "--mem", "1GiB", "--seconds"]
        a1, a2 = (d.submit("--process", "--gpu-mem", "12GiB", "--", burn, *idle, str(3600 + k)) for k in range(2))
        b1 = d.submit("--process", "--gpu-mem", "12GiB", "--", str(other), *idle, "3600")
        d.cli("cancel", str(block[0]), check=True)
        first = d.wait_state(a1, "running")["gpus"][0]
        assert d.job(a2)["state"] == d.job(b1)["state"] == "queued"
        d.cli("cancel", str(block[1]), check=True)
        assert d.wait_state(b1, "running")["gpus"][0] == (gpus - {first}).pop()
        assert d.job(a2)["state"] == "queued", d.job(a2)
    finally:
        d.stop()
