"""colo under load, measured (issue 8). Importable: tests/test_reliability.py runs the same
scenarios at a smaller size and asserts on what they return.

1. Submissions: N submits from C concurrent clients, each a forked child that setuid()s to its
   own user (colotest1..C, created with useradd when run as root), while the parent times
   `ls` every 50 ms. Every submission must be stored once, ids unique.
2. Short jobs: J GPU jobs (`colo-burn`, process runtime, budgets of 128-512 MiB on two 1 GiB
   simulated GPUs, so most wait) back to back. Invariant 1 is checked by replaying the daemon's
   own events table: at every state change, the budgets placed on a GPU fit its usable memory.
   Daemon RSS after a warm-up and at the end.

Run: python bench/load_bench.py [--submits 1000 --clients 10 --jobs 200]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()

from harness.daemon import DaemonProc, wait_for  # noqa: E402
from harness.probes import LsProbe, db_ro, rss_kib  # noqa: E402
from harness.users import ensure_users, shared_root, spread  # noqa: E402

from benchlib import Report  # noqa: E402

from colo.node import fakegpu, native  # noqa: E402
from colo.client import Client  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
TERMINAL = {"succeeded", "failed", "cancelled", "lost"}


# measurements -------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


# scenario 1: concurrent submissions ----------------------------------------------------------------
def submit_load(d: DaemonProc, users: list, total: int) -> dict:
    """`total` submissions spread over len(users) concurrent clients; returns figures and what the db holds."""
    # Every submission waits for `holder`, which is cancelled at the end: no job runs, so the
    # figures are the daemon's own (and the dependents then fail in one scheduler pass).
    holder = d.client.submit({"argv": ["sleep", "3600"], "gpus": 0, "name": "holder"})["id"]

    def client_fn(k: int, n: int):
        def fn():
            c = Client(d.socket, timeout=60)
            out = []
            for i in range(n):
                t = time.perf_counter()
                job = c.submit({"argv": ["true"], "gpus": 0, "name": f"c{k}-{i}", "after": [holder],
                                "workdir": "/tmp"})
                out.append((f"c{k}-{i}", job["id"], job["uid"], time.perf_counter() - t))
            return out
        return fn

    peers = spread(users, total, client_fn)
    probe = LsProbe(d.socket)
    probe.start()
    t0 = time.perf_counter()
    for p in peers:
        p.go()
    results = [r for p in peers for r in p.result()]
    wall = time.perf_counter() - t0
    probe.stop()
    with db_ro(d.state_dir) as db:
        rows = db.execute("SELECT id, json_extract(spec, '$.name'), uid FROM jobs WHERE id != ?", (holder,)).fetchall()
        events = db.execute("SELECT count(*) FROM events WHERE job_id != ?", (holder,)).fetchone()[0]
    d.client.cancel(holder)
    lat = [r[3] for r in results]
    return {
        "submits": len(results), "clients": len(users), "uids": len({r[2] for r in results}), "wall_s": wall,
        "submits_per_s": len(results) / wall, "p50_ms": 1000 * pct(lat, 0.5), "p99_ms": 1000 * pct(lat, 0.99),
        "max_ms": 1000 * max(lat), "ls_n": len(probe.times), "ls_max_ms": 1000 * max(probe.times or [0]),
        "ls_p99_ms": 1000 * pct(probe.times, 0.99), "ls_errors": probe.errors,
        "acked": results, "stored": rows, "submit_events": events, "holder": holder,
    }


def check_submissions(r: dict) -> list[str]:
    """Everything acknowledged is stored exactly once under the id and uid it was acknowledged with."""
    bad = []
    acked = {name: (i, uid) for name, i, uid, _ in r["acked"]}
    stored_names = [name for _, name, _ in r["stored"]]
    if len(acked) != len(r["acked"]):
        bad.append("a name was acknowledged twice")
    if len({i for _, i, _, _ in r["acked"]}) != len(r["acked"]):
        bad.append("an id was handed out twice")
    if len(stored_names) != len(set(stored_names)):
        bad.append("a submission is stored twice")
    stored = {name: (i, uid) for i, name, uid in r["stored"]}
    if stored != acked:
        missing = set(acked) - set(stored)
        extra = set(stored) - set(acked)
        wrong = [n for n in set(acked) & set(stored) if acked[n] != stored[n]]
        bad.append(f"store differs from acks: {len(missing)} missing, {len(extra)} extra, {len(wrong)} wrong")
    if r["submit_events"] != len(r["stored"]):
        bad.append(f"{r['submit_events']} events for {len(r['stored'])} submissions")
    return bad


# scenario 2: short jobs through the queue ----------------------------------------------------------
def short_jobs(d: DaemonProc, n: int, seed: int = 8, warmup: int = 20) -> dict:
    """n GPU jobs of colo-burn through the queue; returns figures, the final rows and RSS samples."""
    rng = random.Random(seed)
    burn = str(native.path("colo-burn"))
    c = Client(d.socket, timeout=60)
    budgets = [128 * MiB, 256 * MiB, 384 * MiB, 512 * MiB]
    ids, rss = [], {}
    t0 = time.perf_counter()
    for i in range(n):
        b = rng.choice(budgets)
        ids.append(c.submit({"argv": [burn, "--mem", "64MiB", "--seconds", "0.05", "--quiet"], "gpus": 1, "gpu_mem": b,
                             "name": f"short-{i}"})["id"])
        if i + 1 == warmup:  # RSS once the daemon has run a few jobs (imports, caches warm)
            wait_for(lambda: all(j["state"] in TERMINAL for j in c.ls() if j["id"] in ids), 120, "warm-up jobs")
            rss["warm"] = rss_kib(d.proc.pid)
    final = wait_for(lambda: (rows := [j for j in c.ls() if j["id"] in ids]) and
                     all(j["state"] in TERMINAL for j in rows) and rows, max(60, n), "all short jobs to end")
    wall = time.perf_counter() - t0
    rss["end"] = rss_kib(d.proc.pid)
    over = occupancy_violations(d.state_dir, {g["uuid"]: g["usable"] for g in c.gpus()["gpus"]})
    states: dict[str, int] = {}
    for j in final:
        states[j["state"]] = states.get(j["state"], 0) + 1
    return {"jobs": n, "wall_s": wall, "jobs_per_s": n / wall, "states": states, "rss_kib": rss,
            "over_commits": over, "peak": _peak_occupancy(d.state_dir)}


def _placements(state_dir: Path) -> tuple[list[tuple[int, int, str]], dict[int, tuple[list[str], int]]]:
    with db_ro(state_dir) as db:
        db.execute("BEGIN")  # events and jobs from one snapshot
        events = db.execute("SELECT id, job_id, new_state FROM events ORDER BY id").fetchall()
        jobs = {i: (json.loads(g), json.loads(s).get("gpu_mem") or 0)
                for i, g, s in db.execute("SELECT id, gpus, spec FROM jobs")}
    return events, jobs


def occupancy_violations(state_dir: Path, usable: dict[str, int]) -> list[str]:
    """Replay the events table in commit order: a job holds its budget on its GPUs from `starting`
    until it leaves the active states. Returns every moment where a GPU's budgets passed usable."""
    events, jobs = _placements(state_dir)
    held: dict[str, int] = {u: 0 for u in usable}
    holding: set[int] = set()
    bad = []
    starts: dict[int, int] = {}
    for _, job_id, new in events:
        if new == "starting":
            starts[job_id] = starts.get(job_id, 0) + 1
    for ev_id, job_id, new in events:
        gpus, mem = jobs[job_id]
        if starts.get(job_id, 0) > 1:
            bad.append(f"job {job_id} started {starts[job_id]} times: its earlier GPUs are not on record")
            starts[job_id] = 0
        if new == "starting" and job_id not in holding:
            holding.add(job_id)
            for g in gpus:
                held[g] = held.get(g, 0) + mem
                if held[g] > usable.get(g, 0):
                    bad.append(f"event {ev_id}: GPU {g[:12]} holds {held[g]} budgeted bytes > usable {usable.get(g)}")
        elif new not in ("starting", "running") and job_id in holding:
            holding.discard(job_id)
            for g in gpus:
                held[g] -= mem
    return bad


