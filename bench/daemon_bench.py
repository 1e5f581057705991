"""Daemon costs, each measured beside a baseline in the same run:

- `colo submit` wall time against a bare `python3 -c pass` (the interpreter's own start-up);
- `colo ls` with N jobs in the store against `colo ls` on a near-empty daemon;
- one scheduler pass with N queued jobs over 8 GPUs against the same pass with 100 queued;
- daemon RSS with N jobs against a near-empty daemon.

Every figure is refused unless the work behind it happened as intended: the submitted jobs ran
and succeeded, the N queued jobs stayed queued behind 8 real running jobs (none started, none
failed) while `colo ls` was timed, and the daemon logged no error.

Run: python bench/daemon_bench.py [--jobs 10000] [-n 15] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report, daemon_log_problems  # noqa: E402
from harness.daemon import DaemonProc, wait_for  # noqa: E402

from colo.node import fakegpu  # noqa: E402
from colo.config import Config  # noqa: E402
from colo.jobs import JobSpec, Mode, State  # noqa: E402
from colo.store import Store  # noqa: E402

GiB = 1024**3
GPUS, GPU_MEM = 8, 16 * GiB


def timed(cmd: list[str], n: int, env=None) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        out.append(time.perf_counter() - t)
    return out


def add_queued(db: Path, n: int) -> None:
    """n queued GPU jobs of 1-8 GiB from ten users (uids 1000-1009), written straight to the store."""
    s = Store(db)
    now = time.time()
    with s.tx():
        for i in range(n):
            s.add_job(JobSpec(argv=["sleep", "1"], gpu_mem=(1 + i % 8) * GiB, priority=i % 3, workdir="/tmp"),
                      1000 + i % 10, 1000, f"user{i % 10}", now + i)
    s.close()


def states(db: Path) -> dict[str, int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return dict(c.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())


def rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def submit_and_ls_small(rep: Report, root: Path, state: Path, n: int) -> tuple[float, float, int]:
    """Submit wall time vs python -c pass; ls and RSS of a near-empty daemon (baselines)."""
    (root / "d1").mkdir()
    d = DaemonProc(root / "d1", state).start()
    try:
        env = d.env()
        bare = timed([sys.executable, "-c", "pass"], n)
        sub = timed([sys.executable, "-m", "colo", "submit", "--process", "--gpus", "0", "--", "true"], n, env)
        done = wait_for(lambda: (js := d.client.ls()) and all(j["state"] in ("succeeded", "failed", "cancelled")
                                                              for j in js) and js, 120, "submitted jobs to end")
        ok = sum(j["state"] == "succeeded" for j in done)
        rep.check(len(done) == n and ok == n, f"submit: {n} submitted, {len(done)} stored, {ok} succeeded")
        ls_small = statistics.median(timed([sys.executable, "-m", "colo", "ls"], 5, env))
        rss_small = rss_kb(d.proc.pid)
    finally:
        d.stop()
    rep.check(not (p := daemon_log_problems(d.log)), f"daemon 1 log: {p[:3]}")
    mb, ms = statistics.median(bare), statistics.median(sub)
    rep.figure("submit_wall", "`colo submit` wall time", ms, "s", mb, "`python3 -c pass`", f"median of {n}")
    return ls_small, rss_small, len(done)


def holders(d: DaemonProc) -> list[int]:
    """8 real running jobs that hold every GPU's memory, so queued jobs wait."""
    ids = [d.client.submit({"argv": ["sleep", "3600"], "gpus": 1, "gpu_mem": GPU_MEM, "name": f"holder{i}",
                            "workdir": "/tmp"})["id"] for i in range(GPUS)]
    for i in ids:
        d.wait_state(i, "running", timeout=60)
    return ids


