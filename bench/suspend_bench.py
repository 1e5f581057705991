"""colo suspend on the simulated driver (issue 40's aims), figures side by side in one run.

1. Latency: an idle holder (idle_jobs = "suspend") and a job that waits for its memory, CYCLES
   times: seconds from the holder's suspend (its event) to the waiting job's start (aim: 5 s), and
   from the moment memory is free again (the waiting job's end) to the holder's blocked CUDA call
   returning (aim: 2 s; the real driver adds its copy time).
2. Churn: JOBS holders, CHURN rounds of suspend / resume-on-use of random ones, the daemon killed
   -9 at random points (KILL_P a round) and started again. Afterwards: jobs lost (not running),
   wrong results (a call that answered an error), processes the driver reports LOCKED (stuck).
3. Sessions (the issue's node): 2 simulated GPUs of 16 GiB, SESSIONS idle sessions of 8 GiB (the
   first 4 hold all of it), a queue of 8 GiB jobs: how long the queue takes with idle_sessions =
   "off" (plain waiting), "notify" (told; the queue still waits for the sessions to end) and
   "suspend", side by side.

Run: python bench/suspend_bench.py [--cycles 10] [--jobs 10] [--churn 200] [--kill-p 0.2] [--seed 40]
     [--queue 8] [--sessions 6] [--limit 60] [--only sessions|latency|churn ...]
(as root: jobs run as root here; the tests run them as other users).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
import checkout  # noqa: E402
checkout.use_harness()

from harness.daemon import DaemonProc, wait_for  # noqa: E402

from colo.client import ClientError  # noqa: E402
from colo.node import fakegpu, native  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
TERMINAL = {"succeeded", "failed", "cancelled", "lost"}
HOLDER = HERE.parent / "tests" / "suspend_holder.py"


def node(mem: int, config: dict, count: int = 1) -> tuple[DaemonProc, Path]:
    root = Path(tempfile.mkdtemp(prefix="colo-suspend-bench-"))
    root.chmod(0o755)
    state = root / "fakegpu" / "state"
    state.parent.mkdir()
    fakegpu.create(state, count=count, mem=mem)
    return DaemonProc(root, state, {"suspend_host_share": 1.0, **config}).start(), root


def holder(d: DaemonProc, work: Path, mib: int, budget: int, name: str, interactive: bool = False) -> int:
    work.mkdir(mode=0o777, exist_ok=True)
    spec = {"argv": [sys.executable, str(HOLDER), str(mib), str(work)], "gpus": 1, "gpu_mem": budget,
            "name": name, "workdir": "/tmp", "interactive": interactive}
    job = d.client.submit(spec)["id"]
    wait_for(lambda: (work / "ready").exists(), 120, f"{name} to allocate")
    return job


def poke(work: Path, n: int) -> None:
    (work / f"poke-{n}").touch()


def answered(work: Path, n: int) -> str | None:
    p = work / f"done-{n}"
    return p.read_text() if p.exists() else None


def event_at(d: DaemonProc, job: int, prefix: str) -> float | None:
    ats = [e["at"] for e in d.client.show(job)["events"] if e["reason"].startswith(prefix)]
    return ats[-1] if ats else None


def latency(cycles: int) -> dict:
    d, root = node(4 * GiB, {"idle_jobs": "suspend", "idle_after": 1.0})
    try:
        work = root / "h"
        h = holder(d, work, 2048, 3 * GiB, "holder")
        start_after, resume_after = [], []
        for k in range(1, cycles + 1):
            wait_for(lambda: "idle" in d.client.show(h)["reason"] and not d.client.show(h)["suspended"], 120,
                     "the holder to be idle again")
            w = d.client.submit({"argv": ["sleep", "1"], "gpus": 1, "gpu_mem": 3 * GiB, "name": f"w{k}",
                                 "workdir": "/tmp"})["id"]
            j = d.wait_state(w, "running", "succeeded", timeout=120)
            susp = event_at(d, h, "suspended by")
            start_after.append(j["started_at"] - susp)
            poke(work, k)  # blocks at the gate: its resume waits for the memory w holds
            ended = d.wait_state(w, "succeeded", "failed", timeout=120)["ended_at"]
            wait_for(lambda: answered(work, k), 120, "the holder's call to return")
            resume_after.append(time.time() - ended)  # an upper bound: the file is looked at every 20 ms
        return {"cycles": cycles, "start_after_suspend_s": _stats(start_after),
                "call_returns_after_memory_free_s": _stats(resume_after)}
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def churn(jobs: int, rounds: int, kill_p: float, seed: int) -> dict:
    rnd = random.Random(seed)
    d, root = node(jobs * 320 * MiB, {})
    ckpt = native.ensure_built() / "colo-ckpt"
    try:
        works = [root / f"j{i}" for i in range(jobs)]
        ids = [holder(d, w, 256, 300 * MiB, f"j{i}") for i, w in enumerate(works)]
        asked = [0] * jobs
        kills = wrong = 0
        def kill_soon() -> None:  # at a random point of the step under way (or just after it)
            nonlocal kills
            time.sleep(rnd.uniform(0, 0.3))
            d.kill9()
            kills += 1
            d.start()

        for _ in range(rounds):
            i = rnd.randrange(jobs)
            when = rnd.random() < kill_p and rnd.choice(("suspend", "resume"))
            t = threading.Thread(target=_quiet, args=(lambda: d.client.suspend(ids[i]),))
            t.start()
            if when == "suspend":
                kill_soon()
            t.join()
            asked[i] += 1
            poke(works[i], asked[i])  # its next call: resumes it
            if when == "resume":
                kill_soon()
            out = wait_for(lambda: answered(works[i], asked[i]), 120, f"job {ids[i]}'s call {asked[i]}")
            wrong += out.split()[0] != "0"
        lost = [j for j in ids if d.client.show(j)["state"] != "running"]
        fake = fakegpu.FakeNode(d.fake_state)
        pids = [p["pid"] for dev in fake.read()["devices"] for p in dev["processes"]]  # locked ones are listed
        states = subprocess.run([str(ckpt), "state", *map(str, pids)], capture_output=True, text=True,
                                env=fake.env).stdout.split() if pids else []
        return {"jobs": jobs, "rounds": rounds, "daemon_kills": kills, "lost": len(lost), "wrong_results": wrong,
                "stuck_locked": states[1::2].count("locked")}
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def sessions(policy: str, n: int, queue: int, seconds: float, limit: float) -> dict:
    """The issue's node: 2 GPUs of 16 GiB, `n` idle sessions of 8 GiB (the first 4 hold all of it;
    more wait for memory as sessions do), then `queue` jobs of 8 GiB that run `seconds` each: how
    long the queue takes (None: not done within `limit`) with idle_sessions = policy ("off": plain
    waiting, "notify": told, "suspend")."""
    d, root = node(16 * GiB, {"idle_sessions": policy, "idle_after": 1.0}, count=2)
    try:
        works = [root / f"s{i}" for i in range(n)]
        ss = []
        for i, work in enumerate(works):
            work.mkdir(mode=0o777)
            ss.append(d.client.submit({"argv": [sys.executable, str(HOLDER), str(8192 - 64), str(work)], "gpus": 1,
                                       "gpu_mem": 8 * GiB, "name": f"s{i}", "workdir": "/tmp",
                                       "interactive": True})["id"])
        # the sessions that started hold their memory and are idle (with "suspend", those that
        # waited have started in the memory of suspended ones)
        wait_for(lambda: sum((w / "ready").exists() for w in works) >= (n if policy == "suspend" else min(n, 4)), 120,
                 "the sessions to allocate")
        started_s = [s for s, w in zip(ss, works) if (w / "ready").exists()]
        wait_for(lambda: all("idle" in d.client.show(s)["reason"] or d.client.show(s)["suspended"] for s in started_s),
                 120, "the sessions to be idle")
        t0 = time.time()
        qs = [d.client.submit({"argv": ["sleep", str(seconds)], "gpus": 1, "gpu_mem": 8 * GiB, "name": f"q{k}",
                               "workdir": "/tmp"})["id"] for k in range(queue)]
        try:
            wait_for(lambda: all(d.client.show(q)["state"] in TERMINAL for q in qs), limit, "the queue")
            took = max(d.client.show(q)["ended_at"] for q in qs) - t0
        except AssertionError:
            took = None
        started = sum(d.client.show(q)["started_at"] is not None for q in qs)
        suspended = sum(bool(d.client.show(s)["suspended"]) for s in ss)
        ideal = seconds * -(-queue // 4)  # 4 at once (2 GPUs x 16 GiB) once the sessions are suspended
        return {"idle_sessions": policy, "sessions": n, "sessions_started": len(started_s), "queue": queue,
                "job_seconds": seconds, "queue_done_s": took, "ideal_s": ideal,
                "queue_vs_ideal": round(took / ideal, 2) if took else None, "queued_jobs_started": started,
                "sessions_suspended_at_end": suspended}
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def _quiet(fn) -> None:
    try:
        fn()
    except (ClientError, OSError):
        pass  # refused (being resumed still), or the daemon was killed under it: an answer either way


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": xs[len(xs) // 2], "max": xs[-1]} if xs else {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--churn", type=int, default=200)
    ap.add_argument("--kill-p", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=40)
    ap.add_argument("--queue", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=6, help="idle sessions of 8 GiB on the 2 x 16 GiB node")
    ap.add_argument("--limit", type=float, default=60.0, help="seconds the queue is given in the sessions part")
    ap.add_argument("--only", choices=("sessions", "latency", "churn"), action="append",
                    help="run only these parts (repeatable; default: all)")
    a = ap.parse_args()
    parts = a.only or ["sessions", "latency", "churn"]
    out = {}
    if "sessions" in parts:
        out["sessions"] = [sessions(p, a.sessions, a.queue, 3.0, a.limit) for p in ("off", "notify", "suspend")]
        done = {r["idle_sessions"]: r["queue_done_s"] for r in out["sessions"]}
        print(f"{a.sessions} idle sessions of 8 GiB on 2 x 16 GiB, {a.queue} queued 8 GiB jobs of 3 s (ideal "
              f"{out['sessions'][0]['ideal_s']:g} s): queue done in "
              + ", ".join(f"{p}: {f'{t:.2f} s' if t else f'not in {a.limit:g} s'}" for p, t in done.items()),
              file=sys.stderr)
    if "latency" in parts:
        out["latency"] = latency(a.cycles)
    if "churn" in parts:
        out["churn"] = churn(a.jobs, a.churn, a.kill_p, a.seed)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
