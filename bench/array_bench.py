"""What one 1,000-task array with a 120 KiB spec costs the daemon: database, write-ahead log, memory.

A real daemon in a temporary directory (no GPUs: CPU jobs, submitted held so that they stay
queued). Submits, over the socket, one job with a spec of 60 KiB of environment and 60 KiB of
arguments (the baseline: what one such spec costs), then a 1,000-task array of the same spec.
For each it prints the growth of the database file plus its write-ahead log (SQLite's -wal) and of
the daemon's resident memory (VmRSS). The aim (issue 52): the array costs < 5 MB of each. Then
what listing the tasks adds: `colo ls --wide -o id,command,reason` (ls's rows with the whole
command, which the daemon keeps for the next ls) and `colo ls --json`.

Refused unless the store then holds the job and every task, queued and held, each task with the
whole environment and arguments (read back through `colo show`), and the daemon logged no error.

Run: python bench/array_bench.py [--tasks 1000] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report, daemon_log_problems  # noqa: E402
from harness.daemon import DaemonProc  # noqa: E402

MB = 1e6


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def disk(db: Path) -> int:
    return sum(p.stat().st_size for p in (db, Path(f"{db}-wal")) if p.exists())


def settled_rss(pid: int) -> int:
    """RSS once it stops moving (the daemon's loop may still be filing what it was sent)."""
    last = rss(pid)
    for _ in range(50):
        time.sleep(0.2)
        now = rss(pid)
        if abs(now - last) < 256 << 10:
            return now
        last = now
    return last


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    rep = Report("array_bench")
    root = Path(tempfile.mkdtemp(prefix="colo-arraybench-"))
    d = DaemonProc(root, config={"max_queued_per_user": 0}).start()
    try:
        env = {f"BENCH_VAR_{i:03d}": "e" * 500 for i in range(120)}  # ~60 KiB
        argv = ["/bin/true", *("a" * 500 for _ in range(120))]  # ~60 KiB
        spec = {"argv": argv, "env": env, "gpus": 0, "hold": True, "name": "bench"}
        db = d.state_dir / "colo.db"
        pid = d.proc.pid
        d.client.ls()  # the daemon's first answer: its lazy imports done before the first figure
        r0, b0 = settled_rss(pid), disk(db)
        one = d.client.submit(spec)
        r1, b1 = settled_rss(pid), disk(db)
        arr = d.client.submit({**spec, "array": f"0-{args.tasks - 1}"})
        r2, b2 = settled_rss(pid), disk(db)
        tasks = arr.get("tasks", [])
        # every task listed with its whole command, as `colo ls --json --tasks` asks: rows the daemon keeps
        listed = d.client.ls_fields(["id", "argv", "reason"], all=False)
        r3 = settled_rss(pid)
        summaries = d.client.ls(all=False)  # `colo ls --json`
        r4 = settled_rss(pid)
        rep.check(len(tasks) == args.tasks, f"{len(tasks)} tasks stored, not {args.tasks}")
        open_jobs = d.client.ls(all=False)
        rep.check(len(open_jobs) == args.tasks + 1 and all(j["state"] == "queued" and j["held_by"]
                                                          for j in open_jobs),
                  "not every job and task is queued and held")
        for t in (tasks[0], tasks[len(tasks) // 2], tasks[-1], one["id"]):
            s = d.client.call("show", id=t)["spec"]
            rep.check(s["env"] == env and s["argv"] == argv, f"job {t}'s spec read back differs")
        rep.check(not daemon_log_problems(d.log), "the daemon logged an error")
        rep.figure("array_disk", f"database + WAL growth, {args.tasks}-task array", (b2 - b1) / MB, "MB",
                   baseline=(b1 - b0) / MB, baseline_what="the same for one job of the same spec")
        rep.figure("array_rss", f"daemon RSS growth, {args.tasks}-task array", (r2 - r1) / MB, "MB",
                   baseline=(r1 - r0) / MB, baseline_what="the same for one job of the same spec")
        rep.figure("ls_rss", f"daemon RSS growth, listing the {args.tasks} tasks with their commands",
                   (r3 - r2) / MB, "MB", baseline=(r2 - r1) / MB, baseline_what="the array's own")
        rep.figure("ls_json_rss", f"daemon RSS growth, `colo ls --json` of the {args.tasks} tasks after that",
                   (r4 - r3) / MB, "MB", baseline=(r2 - r1) / MB, baseline_what="the array's own")
        rep.check(len(summaries) == args.tasks + 1, f"ls --json listed {len(summaries)} jobs")
        rep.check(len(listed["rows"]) == args.tasks + 1, f"ls listed {len(listed['rows'])} jobs")
        rep.note(f"spec: {sum(len(k) + len(v) for k, v in env.items())} B of environment, "
                 f"{sum(len(a) for a in argv)} B of arguments; aim: < 5 MB each for the array")
    finally:
        d.stop()
    return rep.finish(args.json_out)


if __name__ == "__main__":
    sys.exit(main())
