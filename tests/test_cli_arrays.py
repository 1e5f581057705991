"""Issue 16: job arrays (`--array`, as Slurm's) and choosing devices (`--gpu-id`, `--gpu-type`).
A real daemon on simulated GPUs and the real CLI."""
from __future__ import annotations

import json

from colo.sched import policy
from harness.daemon import wait_for

GiB = 1024**3


def _gated(gate) -> list[str]:
    """A process job that waits for `gate` to exist, then says which task it is."""
    return ["--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.1; done; "
            "echo $COLO_ARRAY_INDEX $COLO_ARRAY_JOB_ID $COLO_ARRAY_TASK_COUNT"]


def test_array_tasks_get_their_index_run_at_most_n_at_once_and_are_one_reference(daemon, tmp_path):
    gate = tmp_path / "go"
    arr = daemon.submit("--process", "--gpus", "0", "--array", "0-4:2,7%2", "--name", "sweep", *_gated(gate))
    rows = lambda: json.loads(daemon.cli("ls", str(arr), "--json", check=True).stdout)  # noqa: E731
    wait_for(lambda: sum(j["state"] == "running" for j in rows()) == 2, 60, "two tasks to run")
    jobs = rows()
    assert [(j["array_job"], j["array_index"]) for j in jobs] == [(arr, 0), (arr, 2), (arr, 4), (arr, 7)]
    assert [j["id"] for j in jobs] == list(range(arr, arr + 4))
    waiting = [j for j in jobs if j["state"] == "queued"]
    assert len(waiting) == 2  # %2: the others wait, and say why
    why = daemon.cli("explain", f"{arr}_{waiting[0]['array_index']}", check=True).stdout
    assert "at most 2 at once" in why, why
    table = daemon.cli("ls", "sweep", "-r", "-o", "id,array,state", check=True).stdout
    assert f"{arr}_7" in table and len(table.splitlines()) == 5, table
    # as squeue shows them, the queued tasks share a row unless -r
    table = daemon.cli("ls", "sweep", "-o", "id,array,state", check=True).stdout.splitlines()
    assert [ln.split() for ln in table[1:]] == [[str(arr), f"{arr}_0", "running"],
                                                [str(arr + 1), f"{arr}_2", "running"],
                                                [f"{arr}_[4,7]", f"{arr}_[4,7]", "queued"]], table
    gate.touch()
    r = daemon.cli("wait", "sweep", timeout=120)  # by name: every task
    assert r.returncode == 0 and r.stderr.count("succeeded") == 4, r.stderr
    outs = [daemon.cli("logs", f"{arr}_{i}", check=True).stdout for i in (0, 2, 4, 7)]
    assert outs == [f"{i} {arr} 4\n" for i in (0, 2, 4, 7)]
    shown = daemon.cli("show", str(arr + 3), check=True).stdout
    assert f"task {arr}_7 of array {arr} (4 tasks, at most 2 at once)" in shown, shown


def test_an_array_is_cancelled_and_waited_for_by_its_id_and_hostile_ranges_are_refused(daemon, tmp_path):
    before = len(daemon.client.ls(all=True))
    for bad, said in (("0-999999999", "index 999999999 is above"), ("0-100000", "more than 1000 tasks"),
                      ("0-999,1000-1999", "more than 1000 tasks"), ("5-1", "a range goes up"),
                      ("0-9%0", "%N needs"), ("a-b", "malformed --array"), ("1" * 300, "longer than 256")):
        r = daemon.cli("submit", "--process", "--gpus", "0", "--array", bad, "--", "true")
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and said in r.stderr, (bad, r.stderr)
    assert len(daemon.client.ls(all=True)) == before  # nothing stored
    arr = daemon.submit("--process", "--gpus", "0", "--array", "1,3,5", *_gated(tmp_path / "never"))
    wait_for(lambda: all(j["state"] == "running" for j in daemon.client.ls(all=False)), 60, "tasks to run")
    r = daemon.cli("cancel", str(arr), check=True)  # the array's id: every open task
    assert sorted(ln.split(":")[0] for ln in r.stdout.splitlines()) == [f"job {arr + i}" for i in range(3)], r.stdout
    r = daemon.cli("wait", str(arr), timeout=120)
    assert r.returncode != 0 and r.stderr.count(": cancelled") == 3, r.stderr
    one = daemon.submit("--process", "--gpus", "0", "--", "true")  # a job of no array: itself only
    assert daemon.cli("wait", str(one)).returncode == 0


