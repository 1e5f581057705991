"""colo beside its installable peers: submitting a job and listing a queue of Q waiting jobs with
task-spooler (`tsp`), Slurm (`sbatch`, `squeue`; slurmctld + slurmd on localhost, started here in
a temporary folder) and colo (`colo submit`, `colo ls`), in one run on one machine.

Each tool gets one running job that holds what the others need (tsp: its one slot; Slurm: every
CPU of the node; colo: every byte of a simulated GPU), then Q jobs that must wait behind it. The
submit figure is the wall time of the command-line client (median of -n), the list figure that of
the listing command with the Q jobs queued. The listings are timed in interleaved rounds (each
tool's list once a round, in an order that turns from round to round, every tool's daemon up and
filled at once), so that the load of a shared machine falls on each alike; each figure is the
median of --rounds, printed with its spread (quartiles, min-max). Refused unless each tool then
holds exactly its Q + n waiting jobs behind one running job.

With --big N (50,000): Slurm and colo each also hold N waiting jobs, submitted as arrays of 1,000
tasks (`sbatch --array`, `colo submit --array`), and their lists are timed at that length: `colo
ls` beside `squeue` (each shows an array's waiting tasks as one row), and `colo ls -r` beside
`squeue -r` (a row per task: N rows each).

colo's commands are `python -m colo` of this interpreter unless --colo names a `colo` console
script (a regular install's, as bench/cli_bench.py makes one: an editable install adds its path
finder to every start, about as long as the interpreter's own start-up); its daemon is that
script's interpreter's `colo daemon`. --before names a second one (another version's venv, its own
daemon filled alike), timed in the same rounds: before and after in one run. Where --colo is the
compiled client (native/client/colo.c), its command server is started and awaited before the --big
rounds, and its Python path (`COLO_FAST=0 colo ls`) is timed in the same rounds.

Run (as root; apt-get install task-spooler slurm-wlm munge):
    python bench/peers_bench.py [--queue 500] [-n 10] [--big 50000] [--rounds 15] [--colo VENV/bin/colo]
                                [--before OLDVENV/bin/colo] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import contextlib
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

from benchlib import Report, compiled, daemon_log_problems, fast_server  # noqa: E402
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


def rounds(cmds: dict[str, tuple], n: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Each command (name: argv, env[, what to do first, untimed]) once a round for n rounds, the
    order turned by one each round (none always first, or always right after another); each one's
    wall times, and its last output."""
    names = list(cmds)
    ts: dict[str, list[float]] = {k: [] for k in names}
    outs: dict[str, str] = {}
    for r in range(n):
        for k in names[r % len(names):] + names[:r % len(names)]:
            argv, env, *first = cmds[k]
            for fn in first:
                fn()
            t = time.perf_counter()
            p = subprocess.run(argv, env=env, capture_output=True, text=True, cwd="/tmp", timeout=120)
            ts[k].append(time.perf_counter() - t)
            if p.returncode:
                raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()[:200]}")
            outs[k] = p.stdout
    return ts, outs


def spread(ts: list[float]) -> str:
    """How the rounds' times spread around their median, in ms."""
    q = statistics.quantiles(ts, n=4) if len(ts) > 1 else ts * 3
    return f"quartiles {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f} ms, min-max {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}"


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


# --- Slurm ---------------------------------------------------------------------------------------

ARRAY = 1000  # tasks per array of the --big queue (Slurm's default MaxArraySize is 1001)


def rows_of(out: str) -> int:
    return len(out.splitlines()) - 1  # less the header


