"""A queue that stays fast (issues 12.5 and 18.3), measured side by side in one run: the same
daemon figures with 100 and with 10,000 jobs queued (and 50,000 with --big).

For each queue length N: a real daemon on 8 simulated 16 GiB GPUs, 8 running jobs that hold every
GPU, then N GPU jobs queued through real submits from 10 concurrent clients, each its own Unix
user (colotest1..10; created when run as root). Then, with N queued:
- submit rate while filling, per 5,000 submits (per N when N is smaller), and for the whole fill;
- one more submit's daemon round trip (median of 20);
- the daemon's CPU while idle (nothing changes for 65 s, which holds one pass over every queued
  job: it runs once a minute, in slices), in % of one core; meanwhile a client asks `hello` every
  20 ms: the longest round trip is how long a request waited behind the daemon's own work;
- `colo ls` wall time, piped (median of 5; prints every queued job), beside `python3 -c pass`,
  with the CPU it took in the command and in the daemon; `colo ls -q` (ids only); `colo ls` on a
  terminal (a pty: what a person waits for, a screenful or the terminal's bound);
- the scheduler pass after one running job ends (16 GiB freed: some queued jobs start, the rest
  wait), as the daemon logs it (the starts of the jobs it chose included; and the part before
  them), the median of the first 3 passes that start jobs (after the end, then after the ends
  of the jobs they started), with how many jobs it planned before it stopped; and the
  once-a-minute pass over every queued job;
- the daemon's RSS;
- with --ls-load: while a client fetches `ls --json` of every open job (3 times), and then the
  full `colo ls` reply (its fields, every job; 3 times), a second process asks `hello` every 5 ms:
  its longest and median round trip, and the daemon loop's longest stall (from a select() to the
  next, bench/loopwatch.py, in wall time and in the loop thread's CPU time), beside the fetch's wall
  time. --ls-only measures only that (and the fill), for before/after pairs: --before-daemon DIR
  runs the same on a daemon of another checkout (DIR: its source tree, e.g. from `git archive`),
  on a queue filled alike, first at the first size, second at the next and so on (--after-first:
  the other way), and says which ran first: the second of a pair was the slower in every fetch.
Every figure is refused unless the work happened: all N submits stored and queued behind the 8
running jobs, a pass over every queued job was logged, and the pass after the end saw the whole
queue and started jobs out of it.

Run (as root): python bench/queue_bench.py [--big] [--clients 10] [--before PYTHON]
                                           [--ls-load] [--ls-only] [--before-daemon DIR [--after-first]]
                                           [--json-out bench/results/queue_bench.json]
(--before: the python of another checkout's venv, whose `colo ls` is timed beside this one's)
"""
from __future__ import annotations

import argparse
import json
import os
import pty
import re
import resource
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report, daemon_log_problems  # noqa: E402
from harness.users import ensure_users, shared_root, spread  # noqa: E402

from harness.daemon import DaemonProc, wait_for  # noqa: E402

from colo.node import fakegpu  # noqa: E402
from colo.client import Client, ClientError  # noqa: E402

GiB = 1 << 30
GPUS = 8  # simulated 16 GiB GPUs, each held by one running job while the queue fills
CHUNK = 5000
IDLE_S = 65.0
# the pass's whole time (the starts of the jobs it chose included), and its part before the starts
PASS_RE = re.compile(r"scheduler pass \(full\): (\d+) queued, (\d+) planned, (\d+) started, ([\d.]+) ms"
                     r"(?: \(([\d.]+) ms before the starts\))?")
PASSES = 3  # after one running job ends: the first passes that start jobs (the jobs they start end at once)
SLICES_RE = re.compile(r"complete in (\d+) slices, the longest ([\d.]+) ms(?: \(its settle ([\d.]+) ms\))?")


def probe(c: Client, stop, out: list[float]) -> None:
    """`hello` round trips every 20 ms until `stop` is set (a thread)."""
    while not stop.is_set():
        t = time.perf_counter()
        c.hello()
        out.append(time.perf_counter() - t)
        stop.wait(0.02)


