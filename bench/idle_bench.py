"""What an idle daemon costs the machine (issue 41 item 1), read from /proc only: no request is sent
while it is measured (a probe would cost the daemon CPU of its own).

For each case a fresh daemon on 8 simulated 16 GiB GPUs, then nothing changes for --seconds:
- `held-N`: N jobs queued and held (arrays of up to 1,000 tasks), nothing running;
- `running-N`: 8 jobs running, one on each GPU, its whole memory each, and N queued behind them
  (arrays of up to 1,000 tasks).
Measured after --settle (75 s: the once-a-minute pass over every queued job that the fill made due
is over) for --seconds (65 s: long enough to hold the next such pass, where one is still made).
Figures per case: CPU (user + system, every thread) in % of one core, wake-ups a second (voluntary
context switches of every thread: how often it left its sleep), and RSS.

--before DIR: a checkout of another colo (its native/ built), whose daemon is measured the same
way beside this one's, case by case (interleaved, so that load on the machine hits both alike).

Run (as root): python bench/idle_bench.py [--queued 100,10000] [--big] [--seconds 60]
                                          [--before DIR] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report, daemon_log_problems  # noqa: E402
from harness.daemon import DaemonProc, wait_for  # noqa: E402

from colo.node import fakegpu  # noqa: E402

GiB = 1 << 30
ARRAY = 1000


def cpu_s(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, every thread


def switches(pid: int) -> int:
    n = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            for line in open(f"/proc/{pid}/task/{t}/status"):
                if line.startswith("voluntary_ctxt_switches"):
                    n += int(line.split()[1])
        except FileNotFoundError:  # a worker thread that ended
            pass
    return n


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def counts(d: DaemonProc) -> dict:
    with sqlite3.connect(f"file:{d.state_dir / 'colo.db'}?mode=ro", uri=True) as db:
        return dict(db.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())


def measure(root: Path, case: str, n: int, seconds: float, settle: float, before: Path | None) -> dict:
    state = root / "fake.state"
    fakegpu.create(state, count=8, mem=16 * GiB)
    # the earlier checkout's colo comes first on the path, and nothing of this one's folder is on it
    env = {"PYTHONPATH": str(before)} if before else {}
    cwd = os.getcwd()
    os.chdir("/")
    try:
        (root / "d").mkdir()  # one user queues them all: past the default max_queued_per_user (10,000)
        d = DaemonProc(root / "d", state, config={"sample_interval": 1.0, "max_queued_per_user": max(10000, n)}, env=env).start()
    finally:
        os.chdir(cwd)
    c = d.client
    try:
        if case == "running":
            hogs = [c.submit({"argv": ["sleep", "3600"], "gpus": 1, "gpu_mem": 16 * GiB, "workdir": "/tmp",
                              "name": f"hog{i}"})["id"] for i in range(8)]
            wait_for(lambda: all(c.show(h)["state"] == "running" for h in hogs), 120, "the 8 jobs to run")
        left = n
        while left:
            k = min(ARRAY, left)
            c.submit({"argv": ["true"], "gpus": 1, "gpu_mem": 8 * GiB, "workdir": "/tmp",
                      **({"hold": True} if case == "held" else {}), **({"array": f"0-{k - 1}"} if k > 1 else {})})
            left -= k
        want = {"running": 8, "queued": n} if case == "running" else {"queued": n}
        wait_for(lambda: counts(d) == want, 300, f"{want}")
        time.sleep(settle)  # the passes the fill made due are over (the once-a-minute one included)
        passes = d.log.read_text().count("scheduler pass (full)")
        pid = d.proc.pid
        c0, s0, t0 = cpu_s(pid), switches(pid), time.monotonic()
        time.sleep(seconds)
        dt = time.monotonic() - t0
        out = {"cpu_pct": 100 * (cpu_s(pid) - c0) / dt, "wakeups_s": (switches(pid) - s0) / dt,
               "rss_mib": rss_mib(pid), "full_passes": d.log.read_text().count("scheduler pass (full)") - passes}
        if counts(d) != want:
            raise SystemExit(f"{case}-{n}: the jobs changed while idle: {counts(d)}")
        return out
    finally:
        # The queue stays queued: drained GPUs start nothing as the 8 end (else up to 50,000 `true`
        # jobs would run), and the daemon is stopped with its queue in place (the harness's stop
        # cancels every open job, a request each).
        if case == "running":
            c.drain([str(i) for i in range(8)], "idle_bench: the measure is over")
            for j in c.ls(all=False, states=["running"]):
                c.cancel(j["id"])
            wait_for(lambda: not c.ls(all=False, states=["running", "starting"]), 120, "the 8 jobs to end")
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(60)
        if p := daemon_log_problems(d.log):
            raise SystemExit(f"{case}-{n}: daemon log: {p[:3]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queued", default="100,10000")
    ap.add_argument("--big", action="store_true", help="also 50,000 held")
    ap.add_argument("--seconds", type=float, default=65.0)
    ap.add_argument("--settle", type=float, default=75.0, help="seconds between the fill and the measure")
    ap.add_argument("--before", type=Path)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rep = Report("idle_bench")
    sizes = [int(q) for q in args.queued.split(",")] + ([50000] if args.big else [])
    cases = [(case, n) for n in sizes for case in ("held", "running")]
    for case, n in cases:
        what = f"{n:,} held, nothing running" if case == "held" else f"8 running on 8 GPUs, {n:,} queued"
        got = {}
        for who, src in (("before", args.before), ("this", None)) if args.before else (("this", None),):
            got[who] = measure(Path(tempfile.mkdtemp(prefix="colo-idle-")), case, n, args.seconds, args.settle, src)
            rep.note(f"{case}-{n} {who}: " + ", ".join(f"{k} {v:.3g}" for k, v in got[who].items()))
        b = got.get("before")
        for k, unit, label in (("cpu_pct", "%", "CPU, % of a core"), ("wakeups_s", "/s", "wake-ups a second"),
                               ("rss_mib", "MiB", "RSS"), ("full_passes", "", "full passes logged")):
            rep.figure(f"{case}_{n}_{k}", f"idle daemon {label}, {what}", got["this"][k], unit,
                       b[k] if b else None, "the --before checkout's" if b else "", f"over {args.seconds:g} s")
    return rep.finish(args.json_out)


if __name__ == "__main__":
    sys.exit(main())