def test_gpu_id_and_gpu_type_restrict_devices_and_explain_says_so(daemon, tmp_path):
    gpus = daemon.client.gpus()["gpus"]
    gate = tmp_path / "go"
    a = daemon.submit("--process", "--gpu-mem", "12GiB", "--gpu-id", "1", *_gated(gate))
    assert daemon.wait_state(a, "running")["gpus"] == [gpus[1]["uuid"]]
    # GPU0 is empty, but this job may use GPU1 only: it waits
    b = daemon.submit("--process", "--gpu-mem", "8GiB", "--gpu-id", "1", "--gpu-type", "simulated", *_gated(gate))
    why = wait_for(lambda: (t := daemon.cli("explain", str(b)).stdout) and "may use" in t and t, 30, "a reason")
    assert "among the GPUs it may use (--gpu-id 1 and --gpu-type 'simulated')" in why, why
    assert "may use:   GPU 1, GPUs named *simulated*" in daemon.cli("show", str(b), check=True).stdout
    for args, said in ((["--gpu-id", "5"], "--gpu-id 5 leaves 0 GPU(s) for a job of 1"),
                       (["--gpu-type", "A100"], "--gpu-type 'A100' leaves 0 GPU(s)"),
                       (["--gpu-id", "0", "--gpus", "2"], "--gpus 2 but --gpu-id allows only 1"),
                       (["--gpu-id", "x"], "malformed --gpu-id"),
                       (["--gpu-id", "0", "--gpus", "0"], "do not apply to a job with --gpus 0")):
        r = daemon.cli("submit", "--process", "--gpu-mem", "1GiB", *args, "--", "true")
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and said in r.stderr, (args, r.stderr)
    gate.touch()
    assert daemon.cli("wait", str(a), str(b), timeout=120).returncode == 0
    assert daemon.job(b)["gpus"] == [gpus[1]["uuid"]]


def test_plan_never_places_a_job_on_a_gpu_it_may_not_use():
    gpus = [policy.GpuView(f"u{i}", i, 16 * GiB, name=n) for i, n in enumerate(["Tesla T4", "NVIDIA A100", "A100"])]
    cands = [policy.Candidate(1, GiB, gpu_ids=(2,)), policy.Candidate(2, GiB, gpu_type="a100"),
             policy.Candidate(3, GiB, gpus=2, gpu_ids=(0, 1)), policy.Candidate(4, 20 * GiB, gpu_type="t4")]
    d = {x.job_id: x for x in policy.plan(cands, gpus, [], policy.PolicyConfig(unprofiled_share=True))}
    assert d[1].gpus == ("u2",) and d[2].gpus[0] in ("u1", "u2") and set(d[3].gpus) == {"u0", "u1"}
    assert d[4].action == policy.WAIT
    assert policy.gpu_filter_refusal((), "H100", 1, gpus).startswith("--gpu-type 'H100' leaves 0 GPU(s)")
    assert policy.gpu_filter_refusal((0, 1), None, 2, gpus) is None


def test_wait_follows_tasks_and_jobs_run_again_to_their_newest_copy(daemon, tmp_path):
    """`colo wait` ends when the work is done: a task (or job) run again by `colo requeue` is a copy
    with a new id, and the wait follows it, to the copy's end and exit code."""
    import subprocess

    ok, gate = tmp_path / "ok", tmp_path / "go"
    script = (f"case $COLO_ARRAY_INDEX in 1) [ -e {ok} ] || exit 7;; "
              f"2) while [ ! -e {gate} ]; do sleep 0.05; done;; esac")
    arr = daemon.submit("--process", "--gpus", "0", "--array", "0-2", "--", "sh", "-c", script)
    waiter = subprocess.Popen(daemon.cli_args("wait", str(arr)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=daemon.env())
    daemon.wait_state(arr + 1, "failed")
    daemon.wait_state(arr + 2, "running")
    ok.touch()
    again = int(daemon.cli("requeue", f"{arr}_1", check=True).stdout)  # the failed task, as a copy
    gate.touch()
    _, err = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err  # the copy's end, not the failed first run's exit 7
    assert f"job {arr + 1} (run again as job {again}): succeeded" in err, err
    assert daemon.job(again)["state"] == "succeeded" and daemon.job(arr + 1)["state"] == "failed"
    # a job that failed and was run again before the wait began: the wait is for its copy's end,
    # copies of copies followed
    bad = daemon.submit("--process", "--gpus", "0", "--", "sh", "-c", f"[ -e {tmp_path / 'never'} ] || exit 3")
    daemon.wait_state(bad, "failed")
    copy1 = int(daemon.cli("requeue", str(bad), check=True).stdout)
    daemon.wait_state(copy1, "failed")
    copy2 = int(daemon.cli("requeue", str(copy1), check=True).stdout)
    r = daemon.cli("wait", str(bad), timeout=120)
    assert r.returncode == 3 and r.stderr == f"job {bad} (run again as job {copy2}): failed ({daemon.job(copy2)['reason']})\n"
    (tmp_path / "never").touch()
    copy3 = int(daemon.cli("requeue", str(bad), check=True).stdout)  # the first run again, once more
    r = daemon.cli("wait", str(bad), "--json", timeout=120)
    assert r.returncode == 0 and [(j["id"], j["state"], j["waited_for"]) for j in json.loads(r.stdout)] == [
        (copy3, "succeeded", bad)]