def _peak_occupancy(state_dir: Path) -> dict[str, int]:
    events, jobs = _placements(state_dir)
    held: dict[str, int] = {}
    peak: dict[str, int] = {}
    holding: set[int] = set()
    for _, job_id, new in events:
        gpus, mem = jobs[job_id]
        if new == "starting" and job_id not in holding:
            holding.add(job_id)
            for g in gpus:
                held[g] = held.get(g, 0) + mem
                peak[g] = max(peak.get(g, 0), held[g])
        elif new not in ("starting", "running") and job_id in holding:
            holding.discard(job_id)
            for g in gpus:
                held[g] -= mem
    return peak


def hello_times(d: DaemonProc, n: int = 200) -> dict:
    """The protocol's floor: one client's `hello` round trips, in sequence (baseline of a submit)."""
    c = Client(d.socket, timeout=30)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        c.hello()
        ts.append(time.perf_counter() - t)
    return {"n": n, "p50_ms": 1000 * pct(ts, 0.5), "p99_ms": 1000 * pct(ts, 0.99)}


def direct_burns(gpus: Path, n: int) -> dict:
    """The same colo-burn command as the short jobs, run n times back to back without colo."""
    burn = str(native.path("colo-burn"))
    env = {**os.environ, **fakegpu.FakeNode(gpus).env}
    t0 = time.perf_counter()
    fails = 0
    for _ in range(n):
        r = subprocess.run([burn, "--mem", "64MiB", "--seconds", "0.05", "--quiet"], env=env, capture_output=True)
        fails += r.returncode != 0
    wall = time.perf_counter() - t0
    return {"n": n, "failed": fails, "jobs_per_s": n / wall}


