"""Daemon costs, measured side by side in one run:

- `colo submit` wall time against a bare `python3 -c pass` (ratio; aim: within 3x);
- `colo ls` with 10,000 jobs in the store (aim: under 1 s);
- one scheduler pass with 10,000 queued jobs over 8 GPUs (aim: under 20 ms);
- daemon RSS with 10,000 jobs (aim: under 150 MB).

Run: python bench/daemon_bench.py [--jobs 10000]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemon_util import DaemonProc  # noqa: E402

from colo import fakegpu  # noqa: E402
from colo.config import Config  # noqa: E402
from colo.daemon.core import Daemon  # noqa: E402
from colo.jobs import JobSpec, Mode, State  # noqa: E402
from colo.store import Store  # noqa: E402

GiB = 1024**3


def timed(cmd: list[str], n: int, env=None) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        out.append(time.perf_counter() - t)
    return out


def fill(db: Path, n: int, uuids: list[str]) -> None:
    """n queued jobs that cannot fit, behind 8 running ones that hold every GPU."""
    s = Store(db)
    now = time.time()
    with s.tx():
        for i, u in enumerate(uuids):
            j = s.add_job(JobSpec(argv=["sleep", "1"], gpu_mem=16 * GiB), 0, 0, "root", now)
            s.transition(j.id, State.STARTING, "bench")
            s.transition(j.id, State.RUNNING, "bench", gpus=[u], mode=Mode.TIMESLICED, handle="1:0")
        for i in range(n):
            s.add_job(JobSpec(argv=["sleep", "1"], gpu_mem=(1 + i % 8) * GiB, priority=i % 3), 1000 + i % 10,
                      1000, f"user{i % 10}", now + i)
    s.close()


def scheduler_pass(root: Path, state: Path, n: int, uuids: list[str]) -> list[float]:
    cfg = Config(state_dir=root / "sched", socket=root / "sched.sock", fakegpu_state=state, reserve=0)
    cfg.state_dir.mkdir()
    fill(cfg.db_path, n, uuids)
    d = Daemon(cfg)
    d.open()
    # jobs marked running by fill() have no process behind them: keep recovery out of the measurement
    changed, steady = [], []

    async def go():
        d.wake_event, d.changed = asyncio.Event(), asyncio.Condition()
        for _ in range(20):
            d.decisions.clear()  # every wait reason is new: all 10,000 are handed to the writer
            t = time.perf_counter()
            decisions = d.schedule_pass()
            changed.append(time.perf_counter() - t)
            assert len(decisions) == n and not any(x.action == "start" for x in decisions)
        for _ in range(20):  # nothing changed since the last pass
            t = time.perf_counter()
            d.schedule_pass()
            steady.append(time.perf_counter() - t)

    asyncio.run(go())
    d.close()
    return changed, steady


def rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("-n", type=int, default=15)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="colo-bench-"))
    state = root / "fakegpu.state"
    fakegpu.create(state, count=8, mem=16 * GiB)
    uuids = fakegpu.FakeNode(state).uuids()

    d = DaemonProc(root / "d1", state).start() if (root / "d1").mkdir() is None else None
    env = d.env()
    bare = timed([sys.executable, "-c", "pass"], args.n)
    sub = timed([sys.executable, "-m", "colo", "submit", "--process", "--gpus", "0", "--", "true"], args.n, env)
    d.stop()
    print(f"{'measure':<44}{'colo':>12}{'baseline':>12}{'ratio':>8}")
    mb, ms = statistics.median(bare), statistics.median(sub)
    print(f"{'submit wall time, median of ' + str(args.n):<44}{ms * 1000:>10.0f}ms{mb * 1000:>10.0f}ms{ms / mb:>8.2f}")

    (root / "d2").mkdir()
    d2 = DaemonProc(root / "d2", state)
    d2.state_dir.mkdir(parents=True)
    fill(d2.state_dir / "colo.db", args.jobs, uuids)
    d2.config_path.write_text('reserve = "0"\nsample_interval = 1.0\n')
    d2.start()
    rss0 = rss_kb(d2.proc.pid)
    ls = timed([sys.executable, "-m", "colo", "ls"], 5, d2.env())
    ls_json = timed([sys.executable, "-m", "colo", "ls", "--json"], 5, d2.env())
    rss1 = rss_kb(d2.proc.pid)
    d2.stop()
    print(f"{'colo ls, ' + str(args.jobs) + ' jobs, median of 5':<44}{statistics.median(ls) * 1000:>10.0f}ms"
          f"{mb * 1000:>10.0f}ms{statistics.median(ls) / mb:>8.2f}")
    print(f"{'colo ls --json, same':<44}{statistics.median(ls_json) * 1000:>10.0f}ms")
    print(f"{'daemon RSS with ' + str(args.jobs) + ' jobs (after ls)':<44}{rss1 / 1024:>10.1f}MB"
          f"{rss0 / 1024:>10.1f}MB   (baseline: just started)")

    changed, steady = scheduler_pass(root, state, args.jobs, uuids)
    for label, t in (("all reasons new", changed), ("nothing new", steady)):
        print(f"{'scheduler pass, ' + str(args.jobs) + ' queued, 8 GPUs, ' + label:<44}"
              f"{statistics.median(t) * 1000:>10.1f}ms   (min {min(t) * 1000:.1f}ms, max {max(t) * 1000:.1f}ms, "
              f"{len(t)} passes)")


if __name__ == "__main__":
    os.environ.pop("COLO_FAKEGPU_STATE", None)
    main()
