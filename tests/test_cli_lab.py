"""Issue 36: what pueue, Slurm and nvitop users still reached for. A real daemon on simulated GPUs,
the real CLI; another user is a real Unix user (a forked child that setuid, see harness.daemon.as_user).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from colo.cli.app import app
from colo.client import Client, ClientError
from harness.daemon import DaemonProc, as_user, wait_for

GiB = 1024**3


@pytest.fixture
def lab(shared_daemon):
    """A daemon other users can reach (conftest's), in a folder they can reach."""
    yield shared_daemon
    (shared_daemon.root / "go").touch()  # the gated jobs end as the daemon stops


def gated(d: DaemonProc, *before: str) -> list[str]:
    """submit arguments of a CPU job that runs until the test's gate appears."""
    return [*before, "--process", "--gpus", "0", "--", "sh", "-c",
            f"while [ ! -e {d.root / 'go'} ]; do sleep 0.05; done"]


def counting(d: DaemonProc, out: Path) -> list[str]:
    """A job that writes a growing count to `out` until the gate appears (a frozen one stops)."""
    return ["sh", "-c", f"i=0; while [ ! -e {d.root / 'go'} ]; do i=$((i+1)); echo $i > {out}; sleep 0.02; done"]


def spec_of(d: DaemonProc, job: int) -> dict:
    return d.client.show(job)["spec"]


def test_after_reads_job_refs_strictly_and_show_prints_dependencies(daemon):
    d, c = daemon, daemon.client
    first = d.submit("--process", "--gpus", "0", "--", "true")
    arr = d.submit(*gated(d, "--array", "0-2", "--name", "sweep"))
    assert arr == first + 1
    while c.submit({"argv": ["true"], "gpus": 0, "workdir": "/tmp"})["id"] < 31:  # job 31 exists, and ends well
        pass
    d.wait_state(31, "succeeded")
    task = d.submit("--process", "--gpus", "0", "--after", f"{arr}_1", "--", "true")
    assert spec_of(d, task)["after"] == [arr + 1]  # task 1 of the array, never job 31 (int("2_1") == 21)
    assert "waiting for job" in d.cli("explain", str(task), check=True).stdout
    whole = d.submit("--process", "--gpus", "0", "--after-any", str(arr), "--", "true")
    assert spec_of(d, whole)["after_any"] == [arr, arr + 1, arr + 2]  # an array's id: all its tasks (afterany)
    named = d.submit("--process", "--gpus", "0", "--after", "sweep", "--", "true")
    assert spec_of(d, named)["after"] == [arr, arr + 1, arr + 2]
    shown = d.cli("show", str(named), check=True).stdout
    assert f"--after:   {arr} (running), {arr + 1} (running), {arr + 2} (running): starts once it succeeded" in shown, shown
    for bad, said in [("2 1", "malformed job"), ("nosuch", "no job of yours is named"), (f"{arr}_9", "no such task")]:
        r = d.cli("submit", "--process", "--gpus", "0", "--after", bad, "--", "true")
        assert r.returncode == 1 and said in r.stderr and r.stderr.count("\n") == 1, (bad, r.stderr)
    # a client that sends 2_1 itself is read the same way; an id of no job is refused
    assert c.submit({"argv": ["true"], "gpus": 0, "workdir": "/tmp", "after": [f"{arr}_2"]})["id"]
    with pytest.raises(ClientError, match="no such job"):
        c.submit({"argv": ["true"], "gpus": 0, "workdir": "/tmp", "after": ["999999"]})
    (d.root / "go").touch()
    for j in (task, whole, named):
        d.wait_state(j, "succeeded")


def test_pause_freezes_a_job_whole_and_resume_thaws_it(lab, other_user):
    d = lab
    count = d.root / "count"
    job = d.submit("--process", "--gpu-mem", "1GiB", "--name", "counter", "--", *counting(d, count))
    wait_for(lambda: count.exists() and count.read_text().strip(), 30, "the job to count")
    # another user may not pause, resume or signal it
    for op in ("pause", "resume"):
        kind, why = as_user(other_user, lambda op=op: getattr(Client(d.socket), op)(job))
        assert kind == "err" and why[2] == "forbidden" and f"belongs to root; you may not {op}" in why[1], why
    kind, why = as_user(other_user, lambda: Client(d.socket).signal(job, "SIGINT"))
    assert kind == "err" and why[2] == "forbidden", why
    r = d.cli("pause", "counter", check=True)
    assert r.stdout == f"job {job}: paused (colo resume {job})\n"
    frozen = count.read_text()
    time.sleep(0.5)
    assert count.read_text() == frozen  # no process of it ran meanwhile
    row = d.cli("ls", "-o", "id,state,reason", check=True).stdout.splitlines()[1].split(None, 2)
    assert row == [str(job), "paused", f"paused by root (colo resume {job})"], row
    assert "paused by root" in d.cli("show", str(job), check=True).stdout
    assert d.job(job)["budget"] == GiB and [job] in [g["jobs"] for g in d.client.gpus()["gpus"]]  # it keeps its budget
    d.cli("resume", str(job), check=True)
    wait_for(lambda: count.read_text() != frozen, 60, "the job to count again")
    assert d.job(job)["paused_by"] is None
    r = d.cli("resume", str(job))
    assert r.returncode == 1 and f"job {job} is not paused" in r.stderr
    # a paused job is stopped when cancelled (thawed first: SIGTERM reaches it)
    d.cli("pause", str(job), check=True)
    d.cli("cancel", str(job), check=True)
    assert d.wait_state(job, "cancelled")["exit_code"] == 143
    r = d.cli("pause", str(job))
    assert r.returncode == 1 and "only a running job can be paused" in r.stderr


def test_cancel_s_sends_a_signal_and_the_job_runs_on(lab, other_user):
    d = lab
    job = d.submit("--process", "--gpus", "0", "--", "sh", "-c",
                   f"trap 'echo got usr1' USR1; echo ready; while [ ! -e {d.root / 'go'} ]; do sleep 0.05; done; echo done")
    wait_for(lambda: "ready" in d.cli("logs", str(job)).stdout, 60, "the job to set its trap")
    assert d.cli("cancel", "-s", "USR1", str(job), check=True).stdout == f"job {job}: sent SIGUSR1\n"
    wait_for(lambda: "got usr1" in d.cli("logs", str(job)).stdout, 60, "the job to get SIGUSR1")
    assert d.job(job)["state"] == "running" and not d.job(job)["cancel_by"]
    for bad, said in [("queued", "for jobs in a state use -t/--state queued"),
                      ("SIGBOGUS", "colo sends a job HUP, INT, QUIT, USR1, USR2 or TERM")]:
        r = d.cli("cancel", "-s", bad, str(job))
        assert r.returncode == 1 and said in r.stderr and r.stderr.count("\n") == 1, r.stderr
    queued = d.submit(*gated(d, "--after", str(job)))
    r = d.cli("cancel", "-s", "INT", str(queued))
    assert r.returncode == 1 and "only a running job can be signalled" in r.stderr
    assert d.cli("cancel", "-t", "queued", "--all", check=True).stdout == f"job {queued}: cancelled\n"
    (d.root / "go").touch()
    assert d.wait_state(job, "succeeded")["exit_code"] == 0


def test_hold_at_submit_and_a_delayed_start(daemon):
    d = daemon
    held = d.submit("--process", "--gpus", "0", "--hold", "--", "true")
    assert d.job(held)["held_by"] == "root" and "held by root" in d.cli("explain", str(held), check=True).stdout
    later = d.submit("--process", "--gpus", "0", "--delay", "2s", "--", "true")
    begin = spec_of(d, later)["begin"]
    assert "waiting for its start time" in d.cli("explain", str(later), check=True).stdout
    job = d.wait_state(later, "succeeded")
    assert job["started_at"] >= begin  # not before it was asked to
    d.cli("release", str(held), check=True)
    d.wait_state(held, "succeeded")
    soon = d.submit("--process", "--gpus", "0", "--begin", "now+1s", "--", "true")
    d.wait_state(soon, "succeeded")
    for args, said in [(["--delay", "soon"], "malformed --delay"), (["--begin", "25:00"], "malformed --begin"),
                       (["--begin", "now", "--delay", "1m"], "give one")]:
        r = d.cli("submit", "--process", "--gpus", "0", *args, "--", "true")
        assert r.returncode == 1 and said in r.stderr, r.stderr


def test_output_files_are_written_as_the_user_and_never_through_their_symlinks(lab, other_user):
    d = lab
    mine = d.root / "mine"
    mine.mkdir()
    os.chown(mine, other_user.pw_uid, other_user.pw_gid)
    spec = {"argv": ["sh", "-c", "echo out; echo err >&2"], "gpus": 0, "workdir": "/tmp",
            "output": f"{mine}/o-%j.txt", "error": f"{mine}/e-%x-%u.txt", "name": "two"}

    def submit(**changes):
        kind, got = as_user(other_user, lambda: Client(d.socket).submit({**spec, **changes})["id"])
        assert kind == "ok", got
        return got

    job = submit()
    d.wait_state(job, "succeeded")
    out, err = mine / f"o-{job}.txt", mine / f"e-two-{other_user.pw_name}.txt"
    assert out.read_text() == "out\n" and err.read_text() == "err\n"
    assert out.stat().st_uid == err.stat().st_uid == other_user.pw_uid  # made by the user, not by root
    assert "out" in d.cli("logs", str(job), check=True).stdout  # colo logs has both as before
    # a folder the user may not write: the job fails before it runs, with the reason
    locked = d.root / "locked"
    locked.mkdir(mode=0o755)
    job = submit(output=f"{locked}/o.txt", error=None)
    failed = d.wait_state(job, "failed")
    assert "cannot open --output" in failed["reason"] and "Permission denied" in failed["reason"], failed
    assert not (locked / "o.txt").exists()
    # a symlink another user (here root) planted where the output goes: not followed
    victim = mine / "precious"
    victim.write_text("keep me\n")
    os.chown(victim, other_user.pw_uid, other_user.pw_gid)
    trap = d.root / "trap"
    trap.mkdir(mode=0o1777)
    (trap / "o.txt").symlink_to(victim)
    job = submit(output=f"{trap}/o.txt", error=None)
    failed = d.wait_state(job, "failed")
    assert "symbolic link" in failed["reason"], failed
    assert victim.read_text() == "keep me\n"
    # the CLI: relative to the workdir, only for process jobs
    r = d.cli("submit", "--process", "--gpus", "0", "--workdir", str(mine), "-o", "cli-%j.out", "--", "echo", "hi")
    job = int(r.stdout)
    d.wait_state(job, "succeeded")
    assert (mine / f"cli-{job}.out").read_text() == "hi\n"
    r = d.cli("submit", "--image", "x:1", "--gpus", "0", "-o", "/tmp/x", "--", "true")
    assert r.returncode == 1 and "for process jobs" in r.stderr
    r = d.cli("submit", "--process", "--gpus", "0", "-o", "/tmp/%q", "--", "true")
    assert r.returncode == 1 and "'%q' is not a replacement colo makes" in r.stderr


def test_on_end_runs_as_the_owner_with_how_the_job_ended(lab, other_user):
    d = lab
    mine = d.root / "ends"
    mine.mkdir()
    os.chown(mine, other_user.pw_uid, other_user.pw_gid)
    spec = {"argv": ["sh", "-c", "exit 3"], "gpus": 0, "workdir": str(mine), "name": "fails",
            # renamed once written: a redirect's file exists before its text (a busy machine's gap)
            "on_end": 'echo "$COLO_JOB_ID $COLO_JOB_NAME $COLO_JOB_STATE $COLO_JOB_EXIT $(id -u)" > told.part; '
                      'mv told.part told; echo said'}
    kind, job = as_user(other_user, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", job
    d.wait_state(job, "failed")
    told = mine / "told"
    wait_for(told.exists, 60, "the --on-end command")
    assert told.read_text() == f"{job} fails failed 3 {other_user.pw_uid}\n"  # as the owner, never root
    assert told.stat().st_uid == other_user.pw_uid
    wait_for(lambda: "said" in d.cli("logs", str(job)).stdout, 60, "its output in the job's log")
    assert "[colo: --on-end:" in d.cli("logs", str(job)).stdout
    r = d.cli("submit", "--process", "--gpus", "0", "--mail-type", "END", "--", "true")
    assert r.returncode == 1 and "no mail transfer agent" in r.stderr and "--on-end" in r.stderr, r.stderr


def test_small_ones(daemon, tmp_path):
    d = daemon
    # submit --wait --json: how the job ended
    r = d.cli("submit", "--wait", "--json", "--process", "--gpus", "0", "--", "sh", "-c", "exit 4")
    ended = json.loads(r.stdout)
    assert r.returncode == 4 and ended["state"] == "failed" and ended["exit_code"] == 4, r.stdout
    # ls and show name GPUs by index; a job alone on its GPU is "exclusive"
    job = d.submit("--process", "--gpu-mem", "1GiB", "--gpu-id", "1", "--", "sh", "-c",
                   f"while [ ! -e {d.root / 'go'} ]; do sleep 0.05; done")
    d.wait_state(job, "running")
    row = d.cli("ls", "-o", "id,gpu,mode", check=True).stdout.splitlines()[1].split()
    assert row == [str(job), "1", "exclusive"], row
    assert "gpus:      1   mode: exclusive" in d.cli("show", str(job), check=True).stdout
    # history --format, as ls -o
    out = d.cli("history", "-o", "id,state,exit", check=True).stdout.splitlines()
    assert out[0].split() == ["ID", "STATE", "EXIT"] and out[1].split() == [str(ended["id"]), "failed", "4"], out
    r = d.cli("history", "-o", "id,bogus")
    assert r.returncode == 1 and "unknown column 'bogus'" in r.stderr
    # top: the running jobs, and only the last few that ended
    for _ in range(7):
        d.client.submit({"argv": ["true"], "gpus": 0, "workdir": "/tmp"})
    wait_for(lambda: len(d.client.ls(states=["succeeded"])) >= 7, 60, "the jobs to end")
    snap = d.client.top()
    assert [j["id"] for j in snap["jobs"] if j["state"] == "running"] == [job]
    assert len([j for j in snap["jobs"] if j["state"] in ("succeeded", "failed")]) == 5, snap["jobs"]  # of 8
    (d.root / "go").touch()
    d.wait_state(job, "succeeded")


def test_an_arrays_limit_is_said_of_its_running_tasks(daemon):
    """Two tasks of a %2 array waiting for memory made the others say '2 task(s) of array A run'."""
    d = daemon
    hogs = [d.submit("--process", "--gpu-mem", "16GiB", "--", "sh", "-c",
                     f"while [ ! -e {d.root / 'go'} ]; do sleep 0.05; done") for _ in range(2)]
    for h in hogs:
        d.wait_state(h, "running")
    arr = d.submit("--process", "--gpu-mem", "1GiB", "--array", "0-3%2", "--", "true")
    why = wait_for(lambda: "waiting for its array" in (r := (d.client.explain(arr + 2)["decision"] or {}).get(
        "reason") or "") and r, 30, "a decision for the third task")
    assert why.startswith(f"waiting for its array: 0 task(s) of array {arr} run and 2 before it may start now"), why
    assert "waiting for memory" in d.client.explain(arr)["decision"]["reason"]
    (d.root / "go").touch()


def test_ctrl_c_on_follow_says_the_job_runs_on(daemon):
    d = daemon
    p = subprocess.Popen([sys.executable, "-m", "colo", "submit", "--follow", "--process", "--gpus", "0", "--",
                          "sh", "-c", f"echo started; while [ ! -e {d.root / 'go'} ]; do sleep 0.05; done"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=d.env())
    job = int(p.stdout.readline())
    assert p.stdout.readline() == "started\n"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert f"job {job} still runs (colo cancel {job} stops it" in err, err
    assert d.job(job)["state"] == "running"
    (d.root / "go").touch()
    d.wait_state(job, "succeeded")


def test_requeue_of_an_array_reruns_its_ended_tasks(daemon):
    d = daemon
    arr = d.submit("--process", "--gpus", "0", "--array", "0-2", "--", "sh", "-c", 'exit "$COLO_ARRAY_INDEX"')
    for j in range(arr, arr + 3):
        d.wait_state(j, "succeeded", "failed")
    new = [int(x) for x in d.cli("requeue", str(arr), check=True).stdout.split()]
    assert len(new) == 3 and all(i > arr + 2 for i in new)
    copies = [d.job(i) for i in new]
    assert sorted((j["array_job"], j["array_index"]) for j in copies) == [(arr, 0), (arr, 1), (arr, 2)]
    r = d.cli("wait", str(arr))  # the array's tasks are their newest runs
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 3, r.stderr


def test_completion_offers_job_ids_and_names_without_typer(daemon):
    d = daemon
    a = d.submit("--process", "--gpus", "0", "--name", "trainer", "--", "true")
    b = d.submit(*gated(d, "--name", "tester"))
    d.wait_state(a, "succeeded")
    probe = ("import os, sys\nsys.argv = ['colo']\nfrom colo.cli.entry import main\ntry:\n    main()\n"
             "except SystemExit:\n    pass\nprint('typer' in sys.modules, file=sys.stderr)\n")

    def complete(words: str, **env):
        e = {**d.env(), "_COLO_COMPLETE": "complete_bash", "COMP_WORDS": words,
             "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)), **env}
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=e, timeout=60)
        return r.stdout.split(), r.stderr.strip()

    assert complete("colo show ") == ([str(a), str(b), "tester", "trainer"], "False")
    assert complete("colo cancel t") == (["tester"], "False")  # open jobs only
    assert complete("colo submit --after tr") == (["trainer"], "False")
    words, typer_loaded = complete("colo ls --st")  # an option's name: typer's own completion
    assert "--state" in words and typer_loaded == "True"
    (d.root / "go").touch()


def test_help_lists_each_command_on_one_line():
    from colo.cli.options import COMMANDS

    out = CliRunner().invoke(app, ["--help"], terminal_width=200, env={"COLUMNS": "200"}).output
    for cmd in COMMANDS:
        assert "\n" not in cmd.summary and len(cmd.summary) < 100, cmd.name
        line = next(ln for ln in out.splitlines() if f" {cmd.name} " in ln)
        assert cmd.summary in line, (cmd.name, line)


def test_an_mps_client_is_neither_paused_nor_killed_by_a_signal(native_dir):
    from colo import profiles
    from harness.daemon import gpu_node

    root, state, prof = gpu_node("colo-lab-mps-")
    p = profiles.from_samples("solo", {"times": list(range(20)), "sm": [0.3] * 20, "mem": [256 << 20] * 20,
                                       "membw": [0.2] * 20}, runtime=4.0, cache_bound=False)
    profiles.save(p, prof / "solo.profile")
    (root / "d").mkdir(mode=0o755)
    d = DaemonProc(root / "d", state, {"profile_dirs": [str(prof)]}).start()
    try:
        job = d.submit("--process", "--gpu-mem", "1GiB", "--profile", "solo", "--", "sh", "-c",
                       f"while [ ! -e {root / 'go'} ]; do sleep 0.05; done")
        assert d.wait_state(job, "running", timeout=60)["mode"] == "mps"
        r = d.cli("pause", str(job))
        assert r.returncode == 1 and "does not pause MPS clients" in r.stderr and r.stderr.count("\n") == 1, r.stderr
        for sig in ("KILL", "STOP", "9"):  # never: an MPS client is stopped with terminate_client first
            r = d.cli("cancel", "-s", sig, str(job))
            assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
            assert "colo sends a job HUP, INT, QUIT, USR1, USR2 or TERM" in r.stderr or "signal must be one of" in r.stderr
        assert d.job(job)["state"] == "running" and d.job(job)["paused_by"] is None
    finally:
        (root / "go").touch()
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.docker
def test_a_container_is_paused_with_docker_pause(daemon, test_image, docker_client):
    d = daemon
    job = d.submit("--image", test_image, "--gpus", "0", "--", "sh", "-c",
                   "trap 'echo got int' INT; echo ready; while true; do sleep 0.05; done")
    d.wait_state(job, "running", timeout=60)
    wait_for(lambda: "ready" in d.cli("logs", str(job)).stdout, 60, "the container to set its trap")
    from colo.daemon.engines import instance_id
    from colo.runtimes.docker import LABEL_INSTANCE, LABEL_JOB

    mine = {LABEL_JOB: str(job), LABEL_INSTANCE: instance_id(d.state_dir)}  # the host's engine has others' too
    container = next(c for c in docker_client.containers.list() if mine.items() <= c.labels.items())
    d.cli("pause", str(job), check=True)
    container.reload()
    assert container.attrs["State"]["Paused"] is True
    d.cli("resume", str(job), check=True)
    container.reload()
    assert container.attrs["State"]["Paused"] is False
    d.cli("cancel", "-s", "INT", str(job), check=True)
    wait_for(lambda: "got int" in d.cli("logs", str(job)).stdout, 20, "the container's main process to get SIGINT")
    d.cli("pause", str(job), check=True)
    d.cli("cancel", str(job), check=True)  # thawed, then stopped
    d.wait_state(job, "cancelled", timeout=60)