@contextlib.contextmanager
def slurm_side(rep: Report, root: Path, q: int, n: int):
    """slurmctld + slurmd holding one running job and Q + n waiting: yields its env and figures, and
    `fill(big)` (big more waiting, in arrays). None where Slurm cannot run here."""
    missing = [e for e in ("slurmctld", "slurmd", "sbatch", "squeue", "munged") if shutil.which(e) is None]
    if missing or os.geteuid() != 0:
        rep.note(f"Slurm: left out ({'missing ' + ', '.join(missing) if missing else 'slurmd needs root'}; "
                 "apt-get install slurm-wlm munge)")
        yield None
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
        st = subprocess.run(["squeue", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.split()
        counts = {x: st.count(x) for x in set(st)}
        rep.check(counts == {"RUNNING": 1, "PENDING": q + n}, f"Slurm should hold 1 running, {q + n} pending: {counts}")

        def fill(big: int) -> None:
            for _ in range(big // ARRAY):
                subprocess.run([*sb, "-c", "1", f"--array=0-{ARRAY - 1}", "--wrap", "true"], env=env, check=True,
                               capture_output=True, cwd="/tmp")

        yield {"env": env, "submit_s": sub, "version": " ".join(sh_out(["sbatch", "--version"], env).split()),
               "ls": ["squeue"], "all": ["squeue", "-r"], "fill": fill}
    finally:
        s.stop()


# --- colo ---------------------------------------------------------------------------------------

COLO = [sys.executable, "-m", "colo"]  # (--colo)


class VenvDaemon(DaemonProc):
    """A colo daemon run by `python` (the timed console script's own interpreter: its colo)."""

    def __init__(self, python: str, *a, **kw):
        super().__init__(*a, **kw)
        self.python = python

    def argv(self) -> list[str]:
        return [self.python, *super().argv()[1:]]


@contextlib.contextmanager
def colo_side(rep: Report, root: Path, q: int, n: int, colo: list[str], python: str, label: str):
    """A colo daemon holding one running job and Q + n waiting (its own fake GPU): yields its env and
    figures, and `fill(big)`."""
    fakegpu.create(root / "gpus", count=1, mem=16 * GiB)
    (root / "colo").mkdir()
    d = VenvDaemon(python, root / "colo", root / "gpus", {"sample_interval": 1.0, "max_queued_per_user": 0}).start()
    hold = None
    try:
        env = d.env()
        hold = d.client.submit({"argv": ["sleep", "3600"], "gpus": 1, "gpu_mem": 16 * GiB, "workdir": "/tmp"})["id"]
        d.wait_state(hold, "running", timeout=60)
        for _ in range(q):
            d.client.submit({"argv": ["true"], "gpus": 1, "gpu_mem": 1 * GiB, "workdir": "/tmp"})
        sub, outs = timed([*colo, "submit", "--process", "--gpu-mem", "1GiB", "--", "true"], n, env)
        rep.check(all(r.returncode == 0 for r in outs), f"a {label} submit failed: {[r.stderr for r in outs][:1]}")
        st = {}
        for j in d.client.ls():
            st[j["state"]] = st.get(j["state"], 0) + 1
        rep.check(st == {"running": 1, "queued": q + n}, f"{label} should hold 1 running, {q + n} queued: {st}")

        def fill(big: int) -> None:
            for _ in range(big // ARRAY):
                d.client.submit({"argv": ["true"], "gpus": 1, "gpu_mem": 1 * GiB, "workdir": "/tmp",
                                 "array": f"0-{ARRAY - 1}"})

        last = d.client.ls_fields(["id"], all=False, states=["queued"])["rows"][-1][0]  # a single job

        def change() -> None:
            """A queued job changed (held, then released): the listing's kept rows no longer stand."""
            d.client.hold(last)
            d.client.release(last)

        yield {"env": env, "submit_s": sub, "ls": [*colo, "ls"], "all": [*colo, "ls", "-r"], "fill": fill,
               "python": python, "change": change,
               "settle": lambda: settle(d)}
    finally:
        if hold is not None:  # the daemon leaves running jobs running when it stops: end the holder first
            d.client.cancel(hold)
            d.wait_state(hold, "cancelled", "failed", "succeeded", timeout=60)
        d.proc.send_signal(signal.SIGTERM)  # not DaemonProc.stop: it would cancel Q jobs one by one
        d.proc.wait(60)
        rep.check(not (p := daemon_log_problems(d.log)), f"{label} daemon log: {p[:3]}")


def settle(d: DaemonProc) -> None:
    """Until the scheduler's passes over the new jobs are done: the waiting jobs' reasons (the
    listing `colo ls` sends) the same twice, 2 s apart."""
    def seen() -> list:
        return d.client.ls_fields(["id", "reason"], all=False, tasks=False)["rows"]

    last = seen()
    while True:
        time.sleep(2)
        now = seen()
        if now == last:
            return
        last = now


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue", type=int, default=500, help="jobs waiting while the list commands are timed")
    ap.add_argument("-n", type=int, default=10, help="submits timed per tool")
    ap.add_argument("--big", type=int, default=0, help="also list this many more waiting jobs (arrays of 1,000)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds of the list commands")
    ap.add_argument("--colo", type=Path, help="the colo console script to time (default: python -m colo)")
    ap.add_argument("--before", type=Path, help="another colo console script (and its daemon), timed beside it")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    rep = Report("peers_bench")
    colos = {"colo": (COLO, sys.executable)}
    for key, script in (("colo", a.colo), ("before", a.before)):
        if script is None:
            continue
        where = subprocess.run([str(script.parent / "python"), "-c", "import colo; print(colo.__file__)"],
                               capture_output=True, text=True, cwd="/").stdout.strip()
        if key == "colo":
            rep.conditions["install"] = "regular" if "site-packages" in where else "?"  # what was timed: its colo
        colos[key] = ([str(script)], str(script.parent / "python"))
        rep.note(f"{'colo' if key == 'colo' else 'before'} timed: {script} ({where})")
    root = Path(tempfile.mkdtemp(prefix="colo-peers-"))
    os.chmod(root, 0o755)
    try:
        try:
            bench_tsp(rep, root, a.queue, a.n)
        except Exception as e:  # noqa: BLE001 - one tool failing refuses the figures, the others still run
            rep.check(False, f"bench_tsp: {type(e).__name__}: {e}")
        try:
            with contextlib.ExitStack() as stack:
                sides = {}
                for key, (argv, py) in colos.items():
                    (root / key).mkdir()
                    sides[key] = stack.enter_context(colo_side(rep, root / key, a.queue, a.n, argv, py, key))
                slurm = stack.enter_context(slurm_side(rep, root, a.queue, a.n))
                if slurm is not None:
                    sides["slurm"] = slurm
                measure(rep, sides, a)
        except Exception as e:  # noqa: BLE001 - refused, with what failed
            rep.check(False, f"{type(e).__name__}: {e}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if "colo" not in rep.extra:
        rep.check(False, "colo's part did not run")
    return rep.finish(a.json_out)


def measure(rep: Report, sides: dict, a: argparse.Namespace) -> None:
    """The list commands in interleaved rounds at Q waiting, then at Q + big; the figures."""
    for key, s in sides.items():
        rep.extra[key] = {"submit_s": s["submit_s"], **({"version": s["version"]} if "version" in s else {})}
    small, _ = rounds({k: (s["ls"], s["env"]) for k, s in sides.items()}, a.rounds)
    for k, ts in small.items():
        rep.extra[k].update(ls_s=statistics.median(ts), ls_spread=spread(ts))
    total = 1 + a.queue + a.n + a.big
    if a.big:
        for s in sides.values():
            s["fill"](a.big)
        for s in sides.values():
            if "settle" in s:
                s["settle"]()
        # what colo's time is made of, in the same rounds: its interpreter's start-up (`python -c
        # pass`), that and the short path's imports, and a listing of one row (the request's fixed cost)
        c = sides["colo"]
        parts = {"py": ([c["python"], "-c", "pass"], c["env"]),
                 "imports": ([c["python"], "-c", "import colo.cli.entry, colo.cli.argv, colo.cli.lsview"], c["env"]),
                 "one": ([*c["ls"], "-s", "running"], c["env"])}
        server = None
        if compiled(c["ls"][:-1]):  # the compiled `colo`: its Python path (COLO_FAST=0) in the same rounds
            parts["python_path"] = (c["ls"], {**c["env"], "COLO_FAST": "0"})
            server = fast_server(c["ls"][:-1], c["env"])
            rep.check(server is not None, "colo's command server did not answer")
        big, outs = rounds({**{k: (s["ls"], s["env"]) for k, s in sides.items()}, **parts}, a.rounds)
        if server is not None:
            rep.check(fast_server(c["ls"][:-1], c["env"]) == server, "colo's command server changed during the rounds")
        rep.extra["colo"]["parts"] = {k: statistics.median(big[k]) for k in parts}
        # each listing just after a queued job changed (colo's; squeue keeps nothing between two)
        moved, _ = rounds({k: (s["ls"], s["env"], *([s["change"]] if "change" in s else [])) for k, s in sides.items()},
                          a.rounds)
        every, alls = rounds({k: (s["all"], s["env"]) for k, s in sides.items()}, a.rounds)
        for k in sides:
            rep.check(rows_of(alls[k]) == total, f"{k}: {' '.join(sides[k]['all'])} listed {rows_of(alls[k])} rows, "
                      f"not {total}")
            rep.extra[k].update(big_ls_s=statistics.median(big[k]), big_ls_spread=spread(big[k]),
                                big_ls_rows=rows_of(outs[k]), big_all_s=statistics.median(every[k]),
                                big_all_spread=spread(every[k]), big_moved_s=statistics.median(moved[k]),
                                big_moved_spread=spread(moved[k]))
    c = rep.extra["colo"]
    r = a.rounds
    for peer, label in (("tsp", "task-spooler"), ("slurm", "Slurm")):
        p = rep.extra.get(peer)
        if p:
            rep.figure(f"submit_vs_{peer}", f"`colo submit` vs {label} submit", c["submit_s"], "s", p["submit_s"],
                       "`tsp CMD`" if peer == "tsp" else "`sbatch --wrap CMD`", f"median of {a.n}")
            rep.figure(f"ls_vs_{peer}", f"`colo ls` vs {label} list, {a.queue + a.n:,} waiting", c["ls_s"], "s",
                       p["ls_s"], "`tsp -l`" if peer == "tsp" else "`squeue`",
                       f"median of {r} rounds" + ("" if peer == "tsp" else f"; {c['ls_spread']}; squeue {p['ls_spread']}"))
    p, b = rep.extra.get("slurm"), rep.extra.get("before")
    # (key, what, its squeue's key): each --big listing beside squeue and beside --before
    big = (("big_ls", f"`colo ls`, {total:,} jobs ({a.big:,} in arrays of {ARRAY:,})", "big_ls", "`squeue`"),
           ("big_moved", f"`colo ls` just after a queued job changed (a hold and release, untimed), {total:,} jobs",
            "big_ls", "`squeue`"),
           ("big_all", f"`colo ls -r`, {total:,} rows", "big_all", "`squeue -r`")) if a.big else ()
    for key, what, theirs, peer in big:
        if p:
            rep.figure(f"{key}_vs_slurm", f"{what} vs {peer}", c[f"{key}_s"], "s", p[f"{theirs}_s"], peer,
                       f"median of {r} interleaved rounds; {c[f'{key}_spread']}; {peer} {p[f'{theirs}_spread']}")
        if b:
            rep.figure(f"{key}_vs_before", f"{what} vs --before", c[f"{key}_s"], "s", b[f"{key}_s"],
                       "the same (--before)", f"median of {r} interleaved rounds; before {b[f'{key}_spread']}")
    if a.big and p:
        for k, what in (("py", "`python -c pass` (colo's interpreter)"),
                        ("imports", "colo's interpreter importing the short path of `colo ls`"),
                        ("one", f"`colo ls -s running` (one row), {total:,} jobs"),
                        ("python_path", f"`COLO_FAST=0 colo ls` (the Python path), {total:,} jobs")):
            if k not in c["parts"]:
                continue
            rep.figure(f"big_part_{k}", f"{what} vs `squeue`", c["parts"][k], "s", p["big_ls_s"], "`squeue`",
                       f"median of {r} interleaved rounds: what `colo ls` is made of")
    if a.big and "python_path" in c.get("parts", {}):
        rep.figure("big_ls_vs_python_path", f"`colo ls` (its command server), {total:,} jobs, vs its Python path",
                   c["big_ls_s"], "s", c["parts"]["python_path"], "`COLO_FAST=0 colo ls`",
                   f"median of {r} interleaved rounds")
    if b:
        rep.figure("ls_vs_before", f"`colo ls`, {a.queue + a.n:,} waiting, vs --before", c["ls_s"], "s", b["ls_s"],
                   "`colo ls` (--before)", f"median of {r} interleaved rounds; before {b['ls_spread']}")
    if p:
        rep.note(f"{p['version']}: slurmctld + slurmd on localhost, started by this bench")
    if "tsp" in rep.extra:
        rep.note(f"task-spooler: {rep.extra['tsp']['version']}")


if __name__ == "__main__":
    os.environ.pop("COLO_FAKEGPU_STATE", None)
    sys.exit(main())