# `hello` every 5 ms from a process of its own (a thread here would share this process's
# interpreter with the decoding of a 25 MB `ls --json` reply, and wait on that): "ready" once it
# is answered, then until its stdin ends; then its round trips (seconds, JSON) on stdout
PROBER = """
import json, sys, threading, time
from colo.client import Client
c, out, stop = Client(sys.argv[1], timeout=120), [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
c.hello()
print("ready", flush=True)
while not stop.is_set():
    t = time.perf_counter()
    c.hello()
    out.append(time.perf_counter() - t)
    stop.wait(0.005)
print(json.dumps(out))
"""


class Watched(DaemonProc):
    """A DaemonProc under bench/loopwatch.py; with `checkout`, that source tree's colo (PYTHONPATH)."""

    def __init__(self, *a, checkout: Path | None = None, **kw):
        super().__init__(*a, **kw)
        self.checkout, self.watch = checkout, self.root / "loop.json"

    def env(self) -> dict:
        e = super().env()
        if self.checkout is not None:
            e["PYTHONPATH"] = str(self.checkout)
        return e

    def argv(self) -> list[str]:
        return [sys.executable, str(checkout.BENCH / "loopwatch.py"), str(self.watch), *super().argv()[3:]]

    def start(self) -> "Watched":
        super().start(cwd=str(self.checkout or "/"))
        where = subprocess.run([sys.executable, "-c", "import colo; print(colo.__file__)"], capture_output=True,
                               text=True, env=self.env(), cwd="/").stdout.strip()
        if self.checkout is not None and not where.startswith(str(self.checkout)):
            raise SystemExit(f"--before-daemon: its colo is not the one imported ({where})")
        return self

    def stalls(self) -> dict:
        """The loop's figures since the last call (bench/loopwatch.py), and the watch started afresh."""
        old = self.watch.stat().st_mtime_ns if self.watch.exists() else 0
        os.kill(self.proc.pid, signal.SIGUSR2)
        wait_for(lambda: self.watch.exists() and self.watch.stat().st_mtime_ns != old, 60, "the loop's figures")
        got = json.loads(self.watch.read_text())
        os.kill(self.proc.pid, signal.SIGUSR1)
        return got


def ls_load(d: Watched, n: int, rounds: int = 3) -> dict:
    """`ls --json` of every open job, then the full `colo ls` reply, each `rounds` times, while
    another process asks `hello` every 5 ms: wall times, hello round trips, the loop's stalls."""
    c = Client(d.socket, timeout=300)
    fields = ["id", "name", "user", "state", "gpus", "mode", "budget", "submitted_at", "reason"]
    out = {}
    for kind, ask, count in (("json", lambda: c.ls(all=False), len),
                             ("fields", lambda: c.ls_fields(fields, all=False, cut=60), lambda r: len(r["rows"]))):
        d.stalls()  # (started afresh)
        p = subprocess.Popen([sys.executable, "-c", PROBER, str(d.socket)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=d.env(), cwd="/")
        if p.stdout.readline().strip() != "ready":
            raise SystemExit("the hello prober did not start")
        walls = []
        for _ in range(rounds):
            t = time.perf_counter()
            got = ask()
            walls.append(time.perf_counter() - t)
            if count(got) != n + 8:
                raise SystemExit(f"N={n}: ls ({kind}) returned {count(got)} jobs, not {n + 8}")
            del got
        hellos = json.loads(p.communicate("", timeout=120)[0])
        loop = d.stalls()
        out[kind] = {"walls": walls, "hello_max_s": max(hellos), "hello_p50_s": statistics.median(hellos),
                     "hellos": len(hellos), "stall_ms": loop["wall"], "stall_cpu_ms": loop["cpu"],
                     "over10": loop["over10"], "over50": loop["over50"], "wakes": loop["n"], "loop": loop}
    out["load"] = os.getloadavg()
    return out


def cpu_s(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def timed(cmd: list[str], n: int, env=None, cwd: str | None = None) -> list[float]:
    return timed_cpu(cmd, n, env, cwd=cwd)[0]


def timed_cpu(cmd: list[str], n: int, env=None, pid: int | None = None,
              cwd: str | None = None) -> tuple[list[float], list[float], float]:
    """Wall times, the command's CPU seconds (user + system) each run, and the CPU seconds of
    process `pid` (the daemon) per run."""
    walls, cpus = [], []
    d0 = cpu_s(pid) if pid else 0.0
    for _ in range(n):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=cwd)
        walls.append(time.perf_counter() - t)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    return walls, cpus, ((cpu_s(pid) - d0) / n if pid else 0.0)


def timed_tty(cmd: list[str], n: int, env=None) -> tuple[list[float], int]:
    """Wall times of `cmd` printing to a terminal (a pty, read as fast as it writes), and how many
    lines it printed."""
    walls, lines = [], 0
    for _ in range(n):
        master, slave = pty.openpty()
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.DEVNULL, env=env)
        os.close(slave)
        data = []
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the command closed the terminal
                break
            if not chunk:
                break
            data.append(chunk)
        p.wait()
        walls.append(time.perf_counter() - t)
        os.close(master)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} on a terminal exited {p.returncode}")
        lines = b"".join(data).count(b"\n")
    return walls, lines


