"""Issue 16: what a lab user gets wrong answers to, and the commands they reach for (pueue,
Slurm, docker, gh conventions). A real daemon on simulated GPUs, the real CLI; other users are
real Unix users (forked children that setuid, as the interpreter here is not readable to them).
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from contextlib import redirect_stdout

import pytest
from typer.testing import CliRunner

import colo.cli.doctor  # noqa: F401 - loaded before a child drops to another uid
from colo.cli.app import app
from colo.client import Client, ClientError
from harness.daemon import DaemonProc, as_user, invoke_as, wait_for

GiB = 1024**3


# `shared`: a daemon other users can reach, with colo's default reserve and a long grace period (at
# the end its gated jobs are let end by themselves: reachable_daemon makes their `go`).
pytestmark = pytest.mark.shared("colo-cli-", {"reserve": "256MiB", "stop_grace": 60.0})



def test_wait_reports_every_failing_job(daemon):
    a = daemon.submit("--process", "--gpus", "0", "--", "sh", "-c", "exit 3")
    b = daemon.submit("--process", "--gpus", "0", "--", "true")
    c = daemon.submit("--process", "--gpus", "0", "--", "sh", "-c", "exit 5")
    r = daemon.cli("wait", str(c), str(b), str(a))
    assert r.returncode == 5  # the first non-zero in the order given
    lines = r.stderr.splitlines()
    assert [ln.split(":")[0] for ln in lines] == [f"job {c}", f"job {b}", f"job {a}"], r.stderr
    assert "failed" in lines[0] and "code 5" in lines[0] and "succeeded" in lines[1] and "code 3" in lines[2]


def test_usable_memory_is_exact_and_a_too_big_budget_says_usable_vs_asked(shared):
    gpus = shared.cli("gpus", check=True).stdout
    assert "0 / 15.75GiB" in gpus, gpus
    r = shared.cli("submit", "--process", "--gpu-mem", "16GiB", "--", "true")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "--gpu-mem 16GiB" in r.stderr and "15.75GiB is usable" in r.stderr and "256MiB" in r.stderr, r.stderr
    j = shared.submit("--process", "--gpu-mem", "15.75GiB", "--", "true")  # exactly what is usable fits
    shared.wait_state(j, "succeeded")


def test_bytes_that_are_not_utf8_are_refused_with_a_clear_line(daemon):
    r = subprocess.run([sys.executable.encode(), b"-m", b"colo", b"submit", b"--process", b"--gpus", b"0", b"--",
                        b"printf", b"\xff\xfe"], capture_output=True, env=daemon.env(), timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 1 and err.count("\n") == 1 and "not UTF-8" in err and "word 2 of the command" in err, err
    assert "\\xff\\xfe" in err
    # a client that sends them anyway (JSON \udcff escapes) is refused by the daemon too
    with pytest.raises(ClientError, match="not UTF-8"):
        daemon.client.submit({"argv": ["printf", "\udcff\udcfe"], "gpus": 0, "workdir": "/tmp"})
    assert daemon.client.ls() == []  # nothing stored


def test_doctor_as_a_user_asks_the_daemon_about_docker(shared, other_user, docker_client):
    # the user cannot reach root's Docker socket; the daemon can, and runs their container jobs
    def doctor():
        out = io.StringIO()
        with redirect_stdout(out):
            colo.cli.doctor.run_checks(shared.socket)
        return out.getvalue()

    kind, out = as_user(other_user, doctor)
    assert kind == "ok", out
    docker = next(ln for ln in out.splitlines() if ln.split()[1] == "docker")
    assert docker.startswith("ok") and "container jobs can run" in docker, out
    assert f"you are {other_user.pw_name}" in out


def test_cancel_of_several_returns_at_once_and_says_which_came_first(shared, other_user):
    d = shared
    gate = d.root / "go"
    # each ignores SIGTERM and ends with code 0 when the gate appears: the grace is 60 s here
    stubborn = ["--process", "--gpus", "0", "--", "sh", "-c",
                f"trap '' TERM; echo started; while [ ! -e {gate} ]; do sleep 0.05; done; exit 0"]
    ids = [d.submit("--name", f"sweep-{i}", *stubborn) for i in range(3)]
    for j in ids:
        wait_for(lambda: "started" in d.cli("logs", str(j)).stdout, 30, "the job to start")
    r = d.cli("cancel", "--name", "sweep-0", "--name", "sweep-1", "--name", "sweep-2", check=True)
    assert r.stdout.splitlines() == [f"job {j}: stopping" for j in ids], r.stdout
    # it returned while all three are still in their grace period: their stops run side by side
    now = {j: d.job(j) for j in ids}
    assert all(x["state"] == "running" and x["cancel_by"] == "root" for x in now.values()), now
    gate.touch()  # each exits 0 after SIGTERM was sent and before SIGKILL: the cancel came first
    for j in ids:
        job = d.wait_state(j, "cancelled", "succeeded")
        assert job["state"] == "cancelled" and job["exit_code"] == 0
        assert job["reason"] == "cancelled by root (the stop was sent first, then it exited with code 0)", job
    # the log path is shown only to who can read it; a user is told how to read theirs
    spec = {"argv": ["echo", "hi"], "gpus": 0, "workdir": "/tmp"}
    kind, theirs = as_user(other_user, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", theirs
    d.wait_state(theirs, "succeeded")
    code, out = invoke_as(other_user, d, "show", str(theirs))
    assert code == 0 and f"log:       colo logs {theirs}" in out and str(d.state_dir) not in out, out
    assert f"log:       {d.state_dir}/logs/{theirs}.log" in d.cli("show", str(theirs), check=True).stdout


def test_ls_shows_open_jobs_by_default_with_filters_ids_and_columns(daemon, tmp_path):
    gate = tmp_path / "go"
    done = daemon.submit("--process", "--gpus", "0", "--name", "prep", "--", "true")
    daemon.wait_state(done, "succeeded")
    run = daemon.submit("--process", "--gpus", "0", "--name", "train", "--", "sh", "-c",
                        f"while [ ! -e {gate} ]; do sleep 0.05; done")
    daemon.wait_state(run, "running")
    try:
        assert daemon.cli("ls", "-q", check=True).stdout == f"{run}\n"
        assert daemon.cli("ls", "-q", "--all", check=True).stdout == f"{done}\n{run}\n"
        assert daemon.cli("ls", "-q", "--state", "succeeded", check=True).stdout == f"{done}\n"
        assert daemon.cli("ls", "-q", "--all", "--user", "nobody", check=True).stdout == ""
        out = daemon.cli("ls", "--all", "--name", "prep", "-o", "id,name,exit", check=True).stdout
        assert out.splitlines() == ["ID  NAME  EXIT", f"{done}   prep  0"], out
        assert [j["id"] for j in json.loads(daemon.cli("ls", "--json", check=True).stdout)] == [run]
        r = daemon.cli("ls", "-o", "id,bogus")
        assert r.returncode == 1 and "unknown column 'bogus'" in r.stderr
        # a job by its name, where one job has it
        assert daemon.cli("show", "train", check=True).stdout.startswith(f"job {run} (train)")
        assert "no job 'nosuch'" in daemon.cli("show", "nosuch").stderr
        frame = daemon.cli("top", "--once", "--lines", "12", check=True).stdout
        assert len(frame.splitlines()) <= 12, frame
    finally:
        gate.touch()
        daemon.wait_state(run, "succeeded")


def test_version_and_every_option_has_help_and_each_command_an_example():
    from colo import __version__

    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output == f"colo {__version__}\n"
    import typer.main

    missing, no_example = [], []

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")
        if getattr(cmd, "commands", None) is None:
            missing.extend(f"{path} {p.opts[0]}" for p in cmd.params if p.param_type_name == "option" and not p.help)
            if "Example" not in (cmd.help or ""):
                no_example.append(path)

    walk(typer.main.get_command(app), "colo")
    assert not missing, missing
    assert not no_example, no_example


def test_submit_short_path_loads_no_heavy_module_and_agrees_with_the_typer_command(daemon, tmp_path):
    probe = ("import sys\nsys.argv = ['colo', 'submit', '--process', '--gpus', '0', '--name', 'quick', '--', 'true']\n"
             "from colo.cli.entry import main\ntry:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
             "heavy = ('typer', 'click', 'rich', 'textual', 'numpy', 'docker', 'pynvml', 'colo.cli.app')\n"
             "print('loaded:' + ','.join(m for m in heavy if m in sys.modules), code)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=daemon.env(), timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "loaded: 0", r.stdout + r.stderr
    quick = int(r.stdout.splitlines()[0])
    assert daemon.wait_state(quick, "succeeded")["name"] == "quick"
    # the same refusal, word for word, from the short path and from the typer command
    bad = ["submit", "--image", "x", "--process", "--", "true"]
    short = daemon.cli(*bad)
    full = subprocess.run([sys.executable, "-m", "colo.cli.app", *bad], capture_output=True, text=True,
                          env=daemon.env(), timeout=60)
    assert short.returncode == full.returncode == 1 and short.stderr == full.stderr != "", (short.stderr, full.stderr)
    # what the short path does not know goes to the typer command: --wait, --follow, --env-file
    envf = tmp_path / "env"
    envf.write_text("# comment\nGREETING=hello there\n")
    r = daemon.cli("submit", "--follow", "--env-file", str(envf), "--process", "--gpus", "0", "--", "sh", "-c",
                   'echo "$GREETING"; exit 4')
    assert r.returncode == 4 and r.stdout.splitlines()[1:] == ["hello there"], (r.stdout, r.stderr)
    r = daemon.cli("submit", "--wait", "--process", "--gpus", "0", "--", "true")
    assert r.returncode == 0 and "succeeded" in r.stderr


def test_history_and_report_count_gpu_hours_and_what_sharing_saved(daemon, tmp_path):
    from colo import report as rp

    # the arithmetic, on two jobs that shared GPU A for an hour and one alone on B
    h = 3600.0
    rows = [{"id": 1, "user": "alice", "state": "succeeded", "gpus": ["A"], "submitted_at": 0, "started_at": 0,
             "ended_at": h, "spec": {"gpu_mem": GiB, "gpus": 1}},
            {"id": 2, "user": "bob", "state": "failed", "gpus": ["A"], "submitted_at": 0, "started_at": 0.5 * h,
             "ended_at": 1.5 * h, "spec": {"gpu_mem": GiB, "gpus": 1}},
            {"id": 3, "user": "bob", "state": "succeeded", "gpus": ["B"], "submitted_at": 0, "started_at": 0,
             "ended_at": h, "spec": {"gpu_mem": GiB, "gpus": 1}}]
    r = rp.report(rows)
    assert r["gpu_hours_one_per_gpu"] == pytest.approx(3.0) and r["gpu_hours_busy"] == pytest.approx(2.5)
    assert r["gpu_hours_saved"] == pytest.approx(0.5) and r["saved_fraction"] == pytest.approx(1 / 6)
    bob = next(u for u in r["users"] if u["user"] == "bob")
    assert (bob["jobs"], bob["failed"], bob["wait_max"]) == (2, 1, pytest.approx(0.5 * h))
    # end to end: two GPU jobs run, and both commands account for them
    ids = [daemon.submit("--process", "--gpu-mem", "1GiB", "--", "sh", "-c", "echo hi") for _ in range(2)]
    for j in ids:
        daemon.wait_state(j, "succeeded")
    hist = json.loads(daemon.cli("history", "--since", "1h", "--json", check=True).stdout)
    assert [x["id"] for x in hist] == ids and all(x["gpus"] == 1 and x["gpu_hours"] > 0 for x in hist)
    out = daemon.cli("report", "--since", "1h", check=True).stdout
    assert out.splitlines()[0].split()[:2] == ["USER", "JOBS"] and "sharing saved" in out and "GPU-h" in out
    r = daemon.cli("history", "--since", "soon")
    assert r.returncode == 1 and "malformed --since" in r.stderr and r.stderr.count("\n") == 1


def test_history_filters_and_bounds_in_the_daemon(daemon, tmp_path):
    """`colo history` (issue 16's leftover): --user, --since (a period or a date) and --limit are
    answered by the daemon from its database; a terminal gets the newest HISTORY_TTY_ROWS and a line
    saying how many were left out, a pipe every job; `colo report` adds up the same jobs."""
    from datetime import datetime

    from colo.cli.app import HISTORY_TTY_ROWS
    from harness.daemon import on_tty

    c, gate = daemon.client, tmp_path / "go"
    first = daemon.submit("--process", "--gpus", "0", "--name", "first", "--", "true")
    daemon.wait_state(first, "succeeded")
    mid = datetime.fromtimestamp(c.show(first)["ended_at"] + 0.001).isoformat(timespec="milliseconds")
    run = daemon.submit("--process", "--gpus", "0", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    spec = {"argv": ["true"], "gpus": 0, "workdir": "/tmp", "after": [run]}
    waiting = [c.submit({**spec, "name": f"w{i}"})["id"] for i in range(HISTORY_TTY_ROWS + 5)]
    daemon.cli("cancel", "--state", "queued", check=True)  # ended at once: history without running them
    gate.touch()
    daemon.wait_state(run, "succeeded")
    every = [first, run, *waiting]  # by id, as sacct lists

    def ids(*args: str) -> list[int]:
        out = daemon.cli("history", *args, check=True).stdout.splitlines()
        assert out[0].split()[:3] == ["ID", "NAME", "USER"], out[:2]
        return [int(ln.split()[0]) for ln in out[1:]]

    assert ids() == every  # piped: every job, oldest first, no line about more
    assert ids("--since", mid) == every[1:] and ids("--since", "1h", "--user", "nobody") == []
    assert ids("--user", "root", "--limit", "3") == every[-3:]  # the 3 newest ...
    r = daemon.cli("history", "--limit", "3", check=True)  # ... and how many more, apart from the rows
    assert r.stderr.startswith(f"({len(every) - 3} older jobs in the period not shown") and r.stderr.count("\n") == 1
    shown = on_tty(daemon, "history")
    assert [int(ln.split()[0]) for ln in shown[1:-1]] == every[-HISTORY_TTY_ROWS:]
    assert shown[-1].startswith(f"({len(every) - HISTORY_TTY_ROWS} older jobs") and "--limit 0" in shown[-1]
    assert len(on_tty(daemon, "history", "--limit", "0")) == len(every) + 1
    assert [j["id"] for j in json.loads(daemon.cli("history", "--json", check=True).stdout)] == every
    r = json.loads(daemon.cli("report", "--since", mid, "--json", check=True).stdout)
    assert r["jobs"] == len(every) - 1 and [u["user"] for u in r["users"]] == ["root"]
    assert r["users"][0]["jobs"] == len(every) - 1 and r["users"][0]["failed"] == 0
    # bad input: one line, a non-zero exit
    for args, said in [(["--limit", "-1"], "--limit -1: a number of jobs, 0 or more"),
                       (["--since", "2026-13-45"], "malformed --since '2026-13-45'"),
                       (["--since", "soon"], "malformed --since 'soon'")]:
        for cmd in (["history"], ["report"]) if args[0] == "--since" else (["history"],):
            r = daemon.cli(*cmd, *args)
            assert r.returncode != 0 and r.stderr.count("\n") == 1 and said in r.stderr, (cmd, args, r.stderr)
    with pytest.raises(ClientError, match="history --limit must be a whole number"):
        c.history(limit=-1)


def test_logs_tail_since_and_timestamps(daemon, tmp_path):
    from datetime import datetime

    gate, done = tmp_path / "go", tmp_path / "done"
    j = daemon.submit("--process", "--gpus", "0", "--name", "talk", "--", "sh", "-c",
                      f"echo one; echo two; while [ ! -e {gate} ]; do sleep 0.05; done; echo three; "
                      f"while [ ! -e {done} ]; do sleep 0.05; done")
    times = daemon.state_dir / "logs" / f"{j}.times"
    # the daemon notes that the log holds the first two lines (8 bytes) at its next sample
    wait_for(lambda: times.exists() and any(int(ln.split()[1]) >= 8 for ln in times.read_text().splitlines()),
             30, "colo to note the first lines")
    cut = time.time() + 0.01
    wait_for(lambda: time.time() > cut, 5, "the clock to pass the cut")
    gate.touch()
    wait_for(lambda: "three" in daemon.cli("logs", str(j)).stdout, 30, "the third line")
    since = datetime.fromtimestamp(cut).isoformat()
    assert daemon.cli("logs", "--since", since, "talk", check=True).stdout == "three\n"
    assert daemon.cli("logs", "--since", "1h", str(j), check=True).stdout == "one\ntwo\nthree\n"
    assert daemon.cli("logs", "--tail", "2", str(j), check=True).stdout == "two\nthree\n"
    assert daemon.cli("logs", "--tail", "1", "--since", since, str(j), check=True).stdout == "three\n"
    out = daemon.cli("logs", "--timestamps", str(j), check=True).stdout.splitlines()
    stamps = [datetime.fromisoformat(ln.split(" ", 1)[0]).timestamp() for ln in out]
    assert [ln.split(" ", 1)[1] for ln in out] == ["one", "two", "three"], out
    assert stamps[0] <= stamps[1] < cut <= stamps[2], (stamps, cut)
    rows = [json.loads(ln) for ln in daemon.cli("logs", "--json", "-n", "1", str(j), check=True).stdout.splitlines()]
    assert rows == [{"at": pytest.approx(stamps[2], abs=0.001), "line": "three\n"}]
    done.touch()
    daemon.wait_state(j, "succeeded")
    assert daemon.cli("logs", "-t", "--since", since, str(j), check=True).stdout.endswith(" three\n")
    r = daemon.cli("logs", "--since", "yesterday", str(j))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "malformed --since 'yesterday'" in r.stderr


def test_every_view_of_a_lines_time_is_the_one_stored(tmp_path, fakegpu):
    """A line the sampler has not noted (it samples once an hour here) is noted by the first view
    that stamps it: --timestamps now, --json later and after the job's end give that one time."""
    from datetime import datetime

    d = DaemonProc(tmp_path, fakegpu.state, {"sample_interval": 3600.0}).start()
    try:
        done = tmp_path / "done"
        j = d.submit("--process", "--gpus", "0", "--", "sh", "-c",
                     f"echo one; while [ ! -e {done} ]; do sleep 0.05; done")
        wait_for(lambda: d.cli("logs", str(j)).stdout == "one\n", 30, "the line")
        out = d.cli("logs", "--timestamps", str(j), check=True).stdout
        at = datetime.fromisoformat(out.split(" ", 1)[0]).timestamp()
        assert out.endswith(" one\n"), out

        def as_json() -> list:
            return [json.loads(ln) for ln in d.cli("logs", "--json", str(j), check=True).stdout.splitlines()]
        assert as_json() == [{"at": pytest.approx(at, abs=0.001), "line": "one\n"}]
        done.touch()
        d.wait_state(j, "succeeded")
        assert as_json() == [{"at": pytest.approx(at, abs=0.001), "line": "one\n"}]
        since = datetime.fromtimestamp(at + 0.01).isoformat()  # after the line: it is not shown
        assert d.cli("logs", "--since", since, str(j), check=True).stdout == ""
    finally:
        d.stop()


def test_hold_release_edit_and_requeue(shared, other_user):
    d = shared
    gate = d.root / "go"
    first = d.submit("--process", "--gpus", "0", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    later = d.submit("--process", "--gpu-mem", "1GiB", "--after", str(first), "--name", "later", "--",
                     "echo", "ran")
    assert d.cli("hold", "later", check=True).stdout == f"job {later}: held by root\n"
    assert json.loads(d.cli("ls", "--json", check=True).stdout)[1]["reason"] == f"held by root (colo release {later})"
    assert "held by root" in d.cli("explain", str(later), check=True).stdout
    # another user may neither hold, release nor edit it
    for args in (("release", str(later)), ("edit", str(later), "--priority", "1"), ("hold", str(first))):
        code, out = invoke_as(other_user, d, *args)
        assert code == 1 and "belongs to root" in out and out.count("\n") == 1, (args, out)
    # edit: the same checks as a submit; a refused edit changes nothing
    r = d.cli("edit", str(later), "--gpu-mem", "20GiB")
    assert r.returncode == 1 and "15.75GiB is usable" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = d.cli("edit", str(later), "--priority", "5000")
    assert r.returncode == 1 and "--priority must be a whole number from -1000 to 1000" in r.stderr, r.stderr
    r = d.cli("edit", str(later), "--name", "bad name")
    assert r.returncode == 1 and "--name must be" in r.stderr, r.stderr
    out = d.cli("edit", str(later), "--gpu-mem", "2GiB", "--priority", "3", "--name", "renamed", check=True).stdout
    assert out == f"job {later}: name renamed, budget 2GiB, priority 3\n", out
    j = d.job(later)
    assert (j["budget"], j["priority"], j["name"], j["spec"]["after"]) == (2 * GiB, 3, "renamed", [first])
    assert j["events"][-1]["reason"] == "edited by root: gpu_mem 1GiB -> 2GiB, name 'later' -> 'renamed', priority 0 -> 3"
    r = d.cli("edit", str(first), "--priority", "1")
    assert r.returncode == 1 and f"job {first} is running: only a queued job may be edited" in r.stderr, r.stderr
    # a held job is not started once what it waited for is done: the scheduler says why it waits
    gate.touch()
    d.wait_state(first, "succeeded")
    wait_for(lambda: "held by root" in ((d.job(later)["decision"] or {}).get("reason") or ""), 30,
             "a pass to look at the held job")
    assert d.job(later)["state"] == "queued"
    rel = json.loads(d.cli("release", "--json", "renamed", check=True).stdout)
    assert [(x["id"], x["held_by"]) for x in rel] == [(later, None)]
    d.wait_state(later, "succeeded")
    r = d.cli("release", str(later))
    assert r.returncode == 1 and "only a queued job may be released" in r.stderr
    # requeue: an ended job again, as a copy with a new id; the ended one stays as it was
    again = json.loads(d.cli("requeue", "--json", str(later), check=True).stdout)[0]
    assert again["id"] > later and again["name"] == "renamed" and again["budget"] == 2 * GiB
    d.wait_state(again["id"], "succeeded")
    assert d.cli("logs", str(again["id"]), check=True).stdout == "ran\n"
    assert d.job(again["id"])["events"][0]["reason"] == f"requeued by root as a copy of job {later}"
    assert d.job(later)["state"] == "succeeded"
    newer = int(d.cli("restart", str(later), check=True).stdout)
    d.wait_state(newer, "succeeded")
    r = d.cli("requeue", "999999")
    assert r.returncode == 1 and "no job 999999" in r.stderr


def test_after_any_and_after_fail(daemon, tmp_path):
    gate = tmp_path / "go"
    bad = daemon.submit("--process", "--gpus", "0", "--", "sh", "-c", "exit 3")
    good = daemon.submit("--process", "--gpus", "0", "--", "true")
    slow = daemon.submit("--process", "--gpus", "0", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    cpu = ["--process", "--gpus", "0", "--", "echo", "ran"]
    on_fail = daemon.submit("--after-fail", str(bad), *cpu)
    never = daemon.submit("--after-fail", str(good), *cpu)
    either = daemon.submit("--after-any", str(bad), "--after-any", str(good), *cpu)
    waits = daemon.submit("--after-any", str(slow), "--after", str(good), *cpu)
    assert daemon.wait_state(on_fail, "succeeded", "failed")["state"] == "succeeded"
    assert daemon.wait_state(either, "succeeded", "failed")["state"] == "succeeded"
    j = daemon.wait_state(never, "failed", "succeeded")
    assert j["reason"] == f"dependency not met (--after-fail): job {good} succeeded" and j["started_at"] is None, j
    wait_for(lambda: daemon.cli("explain", str(waits)).stdout.strip().endswith(f"waiting for job {slow} to end"),
             30, "the job to wait for its --after-any")
    gate.touch()
    assert daemon.wait_state(waits, "succeeded", "failed")["state"] == "succeeded"
    # the typer command takes them too (--wait is not on the short path), and an unknown job is refused
    r = daemon.cli("submit", "--wait", "--after-fail", str(waits), *cpu)
    assert r.returncode == 1 and "dependency not met (--after-fail)" in r.stderr, r.stderr
    r = daemon.cli("submit", "--after-any", "999999", *cpu)
    assert r.returncode == 1 and r.stderr == ("colo: --after-any 999999: no such job (never submitted, or removed by "
                                              "colo clean or history_keep_days)\n"), r.stderr


def test_report_says_slowdown_against_alone_where_known_and_draws_an_svg(daemon, tmp_path):
    import xml.etree.ElementTree as ET

    from colo import report as rp

    known = daemon.submit("--process", "--gpu-mem", "1GiB", "--profile", "alexnet", "--", "sleep", "0.2")
    unknown = daemon.submit("--process", "--gpu-mem", "1GiB", "--", "true")
    assert daemon.cli("wait", str(known), str(unknown)).returncode == 0
    # what the job's end taught is stored just after it ends
    hist = wait_for(lambda: (h := json.loads(daemon.cli("history", "--json", check=True).stdout))
                    and h[0]["alone_s"] and h, 30, "the end to be set against the profile")
    a, b = hist
    assert a["slowdown"] == pytest.approx(a["ran"] / a["alone_s"]) and b["alone_s"] is None and b["slowdown"] is None
    table = daemon.cli("history", check=True).stdout.splitlines()
    assert table[0].split()[-1] == "SLOWDOWN" and table[1].split()[-1] == rp.times(a["slowdown"])
    assert table[2].split()[-1] == "—"
    svg = tmp_path / "r.svg"
    out = daemon.cli("report", "--svg", str(svg), check=True).stdout
    assert "SLOWDOWN P50" in out.splitlines()[0] and rp.times(a["slowdown"]) in out and f"wrote {svg}" in out
    root = ET.parse(svg).getroot()  # well-formed SVG with a bar per user and per day
    assert root.tag.endswith("svg") and len(root.findall("{http://www.w3.org/2000/svg}rect")) >= 4
    r = json.loads(daemon.cli("report", "--json", check=True).stdout)
    assert r["users"][0]["slowdown_jobs"] == 1 and r["days"][0]["gpu_hours_one_per_gpu"] > 0
    r = daemon.cli("report", "--svg", str(tmp_path / "no" / "such" / "r.svg"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "No such file" in r.stderr
    # no profile anywhere: the per-user figure is "—", not 0
    row = {"id": 1, "user": "u", "state": "succeeded", "gpus": ["A"], "started_at": 0.0, "ended_at": 9.0, "spec": {}}
    assert rp.times(rp.report([row])["users"][0]["slowdown_median"]) == "—"