def ls_big(rep: Report, root: Path, state: Path, n: int, ls_small: float, rss_small: int, small_jobs: int) -> None:
    (root / "d2").mkdir()
    d = DaemonProc(root / "d2", state, {"sample_interval": 1.0})
    d.start()
    hold = holders(d)
    handles = {i: d.client.show(i).get("handle") for i in hold}
    # Jobs outlive their daemon: stop it (not DaemonProc.stop, which cancels them), add the queue
    # to its store, start it again; it finds the 8 holders still running.
    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(60)
    db = d.state_dir / "colo.db"
    add_queued(db, n)
    try:
        d.start()
        rep.check(all(d.client.show(i)["state"] == "running" for i in hold), "holders not running after restart")
        time.sleep(2.0)  # let the first passes after the restart settle (the ls figure is of a quiet daemon)
        before = states(db)
        rss0 = rss_kb(d.proc.pid)
        ls = timed([sys.executable, "-m", "colo", "ls"], 5, d.env())
        ls_json = timed([sys.executable, "-m", "colo", "ls", "--json"], 5, d.env())
        rss1 = rss_kb(d.proc.pid)
        after = states(db)
        want = {"running": GPUS, "queued": n}
        rep.check(before == want and after == want,
                  f"ls: the store should hold {want} throughout, held {before} before and {after} after")
    finally:
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(60)
        for h in handles.values():  # "pid:start": the shim leads its job's process group
            try:
                os.killpg(int(str(h).split(":")[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    rep.check(not (p := daemon_log_problems(d.log)), f"daemon 2 log: {p[:3]}")
    rep.figure("ls", f"`colo ls`, {n:,} jobs", statistics.median(ls), "s", ls_small,
               f"`colo ls`, {small_jobs} jobs", "median of 5")
    rep.figure("ls_json", f"`colo ls --json`, {n:,} jobs", statistics.median(ls_json), "s", ls_small,
               f"`colo ls`, {small_jobs} jobs", "median of 5")
    rep.figure("rss", f"daemon RSS, {n:,} jobs (after ls)", rss1 * 1024, "B", rss_small * 1024,
               f"daemon RSS, {small_jobs} jobs", f"{rss0 / 1024:.1f} MiB before the ls calls")


def scheduler_pass(rep: Report, root: Path, state: Path, n: int, uuids: list[str]) -> tuple[list, list]:
    """Pass times of an in-process Daemon over a store of 8 'running' holders and n queued jobs."""
    from colo.daemon.core import Daemon

    cfg = Config(state_dir=root / f"sched{n}", socket=root / f"sched{n}.sock", fakegpu_state=state, reserve=0)
    cfg.state_dir.mkdir()
    s = Store(cfg.db_path)
    now = time.time()
    with s.tx():
        for u in uuids:
            j = s.add_job(JobSpec(argv=["sleep", "1"], gpu_mem=GPU_MEM), 0, 0, "root", now)
            s.transition(j.id, State.STARTING, "bench")
            s.transition(j.id, State.RUNNING, "bench", gpus=[u], mode=Mode.TIMESLICED, handle="1:0")
    s.close()
    add_queued(cfg.db_path, n)
    d = Daemon(cfg)
    d.open()  # no loop runs: the holders (no process behind them) are not recovered, nothing starts
    changed, steady = [], []
    bad: list[str] = []

    async def go():
        for _ in range(20):
            d.scheduler.decisions.clear()  # every wait reason is new: all n are handed to the writer
            t = time.perf_counter()
            decisions = d.scheduler.schedule_pass(complete=True)  # every queued job, as after a restart
            changed.append(time.perf_counter() - t)
            if len(decisions) != n or any(x.action == "start" for x in decisions):
                bad.append(f"{len(decisions)} decisions, {sum(x.action == 'start' for x in decisions)} starts")
        for _ in range(20):  # nothing changed since the last pass
            t = time.perf_counter()
            d.scheduler.schedule_pass()
            steady.append(time.perf_counter() - t)

    asyncio.run(go())
    d.close()
    rep.check(not bad, f"scheduler pass, {n} queued: expected {n} waits and no start, got {bad[:2]}")
    return changed, steady


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("-n", type=int, default=15)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rep = Report("daemon_bench")
    root = Path(tempfile.mkdtemp(prefix="colo-bench-"))
    os.chmod(root, 0o755)  # jobs run as their submitters (uids 1000-1009 here) and must reach the daemon's files
    state = root / "fakegpu.state"
    fakegpu.create(state, count=GPUS, mem=GPU_MEM)
    uuids = fakegpu.FakeNode(state).uuids()

    ls_small, rss_small, small_jobs = submit_and_ls_small(rep, root, state, args.n)
    ls_big(rep, root, state, args.jobs, ls_small, rss_small, small_jobs)
    small_c, small_s = scheduler_pass(rep, root, state, 100, uuids)
    changed, steady = scheduler_pass(rep, root, state, args.jobs, uuids)
    for key, label, t, base in (("pass_new", "all reasons new", changed, small_c),
                                ("pass_steady", "nothing new", steady, small_s)):
        rep.figure(key, f"scheduler pass, {args.jobs:,} queued, 8 GPUs, {label}", statistics.median(t), "s",
                   statistics.median(base), "the same pass with 100 queued",
                   f"median of {len(t)}, min {min(t) * 1000:.1f} ms, max {max(t) * 1000:.1f} ms")
    return rep.finish(args.json_out)


if __name__ == "__main__":
    os.environ.pop("COLO_FAKEGPU_STATE", None)
    sys.exit(main())