def fill(d: DaemonProc, users: list, n: int) -> tuple[list[float], float]:
    """n queued GPU jobs from len(users) clients; returns each submit's completion time (sorted,
    from the start) and the wall time."""

    def client_fn(k: int, m: int):
        def fn():
            c = Client(d.socket, timeout=120)
            done = []
            for i in range(m):
                c.submit({"argv": ["true"], "gpus": 1, "gpu_mem": (1 + (i + k) % 8) * GiB,
                          "workdir": "/tmp", "name": f"q{k}-{i}"})
                done.append(time.time())
            return done
        return fn

    peers = spread(users, n, client_fn)
    t0 = time.time()
    for p in peers:
        p.go()
    done = sorted(t - t0 for p in peers for t in p.result())
    return done, time.time() - t0


def run_one(root: Path, n: int, users: list, before_py: str | None = None, k: int = 0, ls: str = "",
            checkout: Path | None = None) -> dict:
    """ls: "" (no ls load), "also" (--ls-load), "only" (--ls-only: the fill and the ls load)."""
    tag = "before" if checkout else "after"
    state = root / f"fake-{n}-{k}-{tag}.state"
    fakegpu.create(state, count=GPUS, mem=16 * GiB)
    (root / f"d{n}-{k}-{tag}").mkdir()
    d = Watched(root / f"d{n}-{k}-{tag}", state, config={"sample_interval": 1.0, "hold_after": 0,
                                                           "max_queued_per_user": 0}, checkout=checkout).start()
    c = d.client
    hogs: list[int] = []
    try:
        hogs = [c.submit({"argv": ["sleep", "3600"], "gpus": 1, "gpu_mem": 16 * GiB,
                          "workdir": "/tmp", "name": f"hog{i}"})["id"] for i in range(GPUS)]
        wait_for(lambda: all(c.show(h)["state"] == "running" for h in hogs), 60, "the hogs to run")
        done, wall = fill(d, users, n)
        with sqlite3.connect(f"file:{d.state_dir / 'colo.db'}?mode=ro", uri=True) as db:
            states = dict(db.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())
        if states.get("queued") != n or states.get("running") != 8 or len(states) != 2:
            raise SystemExit(f"N={n}: the fill did not leave {n} queued behind 8 running: {states}")
        loaded = ls_load(d, n) if ls else None
        if ls == "only":
            return {"n": n, "fill_rate": n / wall, "ls_load": loaded, "rss_mb": rss_mb(d.proc.pid)}
        chunk = min(CHUNK, n)
        rates, last = [], 0.0
        for i in range(chunk, n + 1, chunk):
            rates.append(chunk / (done[i - 1] - last))
            last = done[i - 1]
        lat = []
        for i in range(20):
            t = time.perf_counter()
            lat.append(c.submit({"argv": ["true"], "gpus": 1, "gpu_mem": 8 * GiB,
                                 "workdir": "/tmp", "name": f"probe{i}"}))
            lat[-1] = time.perf_counter() - t
        time.sleep(3)  # the probes' passes are over
        pid = d.proc.pid
        import threading

        stop, hellos = threading.Event(), []
        prober = threading.Thread(target=probe, args=(Client(d.socket, timeout=120), stop, hellos))
        c0, t0 = cpu_s(pid), time.monotonic()
        prober.start()
        time.sleep(IDLE_S)  # long enough to hold one pass over every queued job (every 60 s)
        stop.set()
        prober.join()
        idle = 100 * (cpu_s(pid) - c0) / (time.monotonic() - t0)
        slices = [(int(a), float(b), float(c) if c else None) for a, b, c in SLICES_RE.findall(d.log.read_text())]
        ls_cmd = [sys.executable, "-m", "colo", "ls"]
        if "--active" in subprocess.run([*ls_cmd, "--help"], capture_output=True, text=True, env=d.env()).stdout:
            ls_cmd.append("--active")  # else queued and running jobs are what it lists by default
        # round by round, so that load on the machine hits every command alike; an earlier colo (its
        # own interpreter and checkout) beside, on this daemon, run from / so that `-m colo` does not
        # find this checkout's colo in the current folder
        ls, ls_cpu, ls_dcpu, ls_q, ls_tty, ls_b, ls_qb = [], [], [], [], [], [], []
        for _ in range(5):
            w, cpu, dcpu = timed_cpu(ls_cmd, 1, d.env(), pid)
            ls += w
            ls_cpu += cpu
            ls_dcpu.append(dcpu)
            ls_q += timed([*ls_cmd, "-q"], 1, d.env())
            w, tty_lines = timed_tty(ls_cmd, 1, d.env())
            ls_tty += w
            if before_py:
                ls_b += timed([before_py, "-m", "colo", "ls"], 1, d.env(), "/")
                ls_qb += timed([before_py, "-m", "colo", "ls", "-q"], 1, d.env(), "/")
        ls_dcpu = statistics.median(ls_dcpu)
        ls_b, ls_qb = ls_b or [0.0], ls_qb or [0.0]
        ls_rt = []
        # the daemon's reply to what `colo ls` asks for (only the fields it prints, where it can)
        fields = ["id", "name", "user", "state", "gpus", "mode", "budget", "submitted_at", "reason"]
        ask = ((lambda: c.ls_fields(fields, all=False, cut=60)) if hasattr(c, "ls_fields")
               else (lambda: c.ls(all=False)))
        for _ in range(5):
            t = time.perf_counter()
            ask()
            ls_rt.append(time.perf_counter() - t)
        got = c.ls(all=False)
        if len(got) != n + 28:
            raise SystemExit(f"N={n}: ls returned {len(got)} jobs, not {n + 28}")
        bare = statistics.median(timed([sys.executable, "-c", "pass"], 5))
        out = subprocess.run(ls_cmd, capture_output=True, text=True, env=d.env(), check=True).stdout
        if out.count("\n") < n + 28:
            raise SystemExit(f"N={n}: colo ls --active printed {out.count(chr(10))} lines, not all {n + 28} jobs")
        rss = rss_mb(pid)
        log = PASS_RE.findall(d.log.read_text())
        complete = [float(x[3]) for x in log if int(x[0]) >= n and int(x[1]) >= n]
        if not complete:
            raise SystemExit(f"N={n}: no pass over every queued job in the log")
        before = len(log)
        c.cancel(hogs[0])  # 16 GiB free on one GPU: a full pass starts jobs out of the queue
        firsts = wait_for(lambda: len(s := [x for x in PASS_RE.findall(d.log.read_text())[before:] if int(x[2])])
                          >= PASSES and s[:PASSES], 60 + 4 * PASSES, f"{PASSES} full passes that start jobs")
        first = sorted(firsts, key=lambda x: float(x[3]))[len(firsts) // 2]  # the median pass
        # what a start costs in the pass (its state change, neighbour rows, launch task), per job started
        per_start = statistics.median((float(x[3]) - float(x[4])) / int(x[2]) for x in firsts if x[4])
        problems = daemon_log_problems(d.log)
        if problems:
            raise SystemExit(f"N={n}: the daemon logged problems: {problems[:3]}")
        if int(firsts[0][0]) < n:
            raise SystemExit(f"N={n}: the pass after the end did not see the whole queue: {firsts}")
        return {"n": n, "fill_rate": n / wall, "rates": rates, "submit_ms": 1000 * statistics.median(lat),
                "idle_pct": idle, "ls_s": statistics.median(ls), "ls_cpu_s": statistics.median(ls_cpu),
                "ls_daemon_cpu_s": ls_dcpu, "ls_q_s": statistics.median(ls_q), "ls_tty_s": statistics.median(ls_tty),
                "tty_lines": tty_lines, "ls_before_s": statistics.median(ls_b), "ls_q_before_s": statistics.median(ls_qb),
                "pass_ms": float(first[3]), "per_start_ms": per_start, "plan_ms": float(first[4]) if first[4] else None,
                "planned": int(first[1]), "started": int(first[2]), "complete_ms": statistics.median(complete),
                "rss_mb": rss, "ls_rt_s": statistics.median(ls_rt), "bare_s": bare,
                "hello_max_s": max(hellos), "hello_p50_s": statistics.median(hellos), "hellos": len(hellos),
                "slices": slices[-1][0] if slices else 1, "slice_ms": slices[-1][1] if slices else None,
                "settle_ms": slices[-1][2] if slices else None,
                "ls_load": loaded}
    finally:
        if ls == "only":  # the hogs only: once one ends, queued jobs start (and end) for as long as any is left
            for h in hogs:
                try:
                    c.cancel(h)
                except ClientError:
                    pass
            wait_for(lambda: all(c.show(h)["state"] not in ("starting", "running") for h in hogs), 120,
                     "the hogs to stop")
        else:
            # only the running jobs are cancelled (cancelling every queued one would be the slow part),
            # the GPUs drained first: else each cancel lets a queued job start, 50,000 of them in turn
            c.drain([str(i) for i in range(GPUS)], "queue_bench: the end of a run")
            for j in c.ls(all=False):
                if j["state"] in ("starting", "running"):
                    try:
                        c.cancel(j["id"])
                    except ClientError:
                        pass  # it ended meanwhile
            wait_for(lambda: not [j for j in c.ls(all=False) if j["state"] in ("starting", "running")], 120,
                     "running jobs to stop")
        d.proc.terminate()
        d.proc.wait(120)


def before_commit(python: str) -> str:
    """The commit of the checkout the earlier colo is imported from."""
    where = subprocess.run([python, "-c", "import colo, os; print(os.path.dirname(colo.__file__))"],
                           capture_output=True, text=True, cwd="/").stdout.strip()
    return subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "?"


def ls_figures(rep: Report, n: int, a: dict, b: dict | None, before: str = "") -> None:
    """The ls load's figures at n queued (b: the earlier daemon's, on a queue filled alike)."""
    for kind, what in (("json", "`ls --json` of every open job"), ("fields", "the full `colo ls` reply")):
        x, y = a[kind], (b or {}).get(kind)
        rep.figure(f"ls_{kind}_stall_{n}", f"{what} at {n:,} queued: the loop's longest stall, wall",
                   x["stall_ms"], "ms", y and y["stall_ms"], before,
                   note=f"CPU {x['stall_cpu_ms']:.1f} ms; stalls > 10 ms: {x['over10']}, > 50 ms: {x['over50']}"
                   + (f" (before: CPU {y['stall_cpu_ms']:.1f} ms; {y['over10']}, {y['over50']})" if y else "")
                   + f"; the longest callback {x['loop']['callback']:.1f} ms: {x['loop']['which'][:90]}"
                   + f"; the longest collection {x['loop']['gc']:.1f} ms (generation {x['loop']['gc_gen']})")
        rep.figure(f"ls_{kind}_hello_{n}", "  `hello` every 5 ms meanwhile, longest round trip", x["hello_max_s"], "s",
                   y and y["hello_max_s"], before,
                   note=f"{x['hellos']} asked, median {x['hello_p50_s'] * 1000:.1f} ms"
                   + (f" (before: {y['hellos']}, median {y['hello_p50_s'] * 1000:.1f} ms)" if y else ""))
        rep.figure(f"ls_{kind}_wall_{n}", "  the fetch, wall (median of 3, client decoding included)",
                   statistics.median(x["walls"]), "s", y and statistics.median(y["walls"]), before)
    rep.note(f"{n:,} queued, load average during the ls load: after {a['load'][0]:.2f}"
             + (f", before {b['load'][0]:.2f}" if b else ""))


def ls_only(rep: Report, root: Path, sizes: list[int], users: list, args) -> int:
    """--ls-only: for each size, the earlier daemon (--before-daemon) then this one, each on a queue
    filled alike; their ls load's figures side by side."""
    before = ""
    if args.before_daemon:
        before = "the daemon of " + (subprocess.run(["git", "-C", str(args.before_daemon), "rev-parse", "--short",
                                                     "HEAD"], capture_output=True, text=True).stdout.strip()
                                     or str(args.before_daemon))
    for k, n in enumerate(sizes):
        # the second daemon of a pair was the slower in every fetch of the runs so far (the machine's
        # caches, the first's leftovers): the order turns from size to size, --after-first flips it
        after_first = bool(args.before_daemon) and (k % 2 == 1) != args.after_first
        try:
            a = run_one(root, n, users, None, k, "only") if after_first else None
            b = run_one(root, n, users, None, k, "only", args.before_daemon) if args.before_daemon else None
            a = a or run_one(root, n, users, None, k, "only")
        except SystemExit as e:
            rep.check(False, str(e))
            return rep.finish(args.json_out)
        ls_figures(rep, n, a["ls_load"], b and b["ls_load"], before)
        if b:
            rep.note(f"{n:,} queued: {'this daemon' if after_first else before} ran first")
        rep.figure(f"rss_{n}", f"daemon RSS at {n:,} queued after the ls load", a["rss_mb"] * 2**20, "B",
                   b and b["rss_mb"] * 2**20, before)
    return rep.finish(args.json_out)


def main() -> int:
    global PASSES
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="also 50,000 queued")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--passes", type=int, default=PASSES, help="passes that start jobs after the end, "
                    "the median taken")
    ap.add_argument("--sizes", type=str, default=None, help="comma-separated queue lengths (default 100,10000)")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--before", type=str, default=None, metavar="PYTHON",
                    help="an interpreter whose `-m colo` is an earlier colo: its `colo ls` and `ls -q` are timed "
                    "beside this one's, on the same daemon and queue")
    ap.add_argument("--ls-load", action="store_true", help="also `ls --json` and the full `colo ls` of every job "
                    "under a `hello` probe every 5 ms, with the daemon loop's longest stall")
    ap.add_argument("--ls-only", action="store_true", help="only the fill and that")
    ap.add_argument("--before-daemon", type=Path, default=None, metavar="DIR",
                    help="with --ls-only: a source tree of an earlier colo whose daemon is measured alike, first "
                    "at the first size, second at the next, and so on")
    ap.add_argument("--after-first", action="store_true", help="with --before-daemon: this daemon first at the "
                    "first size (a size measured both ways: run twice, with and without)")
    args = ap.parse_args()
    if args.before_daemon and not args.ls_only:
        raise SystemExit("--before-daemon goes with --ls-only")
    if os.geteuid() != 0:
        raise SystemExit("run as root: the clients are real users")
    PASSES = args.passes
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else [100, 10000] + ([50000] if args.big else [])
    rep = Report("queue_bench")
    users = ensure_users(args.clients)
    root = shared_root("colo-queue-bench-")
    res: list[dict] = []
    if args.ls_only:
        return ls_only(rep, root, sizes, users, args)
    for k, n in enumerate(sizes):  # a size given twice runs twice (the second is then set beside the first)
        try:
            res.append(run_one(root, n, users, args.before, k, "also" if args.ls_load else ""))
            r = res[-1]
            rep.note(f"run {k + 1}, {n:,} queued: pass after a job ends {r['pass_ms']:.1f} ms "
                     f"({r['plan_ms'] or 0:.1f} ms before the starts), {r['planned']} planned, {r['started']} started; "
                     f"per job started, median of {PASSES} passes: {r['per_start_ms']:.2f} ms")
        except SystemExit as e:  # the work did not happen as intended: no figures
            rep.check(False, str(e))
            return rep.finish(args.json_out)
    b, bn = res[0], f"{sizes[0]:,} queued" + (" (its first run)" if sizes[0] in sizes[1:] else "")
    for n, r in zip(sizes[1:], res[1:]):
        at = f"{n:,} queued"
        rep.figure(f"fill_{n}", f"submits/s, {args.clients} clients filling to {at}", r["fill_rate"], "/s",
                   b["fill_rate"], f"filling to {bn}")
        rep.figure(f"submit_{n}", f"submit round trip at {at} (median of 20)", r["submit_ms"], "ms",
                   b["submit_ms"], bn)
        rep.figure(f"idle_{n}", f"daemon CPU at {at} while `hello` is asked every 20 ms, % of a core (the probe's own cost: "
                   "bench/idle_bench.py measures an idle daemon)", r["idle_pct"], "%",
                   b["idle_pct"], bn)
        rep.figure(f"ls_{n}", f"colo ls (queued and running), piped: every job, at {at}, wall (aim < 0.3 s)",
                   r["ls_s"], "s", b["ls_s"], bn, note=f"python3 -c pass: {r['bare_s'] * 1000:.0f} ms")
        rep.figure(f"ls_cpu_{n}", "  its CPU (user + system) in the command", r["ls_cpu_s"], "s", b["ls_cpu_s"], bn)
        rep.figure(f"ls_dcpu_{n}", "  its CPU in the daemon", r["ls_daemon_cpu_s"], "s", b["ls_daemon_cpu_s"], bn)
        rep.figure(f"ls_rt_{n}", "  the daemon's reply alone (a client in this process)", r["ls_rt_s"], "s",
                   b["ls_rt_s"], bn)
        rep.figure(f"ls_q_{n}", f"colo ls -q (ids) at {at}, wall", r["ls_q_s"], "s", b["ls_q_s"], bn)
        if args.before:
            rep.figure(f"ls_vs_before_{n}", f"colo ls, piped, at {at}: this colo vs the earlier one", r["ls_s"], "s",
                       r["ls_before_s"], f"the earlier colo ({before_commit(args.before)}), same daemon and queue")
            rep.figure(f"ls_q_vs_before_{n}", f"colo ls -q at {at}: this colo vs the earlier one", r["ls_q_s"], "s",
                       r["ls_q_before_s"], f"the earlier colo ({before_commit(args.before)})")
        rep.figure(f"ls_tty_{n}", f"colo ls on a terminal at {at}, wall", r["ls_tty_s"], "s", b["ls_tty_s"], bn,
                   note=f"{r['tty_lines']:,} lines printed")
        rep.figure(f"pass_{n}", f"pass after a job ends at {at}, starts included (aim < 20 ms)", r["pass_ms"], "ms", b["pass_ms"], bn,
                   note=f"{r['planned']} planned, {r['started']} started")
        if r["plan_ms"] is not None and b["plan_ms"] is not None:
            rep.figure(f"pass_plan_{n}", "  of which before its starts", r["plan_ms"], "ms", b["plan_ms"], bn)
        rep.figure(f"complete_{n}", f"pass over every queued job at {at} (1/min)", r["complete_ms"], "ms",
                   b["complete_ms"], bn)
        rep.figure(f"rss_{n}", f"daemon RSS at {at} (aim < 150 MB)", r["rss_mb"] * 2**20, "B", b["rss_mb"] * 2**20, bn)
        rep.figure(f"hello_{n}", f"`hello` round trip every 20 ms over the idle 65 s at {at}, max (aim < 50 ms)",
                   r["hello_max_s"], "s", b["hello_max_s"], bn,
                   note=f"{r['hellos']} asked, median {r['hello_p50_s'] * 1000:.1f} ms")
        if r["slice_ms"] is not None:
            rep.figure(f"slice_{n}", f"  the pass over every queued job: its longest slice at {at}", r["slice_ms"],
                       "ms", b["slice_ms"] or b["complete_ms"], bn,
                       note=f"{r['slices']} slices" + (f", its settle {r['settle_ms']:.1f} ms" if r.get("settle_ms") is not None else ""))
    for n, r in zip(sizes, res):
        if r["ls_load"]:
            ls_figures(rep, n, r["ls_load"], None)
        rep.note(f"submits/s per {min(CHUNK, n):,} while filling to {n:,}: "
                 + ", ".join(f"{x:.0f}" for x in r["rates"]))
    rep.note(f"python3 -c pass: {res[0]['bare_s'] * 1000:.0f} ms (what the `colo ls` wall time starts from)")
    return rep.finish(args.json_out)


if __name__ == "__main__":
    os.environ.pop("COLO_FAKEGPU_STATE", None)
    sys.exit(main())
