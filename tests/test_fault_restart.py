"""A daemon that dies (SIGKILL) while it stops an attempt an MPS fault requeued: the store says
"queued" and knows nothing of that attempt any more, yet its processes may run on in job-<ID>.
The restarted daemon must end them before the job starts again."""
from __future__ import annotations

import os
import subprocess

import psutil
import pytest

from colo.node import fakegpu
from harness.daemon import DaemonProc, wait_for
from harness.node import SimNode


pytestmark = pytest.mark.node("colo-faultrs-", profiles={"light": dict(sm=0.3, mem=512 * 1024**2, membw=0.2,
                                                                         runtime=600, n=30)}, then=SimNode.parts)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tree(d: DaemonProc, job_id: int) -> list[psutil.Process]:
    """The job's shim and its processes (the handle is "SHIM_PID:START_TIME")."""
    import sqlite3

    db = sqlite3.connect(d.state_dir / "colo.db")
    (handle,) = db.execute("SELECT handle FROM jobs WHERE id=?", (job_id,)).fetchone()
    db.close()
    shim = psutil.Process(int(handle.split(":")[0]))
    return [shim, *shim.children(recursive=True)]


def test_daemon_killed_while_stopping_a_faulted_attempt_ends_it_before_starting_the_job_again(node):
    root, state, prof = node
    home = root / "d"
    home.mkdir(mode=0o755)
    # a long grace: the daemon is still in the stop (SIGTERM sent, SIGKILL not yet) when it dies
    d = DaemonProc(home, state, {"profile_dirs": [str(prof)], "mps_idle_stop": 600.0, "stop_grace": 600.0}).start()
    burn = str(next(d.state_dir.glob("native-*")) / "colo-burn")
    mark = root / "second"
    # attempt 1 is an MPS client, then outlives SIGTERM (as a job with slow cleanup would);
    # attempt 2 (it finds the mark) just runs
    script = (f'if [ -e {mark} ]; then exec {burn} --duty 30 --seconds 600; fi; touch {mark}; '
              f'trap "" TERM; {burn} --duty 30 --seconds 600; exec sleep 600')
    old: list[psutil.Process] = []
    failed: list[psutil.Process] = []
    try:
        j = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", "--retries", "1", "--", "sh", "-c", script)
        # a client of the same server that fails (no retries): nothing of it may run on either
        k = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "light", "--", "sh", "-c",
                     f'trap "" TERM; {burn} --duty 30 --seconds 600; exec sleep 600')
        kinds = lambda: {p["pid"]: p["kind"] for p in fakegpu.FakeNode(state).read()["devices"][0]["processes"]}
        for x in (j, k):
            d.wait_state(x, "running", timeout=60)
            wait_for(lambda: any(kinds().get(p.pid) == "mps_client" for p in _tree(d, x)), 60,
                     "the jobs to be MPS clients")
        old, failed = _tree(d, j), _tree(d, k)
        burners = [p for p in old + failed if p.name() == "colo-burn"]
        pipe = next((d.state_dir / "mps").glob("*/pipe"))
        env = {**os.environ, **fakegpu.FakeNode(state).env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
        ctl = str(fakegpu.FakeNode(state).mps_control)
        server = subprocess.run([ctl], input="get_server_list\n", capture_output=True, text=True, env=env).stdout.split()[0]
        subprocess.run([ctl], input=f"fake_fault {server}\n", capture_output=True, text=True, env=env, check=True)
        wait_for(lambda: (x := d.job(j))["state"] == "queued" and "requeued" in x["events"][-1]["reason"], 60,
                 "the requeue")
        d.wait_state(k, "failed", timeout=60)
        # the stop has begun (the requeue comes first, the stop right after it): SIGTERM has
        # ended attempt 1's MPS client, not its shell
        wait_for(lambda: not any(_alive(p) for p in burners), 60, "SIGTERM to reach attempt 1")
        d.kill9()
        assert any(_alive(p) for p in old[1:]) and any(_alive(p) for p in failed[1:])  # what the dead daemon's stop left
        d.start()
        wait_for(lambda: (x := d.job(j))["attempts"] == 2 and x["state"] == "running", 120, "attempt 2 to run")
        # nothing of attempt 1 runs beside attempt 2 (in its cgroup job-<ID>, holding GPU memory)
        assert [p.pid for p in old if _alive(p)] == []
        wait_for(lambda: not any(_alive(p) for p in failed), 60, "the failed job's processes to be ended")
        # and attempt 2 is its own: it ends by its cancel, not by attempt 1's shim emptying job-<ID>
        d.cli("cancel", str(j), check=True)
        job = d.wait_state(j, "cancelled", timeout=60)
        assert job["reason"].startswith("cancelled by"), job["reason"]
    finally:
        d.stop()
        for p in old + failed:  # on a failure: attempt 1 must not outlive the test
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
