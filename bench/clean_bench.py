"""Removing ended jobs: `colo clean` and the daemon's own purge (history_keep_days) on a long
history, and what they cost everyone else meanwhile.

The database: N ended jobs (default 10,000) by 10 users, ended over the last 59 days, each with a
real-sized spec, 4 events, a decision, S usage samples (default 60) and a log file. Then:
- the op `clean` (`colo clean --before 30d -u user0 ... -u user9`, from a client in this
  process, so no CLI start-up is counted) against a daemon on a copy of it: its wall time, and
  the round trip of `hello` from another client sent every 20 ms meanwhile (p99, max), beside the
  op `history` of every job on the same daemon just before with the same probe;
- a daemon started on another copy with `history_keep_days = 30`: how long from its start until
  its purge has removed the same jobs (polled on the database, read-only), beside its start to
  its first answer, and the probe meanwhile.

The walls include serving the probe (between batches the loop answers whoever asked): the more
round trips the probe got in, the longer the removal took; what the probe waits at most is the
figure for everyone else.

Every figure is refused unless the work happened: each removes exactly the jobs that ended more
than 30 days ago, their log files are gone, the other jobs and their logs are all there.

Run (as root): python bench/clean_bench.py [--jobs 10000] [--samples 60]
                                           [--json-out bench/results/clean_bench.json]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report, daemon_log_problems  # noqa: E402

from harness.daemon import DaemonProc, wait_for  # noqa: E402

from colo.node import fakegpu  # noqa: E402
from colo.client import Client  # noqa: E402
from colo.jobs import JobSpec, Mode, State  # noqa: E402
from colo.store import Store  # noqa: E402

GiB = 1 << 30
DAY = 86400.0


def seed(state_dir: Path, n: int, samples: int) -> tuple[set[int], set[int]]:
    """n ended jobs with their samples and logs; (ids that ended > 30 days ago, the others)."""
    rnd = random.Random(7)
    (state_dir / "logs").mkdir(parents=True, mode=0o700)
    st = Store(state_dir / "colo.db")
    now = time.time()
    old, new = set(), set()
    with st.tx():
        for i in range(n):
            end = now - 59 * DAY * (n - i) / n
            start = end - rnd.uniform(60, 7200)
            user = f"user{i % 10}"
            spec = JobSpec(argv=["python", "train.py", f"--seed={i}"], name=f"exp-{i % 97}", gpu_mem=4 * GiB,
                           gpus=1, workdir="/tmp", env={f"VAR_{k}": f"value-{k}-{'x' * 24}" for k in range(12)})
            j = st.add_job(spec, 2000 + i % 10, 2000, user, now=start - 5)
            st.transition(j.id, State.STARTING, "start", now=start, gpus=["GPU-bench-0"], mode=Mode.MPS)
            st.transition(j.id, State.RUNNING, "started (process)", now=start + 0.5)
            st.record_decisions([(j.id, "start", "mps", [], "fits", {"profile_runtime": 100.0})], now=start)
            st.add_samples([(j.id, start + k, 0.5, GiB, 0.2) for k in range(samples)])
            st.transition(j.id, State.SUCCEEDED, "exited", now=end, exit_code=0)
            (state_dir / "logs" / f"{j.id}.log").write_text(f"job {j.id}\n" * 20)
            (old if end < now - 30 * DAY else new).add(j.id)
    st.close()
    return old, new


class Probe(threading.Thread):
    """`hello` round trips, one every `every` seconds, until stopped."""

    def __init__(self, sock: Path, every: float = 0.02):
        super().__init__(daemon=True)
        self.client, self.every = Client(sock, timeout=60), every
        self.times: list[float] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            t = time.perf_counter()
            self.client.hello()
            self.times.append(time.perf_counter() - t)
            self.halt.wait(self.every)

    def stop(self) -> list[float]:
        self.halt.set()
        self.join()
        return self.times


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * 0.99))]


def ids_in(db: Path) -> set[int]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {r[0] for r in con.execute("SELECT id FROM jobs")}
    finally:
        con.close()


def logs_in(state_dir: Path) -> set[int]:
    return {int(p.name.split(".")[0]) for p in (state_dir / "logs").glob("*.log")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--samples", type=int, default=60, help="usage samples per job")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    rep = Report("clean_bench")
    json_out = args.json_out.resolve() if args.json_out else None
    os.chdir("/")
    root = Path(tempfile.mkdtemp(prefix="colo-clean-bench-"))
    fake = root / "fake.state"
    fakegpu.create(fake, count=1, mem=16 * GiB)
    old, new = seed(root / "seed" / "state", args.jobs, args.samples)
    runs: dict[str, dict] = {}
    users = [f"user{u}" for u in range(10)]
    for side, cfg in (("clean", {}), ("purge", {"history_keep_days": 30})):
        shutil.copytree(root / "seed", root / side)
        d = DaemonProc(root / side, fake, cfg)
        client = Client(d.socket, timeout=600)
        if side == "clean":
            d.start()
            # the ops themselves, from a client in this process (no CLI start-up in the figures)
            probe = Probe(d.socket)
            probe.start()
            t = time.perf_counter()
            listed = client.history(0.0)
            history_wall = time.perf_counter() - t
            history_times = probe.stop()
            rep.check(len(listed["jobs"]) == args.jobs, "history did not list every job")
            probe = Probe(d.socket)
            probe.start()
            t = time.perf_counter()
            r = client.clean(before=time.time() - 30 * DAY, users=users)
            wall = time.perf_counter() - t
            times = probe.stop()
            rep.check(r == {"removed": len(old), "kept": 0}, f"clean said {r}, not removed {len(old)}")
        else:
            t = time.perf_counter()
            d.start()
            first = time.perf_counter() - t
            probe = Probe(d.socket)
            probe.start()
            wait_for(lambda: ids_in(d.state_dir / "colo.db") == new and logs_in(d.state_dir) == new, 600,
                     "the purge", interval=0.2)
            wall = time.perf_counter() - t
            times = probe.stop()
        left = ids_in(d.state_dir / "colo.db")
        logs = logs_in(d.state_dir)
        rep.check(left == new, f"{side}: {len(left)} jobs left, not the {len(new)} that ended in 30 days")
        rep.check(logs == new, f"{side}: {len(logs)} logs left, not the {len(new)} of the jobs kept")
        d.stop()
        problems = daemon_log_problems(d.log)
        rep.check(not problems, f"the {side} daemon logged problems: {problems[:3]}")
        runs[side] = {"wall": wall, "times": times}
    if rep.failures:
        return rep.finish(json_out)
    c, p = runs["clean"], runs["purge"]
    what = f"{len(old):,} of {args.jobs:,} ended jobs ({args.samples} samples and a log each)"
    hist = f"the op `history` of all {args.jobs:,} jobs, same daemon, just before"
    rep.figure("clean_wall", f"op `clean` (colo clean --before 30d -u x10) of {what}, wall", c["wall"], "s",
               history_wall, hist, note=f"{len(old) / c['wall']:,.0f} jobs/s")
    rep.figure("clean_p99", f"`hello` round trip every 20 ms during that clean, p99 (of {len(c['times'])})",
               p99(c["times"]), "s", p99(history_times), f"the same probe during {hist}")
    rep.figure("clean_max", "`hello` round trip during that clean, max", max(c["times"]), "s",
               max(history_times), f"the same probe during {hist}")
    rep.figure("purge_wall", f"history_keep_days = 30: daemon start to {what} purged", p["wall"], "s",
               first, "the same daemon start to its first answer", note=f"{len(old) / (p['wall'] - first):,.0f} jobs/s after")
    rep.figure("purge_max", f"`hello` round trip every 20 ms during that purge, max (of {len(p['times'])})",
               max(p["times"]), "s", max(history_times), f"the probe during {hist}")
    shutil.rmtree(root, ignore_errors=True)
    return rep.finish(json_out)


if __name__ == "__main__":
    os.environ.pop("COLO_FAKEGPU_STATE", None)
    sys.exit(main())