# entry point --------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--submits", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", type=Path, help="save the figures and run conditions (bench/readme_table.py)")
    a = ap.parse_args()
    native.ensure_built()
    rep = Report("load_bench")
    out = {}
    root = shared_root("colo-load-")
    try:
        fakegpu.create(root / "gpus", count=2, mem=GiB)
        os.chmod(root / "gpus", 0o666)
        d = DaemonProc(root, root / "gpus").start()
        os.chmod(d.socket.parent, 0o755)
        try:
            users = ensure_users(a.clients)
            out["hello"] = hello_times(d)
            r = submit_load(d, users, a.submits)
            out["submit"] = {k: v for k, v in r.items() if k not in ("acked", "stored")}
            out["submit"]["violations"] = check_submissions(r)
            wait_for(lambda: all(j["state"] in TERMINAL for j in d.client.ls()), 300, "load jobs to end")
        finally:
            d.stop()
        # a fresh daemon for the job stream, so its RSS is not the submission load's
        shutil.rmtree(root / "state")
        d = DaemonProc(root, root / "gpus").start()
        try:
            out["direct"] = direct_burns(root / "gpus", 20)
            out["jobs"] = short_jobs(d, a.jobs)
        finally:
            d.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s, j = out["submit"], out["jobs"]
    # the timed work happened as intended, or no figure is printed
    rep.check(not s["violations"], f"submissions: {s['violations']}")
    rep.check(s["submits"] == a.submits, f"{s['submits']} of {a.submits} submissions acknowledged")
    rep.check(not s["ls_errors"], f"{len(s['ls_errors'])} ls calls failed during the load: {s['ls_errors'][:2]}")
    rep.check(j["states"] == {"succeeded": a.jobs}, f"short jobs should all succeed, ended {j['states']}")
    rep.check(not j["over_commits"], f"over-commits: {j['over_commits'][:3]}")
    h, dr = out["hello"], out["direct"]
    rep.check(dr["failed"] == 0, f"{dr['failed']} of {dr['n']} direct colo-burn runs failed")
    rep.figure("submit_p50", f"daemon side of a submit, p50 ({s['clients']} clients at once)", s["p50_ms"], "ms",
               h["p50_ms"], "`hello` p50, one client")
    rep.figure("submit_p99", "daemon side of a submit, p99", s["p99_ms"], "ms", h["p99_ms"], "`hello` p99, one client")
    rep.figure("submit_rate", f"submits/s from {s['uids']} users", s["submits_per_s"], "/s",
               1000 / h["p50_ms"], "`hello`/s, one client in sequence")
    rep.figure("jobs_rate", f"short GPU jobs (colo-burn 50 ms) through the queue, {j['jobs']}", j["jobs_per_s"], "/s",
               dr["jobs_per_s"], f"the same command run {dr['n']}x back to back, no colo")
    rep.figure("rss_end", "daemon RSS at the end of the job stream", j["rss_kib"]["end"] * 1024, "B",
               j["rss_kib"]["warm"] * 1024, "after a warm-up of 20 jobs")
    rep.extra.update(out)
    if a.json:
        print(json.dumps(out, indent=1))
    return rep.finish(a.json_out)

if __name__ == "__main__":
    sys.exit(main())
