"""`colo history` and `colo report` on a long history, this colo beside an earlier one in one run.

The same database (N ended jobs, default 10,000, by 10 users, ended over the last 59 days, each
with a real-sized spec: a command, 12 environment variables, a name; half with a profile's alone
run time in its decision) is copied for two daemons on the same simulated GPUs: one of this
checkout and one of the earlier checkout given by --before (its daemon and its CLI import that
checkout). Then, round by round so that load on the machine hits both alike, each CLI against
its own daemon:
- `colo history` piped (the default period, 7 days);
- `colo history --since 60d` piped (every job);
- `colo history` on a terminal (a pty);
- `colo report --since 30d`;
and each daemon's RSS growth over the run (after its first answer to the end: what the commands
made it read and keep), and its peak RSS (VmHWM).

Every figure is refused unless the work happened: both colos print the same table for the same
period piped (every job of it), and the same report figures.

Run (as root): python bench/history_bench.py --before CHECKOUT [--jobs 10000] [-n 5]
                                             [--json-out bench/results/history_bench.json]
(CHECKOUT: a folder holding an earlier colo, e.g. `git worktree add --detach ../base <commit>`
with this checkout's native/build copied in)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report, daemon_log_problems  # noqa: E402
from queue_bench import rss_mb, timed_tty  # noqa: E402

from harness.daemon import DaemonProc  # noqa: E402

from colo.node import fakegpu  # noqa: E402
from colo.jobs import JobSpec, Mode, State  # noqa: E402
from colo.store import Store  # noqa: E402

GiB = 1 << 30
DAY = 86400.0


def seed(path: Path, n: int, gpus: list[str]) -> None:
    """n ended jobs, in one transaction."""
    rnd = random.Random(7)
    st = Store(path)
    now = time.time()
    with st.tx():
        for i in range(n):
            end = now - 59 * DAY * (n - i) / n
            sub = end - rnd.uniform(60, 7200)
            user = f"user{i % 10}"
            spec = JobSpec(argv=["python", "train.py", "--epochs", str(rnd.randint(1, 90)), f"--seed={i}"],
                           name=f"exp-{i % 97}", gpu_mem=rnd.choice([2, 4, 8]) * GiB, gpus=1, workdir="/tmp",
                           env={f"VAR_{k}": f"value-{k}-{'x' * 24}" for k in range(12)})
            j = st.add_job(spec, 2000 + i % 10, 2000, user, now=sub)
            if rnd.random() < 0.1:
                st.transition(j.id, State.CANCELLED, f"cancelled by {user}", now=end)
                continue
            start = sub + rnd.uniform(0, 1800)
            st.transition(j.id, State.STARTING, "start", now=start, gpus=[rnd.choice(gpus)], mode=Mode.MPS)
            st.transition(j.id, State.RUNNING, "started (process)", now=start + 0.5)
            ok = rnd.random() < 0.85
            st.transition(j.id, State.SUCCEEDED if ok else State.FAILED, "exited", now=max(end, start + 1),
                          exit_code=0 if ok else 1)
            if rnd.random() < 0.5:
                st.record_decisions([(j.id, "start", "mps", [], "fits", {
                    "profile_runtime": rnd.uniform(300, 3000), "predicted_slowdown": 1.1})], now=start)
    st.close()


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/")
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:])} exited {r.returncode}: {r.stderr.strip()[-600:]}")
    return wall, r.stdout


def hwm_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rounded(x):
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, type=Path, help="a checkout of an earlier colo")
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("-n", type=int, default=5, help="rounds")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    before = args.before.resolve()
    if not (before / "colo" / "__init__.py").is_file():
        raise SystemExit(f"--before {before}: no colo checkout there")
    commit = subprocess.run(["git", "-C", str(before), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    rep = Report("history_bench")
    rep.command = rep.command.replace(str(args.before), f"<a checkout of {commit}>")  # not a local path
    os.chdir("/")  # `python -m colo` puts the folder it runs in first on the path: each daemon gets its own colo
    root = Path(tempfile.mkdtemp(prefix="colo-history-bench-"))
    state = root / "fake.state"
    fakegpu.create(state, count=8, mem=16 * GiB)
    seed(root / "seed.db", args.jobs, [f"GPU-bench-{k}" for k in range(8)])  # names only: history reads them
    sides = {}
    try:
        for side, env in (("before", {"PYTHONPATH": str(before)}), ("after", {})):
            (root / side / "state").mkdir(parents=True)
            shutil.copy(root / "seed.db", root / side / "state" / "colo.db")
            d = DaemonProc(root / side, state, env=env).start()
            sides[side] = {"d": d, "rss0": rss_mb(d.proc.pid), "runs": {}}
        cases = {"piped": ["history"], "all": ["history", "--since", "60d"], "report": ["report", "--since", "30d"]}
        outs: dict[str, dict[str, str]] = {s: {} for s in sides}
        for _ in range(args.n):
            for side, s in sides.items():
                d = s["d"]
                for case, cmd in cases.items():
                    wall, out = timed([sys.executable, "-m", "colo", *cmd], d.env())
                    s["runs"].setdefault(case, []).append(wall)
                    outs[side][case] = out
                w, lines = timed_tty([sys.executable, "-m", "colo", "history"], 1, {**d.env(), "COLUMNS": "200"})
                s["runs"].setdefault("tty", []).append(w[0])
                s["tty_lines"] = lines
        for side, s in sides.items():
            s["rss1"], s["hwm"] = rss_mb(s["d"].proc.pid), hwm_mb(s["d"].proc.pid)
            outs[side]["report_json"] = timed([sys.executable, "-m", "colo", "report", "--since", "30d", "--json"],
                                              s["d"].env())[1]
            problems = daemon_log_problems(s["d"].log)
            rep.check(not problems, f"the {side} daemon logged problems: {problems[:3]}")
        b, a = outs["before"], outs["after"]
        for case in ("piped", "all"):
            rep.check(a[case] == b[case], f"`colo {' '.join(cases[case])}` printed a different table than before")
        rep.check(a["all"].count("\n") == args.jobs + 1, f"`colo history --since 60d` printed "
                  f"{a['all'].count(chr(10))} lines, not every job (+ the header)")
        ra, rb = json.loads(a["report_json"]), json.loads(b["report_json"])
        rep.check(rounded(ra) == rounded(rb), "colo report gave other figures than before")
    finally:
        for s in sides.values():
            s["d"].stop()
    if rep.failures:
        return rep.finish(args.json_out)
    A, B = sides["after"], sides["before"]
    bw = f"the earlier colo ({commit}), same database, same rounds"
    n7 = a["piped"].count("\n") - 1
    for case, what in (("piped", f"colo history, piped, default 7 days ({n7:,} of {args.jobs:,} jobs)"),
                       ("all", f"colo history --since 60d, piped (all {args.jobs:,})"),
                       ("tty", "colo history on a terminal"),
                       ("report", "colo report --since 30d")):
        note = f"{A['tty_lines']:,} lines vs {B['tty_lines']:,}" if case == "tty" else ""
        rep.figure(case, f"{what}, wall (median of {args.n})", statistics.median(A["runs"][case]), "s",
                   statistics.median(B["runs"][case]), bw, note=note)
    rep.figure("rss_growth", "daemon RSS growth over all the rounds", (A["rss1"] - A["rss0"]) * 2**20, "B",
               (B["rss1"] - B["rss0"]) * 2**20, bw, note=f"at the start {A['rss0']:.1f} vs {B['rss0']:.1f} MiB")
    rep.figure("rss_peak", "daemon peak RSS (VmHWM)", A["hwm"] * 2**20, "B", B["hwm"] * 2**20, bw)
    shutil.rmtree(root, ignore_errors=True)
    return rep.finish(args.json_out)


if __name__ == "__main__":
    os.environ.pop("COLO_FAKEGPU_STATE", None)
    sys.exit(main())
