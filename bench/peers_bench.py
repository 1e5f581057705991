"""colo beside its installable peers: submitting a job and listing a queue of Q waiting jobs with
task-spooler (`tsp`), Slurm (`sbatch`, `squeue`; slurmctld + slurmd on localhost, started here in
a temporary folder) and colo (`colo submit`, `colo ls`), in one run on one machine.

Each tool gets one running job that holds what the others need (tsp: its one slot; Slurm: every
CPU of the node; colo: every byte of a simulated GPU), then Q jobs that must wait behind it. The
submit figure is the wall time of the command-line client (median of -n), the list figure that of
the listing command with the Q jobs queued (median of 5). Refused unless each tool then holds
exactly its Q + n waiting jobs behind one running job.

With --big N (50,000): Slurm and colo each also hold N waiting jobs, submitted as arrays of 1,000
tasks (`sbatch --array`, `colo submit --array`), and their lists are timed at that length: `colo
ls` beside `squeue` (each shows an array's waiting tasks as one row), and `colo ls -r` beside
`squeue -r` (a row per task: N rows each).

colo's commands are `python -m colo` of this interpreter unless --colo names a `colo` console
script (a regular install's, as bench/cli_bench.py makes one: an editable install adds its path
finder to every start, about as long as the interpreter's own start-up).

Run (as root; apt-get install task-spooler slurm-wlm munge):
    python bench/peers_bench.py [--queue 500] [-n 10] [--big 50000] [--colo VENV/bin/colo] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
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
from slurm_util import SlurmNode, munge_up  # noqa: E402

from colo.node import fakegpu  # noqa: E402

GiB = 1 << 30


def timed(argv: list[str], n: int, env: dict, cwd: str = "/tmp") -> tuple[float, list[subprocess.CompletedProcess]]:
    ts, outs = [], []
    for _ in range(n):
        t = time.perf_counter()
        r = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=cwd, timeout=120)
        ts.append(time.perf_counter() - t)
        outs.append(r)
    return statistics.median(ts), outs


def sh_out(argv: list[str], env: dict | None = None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, env=env)
    return (r.stdout + r.stderr).strip()


# --- task-spooler -------------------------------------------------------------------------------

def tsp_bin() -> str | None:
    for b in ("tsp", "ts"):  # Debian names it tsp (moreutils has a `ts` of its own)
        p = shutil.which(b)
        if p and "task" in subprocess.run([p, "-h"], capture_output=True, text=True).stdout.lower():
            return p
    return shutil.which("tsp")


def bench_tsp(rep: Report, root: Path, q: int, n: int) -> None:
    tsp = tsp_bin()
    if tsp is None:
        rep.note("task-spooler: not installed (apt-get install task-spooler): left out")
        return
    env = {**os.environ, "TS_SOCKET": str(root / "tsp.sock"), "TMPDIR": str(root)}
    try:
        subprocess.run([tsp, "-S", "1"], env=env, check=True, capture_output=True)
        subprocess.run([tsp, "sleep", "3600"], env=env, check=True, capture_output=True)
        for _ in range(q):
            subprocess.run([tsp, "true"], env=env, check=True, capture_output=True)
        sub, outs = timed([tsp, "true"], n, env)
        rep.check(all(r.returncode == 0 for r in outs), "a tsp submit failed")
        ls, outs = timed([tsp, "-l"], 5, env)
        lines = outs[-1].stdout.splitlines()[1:]
        st = {}
        for line in lines:
            w = line.split()
            st[w[1]] = st.get(w[1], 0) + 1
        rep.check(st == {"running": 1, "queued": q + n}, f"tsp should hold 1 running, {q + n} queued: {st}")
        rep.extra["tsp"] = {"submit_s": sub, "ls_s": ls, "version": sh_out([tsp, "-V"]).splitlines()[0][:80]}
    finally:
        subprocess.run([tsp, "-K"], env=env, capture_output=True)  # kills its server and the jobs


# --- Slurm --------------------------------------------------------------------------------------

ARRAY = 1000  # tasks per array of the --big queue (Slurm's default MaxArraySize is 1001)


def rows_of(out: str) -> int:
    return len(out.splitlines()) - 1  # less the header


def bench_slurm(rep: Report, root: Path, q: int, n: int, big: int = 0) -> None:
    missing = [e for e in ("slurmctld", "slurmd", "sbatch", "squeue", "munged") if shutil.which(e) is None]
    if missing or os.geteuid() != 0:
        rep.note(f"Slurm: left out ({'missing ' + ', '.join(missing) if missing else 'slurmd needs root'}; "
                 "apt-get install slurm-wlm munge)")
        return
    munge_up()
    s = SlurmNode(root / "slurm", cluster="colobench", cpus=2, extra=("MaxJobCount=200000",)).start()
    try:
        env = s.env
        sb = ["sbatch", "--parsable", "-o", "/dev/null", "-e", "/dev/null"]
        r = subprocess.run([*sb, "-c", "2", "--wrap", "sleep 3600"], env=env, capture_output=True, text=True, cwd="/tmp")
        rep.check(r.returncode == 0, f"sbatch failed: {r.stderr.strip()}")
        wait_for(lambda: subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i"], env=env, capture_output=True,
                                        text=True).stdout.strip(), 60, "the Slurm holder to run")
        for _ in range(q):
            subprocess.run([*sb, "-c", "1", "--wrap", "true"], env=env, check=True, capture_output=True, cwd="/tmp")
        sub, outs = timed([*sb, "-c", "1", "--wrap", "true"], n, env)
        rep.check(all(r.returncode == 0 for r in outs), f"an sbatch failed: {[r.stderr for r in outs if r.returncode][:1]}")
        ls, outs = timed(["squeue"], 5, env)
        st = subprocess.run(["squeue", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.split()
        counts = {x: st.count(x) for x in set(st)}
        rep.check(counts == {"RUNNING": 1, "PENDING": q + n}, f"Slurm should hold 1 running, {q + n} pending: {counts}")
        ver = " ".join(sh_out(["sbatch", "--version"], env).split())
        rep.extra["slurm"] = {"submit_s": sub, "ls_s": ls, "version": ver}
        if big:
            for _ in range(big // ARRAY):
                subprocess.run([*sb, "-c", "1", f"--array=0-{ARRAY - 1}", "--wrap", "true"], env=env, check=True,
                               capture_output=True, cwd="/tmp")
            ls_big, outs = timed(["squeue"], 5, env)
            ls_all, alls = timed(["squeue", "-r"], 5, env)
            rep.check(rows_of(alls[-1].stdout) == 1 + q + n + big, f"squeue -r listed {rows_of(alls[-1].stdout)} rows, "
                      f"not {1 + q + n + big}")
            rep.extra["slurm"].update(big_ls_s=ls_big, big_ls_rows=rows_of(outs[-1].stdout), big_all_s=ls_all)
    finally:
        s.stop()


# --- colo ---------------------------------------------------------------------------------------

COLO = [sys.executable, "-m", "colo"]  # (--colo)


def bench_colo(rep: Report, root: Path, q: int, n: int, big: int = 0) -> None:
    fakegpu.create(root / "gpus", count=1, mem=16 * GiB)
    (root / "colo").mkdir()
    d = DaemonProc(root / "colo", root / "gpus", {"sample_interval": 1.0, "max_queued_per_user": 0}).start()
    hold = None
    try:
        env = d.env()
        hold = d.client.submit({"argv": ["sleep", "3600"], "gpus": 1, "gpu_mem": 16 * GiB, "workdir": "/tmp"})["id"]
        d.wait_state(hold, "running", timeout=60)
        for _ in range(q):
            d.client.submit({"argv": ["true"], "gpus": 1, "gpu_mem": 1 * GiB, "workdir": "/tmp"})
        sub, outs = timed([*COLO, "submit", "--process", "--gpu-mem", "1GiB", "--", "true"],
                          n, env)
        rep.check(all(r.returncode == 0 for r in outs), f"a colo submit failed: {[r.stderr for r in outs][:1]}")
        ls, outs = timed([*COLO, "ls"], 5, env)
        st = {}
        for j in d.client.ls():
            st[j["state"]] = st.get(j["state"], 0) + 1
        rep.check(st == {"running": 1, "queued": q + n}, f"colo should hold 1 running, {q + n} queued: {st}")
        rep.extra["colo"] = {"submit_s": sub, "ls_s": ls}
        if big:
            for _ in range(big // ARRAY):
                d.client.submit({"argv": ["true"], "gpus": 1, "gpu_mem": 1 * GiB, "workdir": "/tmp",
                                 "array": f"0-{ARRAY - 1}"})
            time.sleep(5)  # the passes for the new jobs are over
            ls_big, outs = timed([*COLO, "ls"], 5, env)
            ls_all, alls = timed([*COLO, "ls", "-r"], 5, env)
            rep.check(rows_of(alls[-1].stdout) == 1 + q + n + big, f"colo ls -r listed {rows_of(alls[-1].stdout)} rows, "
                      f"not {1 + q + n + big}")
            rep.extra["colo"].update(big_ls_s=ls_big, big_ls_rows=rows_of(outs[-1].stdout), big_all_s=ls_all)
    finally:
        if hold is not None:  # the daemon leaves running jobs running when it stops: end the holder first
            d.client.cancel(hold)
            d.wait_state(hold, "cancelled", "failed", "succeeded", timeout=60)
        d.proc.send_signal(signal.SIGTERM)  # not DaemonProc.stop: it would cancel Q jobs one by one
        d.proc.wait(60)
    rep.check(not (p := daemon_log_problems(d.log)), f"colo daemon log: {p[:3]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue", type=int, default=500, help="jobs waiting while the list commands are timed")
    ap.add_argument("-n", type=int, default=10, help="submits timed per tool")
    ap.add_argument("--big", type=int, default=0, help="also list this many more waiting jobs (arrays of 1,000)")
    ap.add_argument("--colo", type=Path, help="the colo console script to time (default: python -m colo)")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    rep = Report("peers_bench")
    if a.colo:
        COLO[:] = [str(a.colo)]
        where = subprocess.run([str(a.colo.parent / "python"), "-c", "import colo; print(colo.__file__)"],
                               capture_output=True, text=True, cwd="/").stdout
        rep.conditions["install"] = "regular" if "site-packages" in where else "?"  # what was timed: its colo
        rep.note(f"colo timed: {a.colo} ({where.strip()})")
    root = Path(tempfile.mkdtemp(prefix="colo-peers-"))
    os.chmod(root, 0o755)
    try:
        for fn in (bench_colo, bench_tsp, bench_slurm):
            try:
                fn(rep, root, a.queue, a.n, *((a.big,) if fn is not bench_tsp else ()))
            except Exception as e:  # noqa: BLE001 - one tool failing refuses the figures, the others still run
                rep.check(False, f"{fn.__name__}: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    c = rep.extra.get("colo")
    if c:
        for peer, label in (("tsp", "task-spooler"), ("slurm", "Slurm")):
            p = rep.extra.get(peer)
            if p:
                rep.figure(f"submit_vs_{peer}", f"`colo submit` vs {label} submit", c["submit_s"], "s", p["submit_s"],
                           "`tsp CMD`" if peer == "tsp" else "`sbatch --wrap CMD`", f"median of {a.n}")
                rep.figure(f"ls_vs_{peer}", f"`colo ls` vs {label} list, {a.queue + a.n:,} waiting", c["ls_s"], "s",
                           p["ls_s"], "`tsp -l`" if peer == "tsp" else "`squeue`", "median of 5")
        p = rep.extra.get("slurm")
        if a.big and p and "big_ls_s" in c and "big_ls_s" in p:
            total = 1 + a.queue + a.n + a.big
            rep.figure("big_ls_vs_slurm", f"`colo ls` vs `squeue`, {total:,} jobs ({a.big:,} in arrays of {ARRAY:,})",
                       c["big_ls_s"], "s", p["big_ls_s"], "`squeue`",
                       f"median of 5; {c['big_ls_rows']:,} rows vs {p['big_ls_rows']:,}: an array's waiting tasks in one")
            rep.figure("big_all_vs_slurm", f"`colo ls -r` vs `squeue -r`, {total:,} rows", c["big_all_s"], "s",
                       p["big_all_s"], "`squeue -r`", "median of 5; a row per task")
        if "slurm" in rep.extra:
            rep.note(f"{rep.extra['slurm']['version']}: slurmctld + slurmd on localhost, started by this bench")
        if "tsp" in rep.extra:
            rep.note(f"task-spooler: {rep.extra['tsp']['version']}")
    else:
        rep.check(False, "colo's part did not run")
    return rep.finish(a.json_out)


if __name__ == "__main__":
    os.environ.pop("COLO_FAKEGPU_STATE", None)
    sys.exit(main())
