"""Does a submit cost the daemon the same with 100, 10,000 and 50,000 jobs queued?

A real daemon on 8 simulated GPUs whose memory is held by 8 real running jobs; C clients (each a
forked child running as its own user) fill the queue through real submits over the socket, each
job a GPU job of 1-8 GiB that must wait. For every block of --step submits it prints the submit
rate and the daemon's CPU time per submit, beside the first block's (the baseline: a short queue).
At the end, `colo ls` on the full queue beside `colo ls` on the empty one.

Refused unless the store then holds exactly the acknowledged submissions, all queued, the 8
holders still running, and the daemon logged no error.

Run: python bench/fill_bench.py [--jobs 50000] [--step 5000] [--clients 2] [--max-minutes 30]
"""
from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report, cpu_seconds, daemon_log_problems  # noqa: E402
from harness.daemon import DaemonProc  # noqa: E402
from harness.users import Peer, ensure_users, shared_root  # noqa: E402

from colo.node import fakegpu, native  # noqa: E402
from colo.client import Client  # noqa: E402

GiB = 1024**3
GPUS, GPU_MEM = 8, 16 * GiB


def ls_time(d: DaemonProc, n: int = 3) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "colo", "ls"], env=d.env(), check=True, capture_output=True)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


class CpuSampler(threading.Thread):
    """(monotonic time, daemon CPU seconds) every `every` s, to split the daemon's CPU by block."""

    def __init__(self, pid: int, every: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, float]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.monotonic(), cpu_seconds(self.pid)))
            self._halt.wait(self.every)

    def at(self, t: float) -> float:
        """Daemon CPU seconds at time t, interpolated between samples."""
        s = self.samples
        for (t0, c0), (t1, c1) in zip(s, s[1:]):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * (t - t0) / (t1 - t0 or 1)
        return s[-1][1] if t > s[-1][0] else s[0][1]

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.samples.append((time.monotonic(), cpu_seconds(self.pid)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=50000)
    ap.add_argument("--step", type=int, default=5000)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-minutes", type=float, default=60.0, help="stop filling after this long")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    native.ensure_built()
    rep = Report("fill_bench")
    root = shared_root("colo-fill-")
    fakegpu.create(root / "gpus", count=GPUS, mem=GPU_MEM)
    os.chmod(root / "gpus", 0o666)
    d = DaemonProc(root, root / "gpus", {"sample_interval": 1.0, "max_queued_per_user": 0}).start()
    os.chmod(d.socket.parent, 0o755)
    handles = []
    try:
        hold = [d.client.submit({"argv": ["sleep", "3600"], "gpus": 1, "gpu_mem": GPU_MEM, "name": f"holder{i}",
                                 "workdir": "/tmp"})["id"] for i in range(GPUS)]
        for i in hold:
            handles.append(d.wait_state(i, "running", timeout=60).get("handle"))
        ls_empty = ls_time(d)
        users = ensure_users(a.clients, prefix="colofill")
        deadline = time.monotonic() + 60 * a.max_minutes
        per = [a.jobs // a.clients + (1 if k < a.jobs % a.clients else 0) for k in range(a.clients)]

        def client_fn(k: int, n: int):
            def fn():
                c = Client(d.socket, timeout=120)
                out = []
                for i in range(n):
                    if time.monotonic() > deadline:
                        break
                    j = c.submit({"argv": ["sleep", "1"], "gpus": 1, "gpu_mem": (1 + (i + k) % 8) * GiB,
                                  "priority": -((i + k) % 3), "name": f"f{k}-{i}", "workdir": "/tmp"})
                    out.append((time.monotonic(), j["id"]))
                return out
            return fn

        peers = [Peer(pw, client_fn(k, n)) for k, (pw, n) in enumerate(zip(users, per))]
        cpu = CpuSampler(d.proc.pid)
        cpu.start()
        t0 = time.monotonic()
        for p in peers:
            p.go()
        acked = sorted(x for p in peers for x in p.result())
        cpu.stop()
        done = len(acked)
        rep.check(len({i for _, i in acked}) == done, "an id was acknowledged twice")
        with sqlite3.connect(f"file:{d.state_dir / 'colo.db'}?mode=ro", uri=True) as db:
            st = dict(db.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())
        want = {"running": GPUS, "queued": done}
        rep.check(st == want, f"the store should hold {want}, holds {st}")
        rep.check(done > 0, "no submission was acknowledged")
        ls_full = ls_time(d) if done else 0.0
        # every timestamp is when the k-th submission came back: rate per block of `step`
        stamps = [t0] + [t for t, _ in acked]
        blocks = []
        for lo in range(0, done - a.step + 1, a.step):
            ta, tb = stamps[lo], stamps[lo + a.step]
            blocks.append((lo, lo + a.step, a.step / (tb - ta), 1000 * (cpu.at(tb) - cpu.at(ta)) / a.step))
        rep.check(bool(blocks), f"fewer than one block of {a.step} submits was done ({done})")
    finally:
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(120)
        for h in handles:  # "pid:start": the shim leads its job's process group
            try:
                os.killpg(int(str(h).split(":")[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    rep.check(not (p := daemon_log_problems(d.log)), f"daemon log: {p[:3]}")
    if done < a.jobs:
        rep.note(f"stopped after {a.max_minutes:g} minutes: {done:,} of {a.jobs:,} submitted")
    if blocks:
        _, _, rate0, cpu0 = blocks[0]
        for lo, hi, rate, c in blocks:
            rep.figure(f"rate_{hi}", f"submits/s, queue {lo:,}-{hi:,}", rate, "/s", rate0,
                       f"queue 0-{a.step:,}", f"{a.clients} clients")
        for lo, hi, rate, c in blocks:
            rep.figure(f"cpu_{hi}", f"daemon CPU per submit, queue {lo:,}-{hi:,}", c, "ms", cpu0,
                       f"queue 0-{a.step:,}")
        rep.figure("ls_full", f"`colo ls`, {done + GPUS:,} jobs", ls_full, "s", ls_empty, f"`colo ls`, {GPUS} jobs",
                   "median of 3")
    rep.extra["blocks"] = blocks
    return rep.finish(a.json_out)


if __name__ == "__main__":
    os.environ.pop("COLO_FAKEGPU_STATE", None)
    sys.exit(main())
