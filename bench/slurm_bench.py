"""The same queue of N shard jobs through colo under Slurm and through plain Slurm shards, in one
run on this host (issue 49 item 7): two one-node Slurm clusters (slurmctld + `slurmd -N`, their own
free ports, no accounting), each on two simulated 16 GiB GPUs whose driver (native/fakegpu) holds
every GPU to its capacity (an allocation past what is free fails with CUDA_ERROR_OUT_OF_MEMORY);
the first with colo's SPANK plugin and a colo daemon (ConstrainDevices off, so colo picks the GPU:
docs/slurm.md), the second with neither.

Every job is `--gres=shard:S` (S from 512 to 2048 MiB, the same sequence for both) and runs a small
fake-GPU workload: a CUDA context and S/2 MiB, half its --steps steps of --step seconds of "kernel"
time, S/4 MiB more (a job that grows), the other half. One job in --greedy is GREEDY: after its
growth it takes 1 GiB more at a time, up to 12 GiB past its own use, keeping what it gets (a caching
allocator sizing itself by what the GPU gives). Under colo the interposer refuses that excess in
the greedy job only (its budget is its shards); under plain gres/shard it takes the memory that a
neighbour on its GPU needs, and the neighbour's own allocation fails. A job whose own allocation
(context, S/2 or S/4) fails exits 1. The simulated driver has no model of GPU time, so the
workload carries the simplest one: a step takes k times as long while k jobs are on its GPU
(time-slicing; the GPU is the CUDA_VISIBLE_DEVICES the job got, Slurm's index or colo's UUID).

Figures, colo against plain gres/shard:
- drain R: the time from the first submit until no job is left in Slurm, colo's over plain's.
- requeues Q: the jobs colo sent back to Slurm ("Slurm job N cannot run here now" in colo's log;
  each is one `scontrol requeue` by the helper), cross-checked with SLURM_RESTART_COUNT in the
  jobs that ran.
- false requeues F: requeues at whose moment (the log line's time) some GPU of the node had room
  for the job by colo's own budgets: the budgets (shards) of the jobs whose workload was running
  on that GPU then, plus this job's, within the GPU's 16 GiB less colo's reserve (256 MiB). The
  jobs counted are those whose workload ran (from its start to its end), not the whole time colo
  holds a budget (from the helper's attach to the epilog), so F may count a requeue that colo saw
  as full at that moment: it errs against colo.
- failed C (colo) and P (plain): jobs whose last run did not reach its end (an allocation of its
  own refused, or no result at all).
- spread S: of samples every 0.25 s of the run, those with two or more jobs running, the share in
  which all of them sat on one GPU while the other had none (colo's on the last line; plain's in
  the figures). Also: jobs per GPU, and the time colo's helper ran per job (the SPANK plugin's
  steps: attach, batch_exit, the epilog's end), from a wrapper around the helper's interpreter.

Run (as root; apt-get install slurmctld slurmd slurm-client munge libslurm-dev):
    python bench/slurm_bench.py [--jobs 24] [--greedy 20] [--steps 10] [--step 0.3] [--json-out FILE]
Its last line:
    slurm_bench: drain R x plain gres/shard, requeues Q (false F), failed colo C plain P, spread S
"""
from __future__ import annotations

import argparse
import os
import re
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
from harness.daemon import DaemonProc, wait_for  # noqa: E402
from slurm_util import SlurmCluster, munge_up  # noqa: E402

from colo.node import fakegpu, native  # noqa: E402

GiB = 1 << 30
CPUS = 6  # jobs at once per node (one CPU each)
LONG = 600  # seconds: generous limits for a busy machine; every wait ends at its event

# The job: a context and S/2 MiB on the simulated driver, half its steps, S/4 MiB more (and, greedy,
# up to 12 GiB past its own use in 1 GiB pieces, kept as got), the other half; each step `step` s,
# k times as long while k jobs are registered on its GPU (a file each in a folder per GPU). Its
# result: ok|fail, the GPU, workload start, registered, end, SLURM_RESTART_COUNT, MiB it got past
# its ask.
WORK = r"""
import ctypes, os, sys, time
mib, steps, step, reg, out, greedy = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6] == "1"
t0 = time.time()
gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "none").replace("/", "_")
restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
def done(status, t1=0.0, extra=0):
    open(out, "w").write(f"{status} {gpu} {t0} {t1 or t0} {time.time()} {restarts} {extra}\n")
    sys.exit(0 if status == "ok" else 1)
cu = ctypes.CDLL("libcuda.so.1")
ctx, a = ctypes.c_void_p(), ctypes.c_uint64()
if cu.cuInit(0) or cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) or cu.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t((mib // 2) << 20)):
    done("fail")
here = os.path.join(reg, gpu)
os.makedirs(here, exist_ok=True)
me = os.path.join(here, os.environ["SLURM_JOB_ID"])
open(me, "w").close()
t1 = time.time()
def run(span):
    got = 0.0
    while got < span:
        k = max(1, len(os.listdir(here)))
        time.sleep(0.05)
        got += 0.05 / k
run(steps * step / 2)
extra = 0
if cu.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t((mib // 4) << 20)):
    os.unlink(me)
    done("fail", t1)
while greedy and extra < 12 * 1024 and cu.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(1 << 30)) == 0:
    extra += 1024
run(steps * step / 2)
os.unlink(me)
done("ok", t1, extra)
"""


def _wrapper(path: Path, log: Path, real: str) -> None:
    """The helper's interpreter, timed: each call's start, end and arguments in `log`."""
    path.write_text(f'#!/bin/sh\ns=$(date +%s.%N)\n{real} "$@"\nrc=$?\n'
                    f'echo "$s $(date +%s.%N) $*" >> {log}\nexit $rc\n')
    path.chmod(0o755)


def cluster(root: Path, name: str, fk: Path, dev: Path, colo: bool) -> tuple[SlurmCluster, DaemonProc | None]:
    conf = root / "slurm" / "slurm.conf"
    d = None
    plug = None
    if colo:
        (root / "colo-b1").mkdir(mode=0o755)
        d = DaemonProc(root / "colo-b1", fk, {"mps_idle_stop": 600.0, "multi_user_mps": True, "reserve": "256MiB",
                                              "patrol_grace": 2.0}, env={"SLURM_CONF": str(conf)}).start()
        d.fake = fk
        _wrapper(root / "python", root / "helper.log", sys.executable)
        plug = (f"required {native.path('colo_spank.so')} python={root}/python "
                f"socket={root}/colo-%n/run/colo.sock slurm_conf={conf} timeout=120 timing={root}/hooks.log")
        sock = ["--socket", str(d.socket)]
    else:  # the same gres.conf lines, from a daemon of the same GPUs
        sock = None
    gres_lines = gres_conf(fk, dev, sock)
    gres = re.search(r"\bGres=(\S+)", gres_lines[0]).group(1)
    s = SlurmCluster(root / "slurm", {"b1": f"CPUs={CPUS} Gres={gres}"}, cluster=name,
                     gres="\n".join(gres_lines[1:]) + "\n", gres_types="gpu,shard", plugstack=plug,
                     extra=("KillWait=5", "AuthInfo=cred_expire=10", "MaxJobCount=100000"))
    s.start()
    return s, d


def gres_conf(fk: Path, dev: Path, sock: list[str] | None) -> list[str]:
    if sock is None:
        n = len(fakegpu.FakeNode(fk).read()["devices"])
        usable = 16 * 1024 - 256
        return [f"# slurm.conf: NodeName=b1 ... Gres=gpu:{n},shard:{n * usable}",
                *(f"NodeName=b1 Name=gpu File={dev}/nvidia{i}" for i in range(n)),
                *(f"NodeName=b1 Name=shard File={dev}/nvidia{i} Count={usable}" for i in range(n))]
    return subprocess.run([sys.executable, "-m", "colo.cli.slurm", "gres-conf", "--node", "b1", *sock,
                           "--devices", f"{dev}/nvidia%d"], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def sizes(n: int) -> list[int]:
    return [(512, 1024, 2048, 1536)[i % 4] for i in range(n)]


def is_greedy(i: int, every: int) -> bool:
    return every > 0 and i % every == every // 2


def run_queue(s: SlurmCluster, shared: Path, tag: str, args, fk: Path) -> dict:
    """Submits the queue, waits for every job to leave Slurm; what each did."""
    reg = shared / f"reg-{tag}"
    reg.mkdir(mode=0o777)
    lib = native.path(native.FAKEGPU_DIR)
    jobs = {}
    polls = [0]

    def empty() -> bool:
        polls[0] += 1  # the bench's own RPCs, left out below
        return not s.run("squeue", "--local", "-h", "-o", "%i").stdout.strip()

    tries = []
    for _ in range(3):  # what one poll costs slurmctld (the least of three: colo's own squeue may fall in one)
        s.run("sdiag", "-r")
        empty()
        tries.append(sdiag_rpcs(s.run("sdiag").stdout))
    poll = {k: min(t.get(k, 0) for t in tries) for k in tries[0]}
    polls[0] = 0
    s.run("sdiag", "-r")
    t0 = time.time()
    for i, mib in enumerate(sizes(args.jobs)):
        name = f"{tag}{i}"
        sc = shared / f"{name}.sh"
        sc.write_text(f"#!/bin/sh\nexport LD_LIBRARY_PATH=${{LD_LIBRARY_PATH:-{lib}}}\n"
                      f"export COLO_FAKEGPU_STATE=${{COLO_FAKEGPU_STATE:-{fk}}}\n"
                      f"exec {sys.executable} -I {shared}/work.py {mib} {args.steps} {args.step} {reg} "
                      f"{shared}/{name}.result {int(is_greedy(i, args.greedy))}\n")
        sc.chmod(0o755)
        jobs[s.sbatch(sc, f"--gres=shard:{mib}", "-o", f"{shared}/{name}.out")] = (name, mib, is_greedy(i, args.greedy))
    wait_for(empty, LONG * 4, f"the {tag} queue to drain", 0.5)
    drained = time.time()
    rpcs = sdiag_rpcs(s.run("sdiag").stdout)
    for k, n in poll.items():
        rpcs[k] = rpcs.get(k, 0) - n * polls[0]
    out = {}
    for j, (name, mib, greedy) in jobs.items():
        r = shared / f"{name}.result"
        rec = {"mib": mib, "greedy": greedy, "ok": False}
        if r.exists():
            st, gpu, a, b, c, restarts, extra = r.read_text().split()
            rec.update(ok=st == "ok", gpu=gpu, start=float(a), run=float(b), end=float(c), restarts=int(restarts),
                       extra=int(extra))
        out[j] = rec
    return {"t0": t0, "drain": drained - t0, "jobs": out, "rpcs": rpcs}


def sdiag_rpcs(text: str) -> dict[str, int]:
    """slurmctld's RPCs by message type since `sdiag -r` (sdiag's own left out)."""
    out = {}
    part = text.partition("by message type")[2].partition("by user")[0]
    for m in re.finditer(r"^\s*(\w+)\s+\(\s*\d+\)\s+count:(\d+)", part, re.M):
        if m.group(1) != "REQUEST_STATS_INFO":
            out[m.group(1)] = int(m.group(2))
    return out


def samples(jobs: dict, every: float = 0.25) -> list[dict[str, int]]:
    """Jobs per GPU every `every` s, from the first job's start to the last one's end (a job counts
    from its registration on its GPU to its end)."""
    ran = [j for j in jobs.values() if "run" in j]
    if not ran:
        return []
    t, stop = min(j["run"] for j in ran), max(j["end"] for j in ran)
    out = []
    while t <= stop:
        on = {"0": 0, "1": 0}
        for j in ran:
            if j["run"] <= t < j["end"]:
                on[j["gpu"]] = on.get(j["gpu"], 0) + 1
        out.append(on)
        t += every
    return out


def spread_share(jobs: dict) -> float:
    """Of the samples with 2+ jobs running, the share with all of them on one GPU, the other idle."""
    busy = [on for on in samples(jobs) if sum(on.values()) >= 2]
    return sum(1 for on in busy if sum(1 for v in on.values() if v) == 1) / len(busy) if busy else 0.0


REQUEUE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+) colo \w+ Slurm job (\d+) cannot run here now: (.*)$")


def requeues(log: Path) -> list[tuple[float, str, str]]:
    """(time, Slurm job, reason) of each job colo sent back to Slurm, from its daemon's log."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = REQUEUE.match(line)
        if m:
            t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            out.append((t, m.group(3), m.group(4)))
    return out


def false_requeues(req: list[tuple[float, str, str]], jobs: dict, usable: int) -> list[tuple[float, str, str]]:
    """The requeues at whose moment some GPU had room for the job by colo's budgets (the module's
    docstring): the shards of the jobs running on it then, plus this job's, within `usable` MiB."""
    out = []
    for t, sj, why in req:
        need = jobs[int(sj)]["mib"] if int(sj) in jobs else 0
        held = {"0": 0, "1": 0}
        for j in jobs.values():
            if "run" in j and j["start"] <= t < j["end"]:
                held[j["gpu"]] = held.get(j["gpu"], 0) + j["mib"]
        if any(h + need <= usable for h in held.values()):
            out.append((t, sj, why))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=24)
    ap.add_argument("--greedy", type=int, default=20, help="one job in this many is greedy (0: none)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--step", type=float, default=0.3)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("slurmctld") is None:
        print("slurm_bench: needs root and Slurm (slurmctld, slurmd, slurm-client, munge)", file=sys.stderr)
        return 2
    munge_up()
    rep = Report("slurm_bench")
    top = Path(tempfile.mkdtemp(prefix="colo-slurmbench-"))
    os.chmod(top, 0o755)
    res = {}
    try:
        for tag, colo in (("colo", True), ("plain", False)):
            root = top / tag
            root.mkdir(mode=0o755)
            shared = root / "jobs"
            shared.mkdir(mode=0o777)
            (shared / "work.py").write_text(WORK)
            dev = root / "dev"
            dev.mkdir()
            for i in range(2):
                os.mknod(dev / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
            fk = root / "fakegpu"
            fk.mkdir(mode=0o777)
            fakegpu.create(fk / "state", count=2, mem=16 * GiB,
                           uuids=[f"GPU-b{tag[0]}000000-0000-0000-0000-00000000000{i}" for i in range(2)])
            s, d = cluster(root, f"bench{tag}", fk / "state", dev, colo)
            try:
                res[tag] = run_queue(s, shared, tag, args, fk / "state")
                if d is not None:
                    uuid = {x["uuid"]: str(x["index"]) for x in fakegpu.FakeNode(fk / "state").read()["devices"]}
                    for j in res[tag]["jobs"].values():
                        if "gpu" in j:
                            j["gpu"] = uuid.get(j["gpu"], j["gpu"])
                    res[tag]["requeues"] = requeues(d.log)
                    res[tag]["helper"] = helper_times(root / "helper.log")
                    res[tag]["hooks"] = hook_times(root / "hooks.log")
                    probs = daemon_log_problems(d.log)
                    rep.check(not probs, f"colo's daemon logged an error: {probs[:3]}")
            finally:
                s.stop()
                if d is not None:
                    d.stop()
    finally:
        if os.environ.get("COLO_KEEP_SLURM_TEST") != "1":
            shutil.rmtree(top, ignore_errors=True)
    c, p = res["colo"], res["plain"]
    failed = {t: sum(1 for j in r["jobs"].values() if not j["ok"]) for t, r in res.items()}
    silent = {t: sum(1 for j in r["jobs"].values() if "gpu" not in j) for t, r in res.items()}
    greedy_failed = {t: sum(1 for j in r["jobs"].values() if not j["ok"] and j["greedy"]) for t, r in res.items()}
    req = c["requeues"]
    false = false_requeues(req, c["jobs"], 16 * 1024 - 256)
    restarts = sum(j.get("restarts", 0) for j in c["jobs"].values())
    rep.check(restarts <= len(req), f"colo: the jobs ran after {restarts} restarts, colo's log has {len(req)} requeues")
    per_gpu = {t: {g: sum(1 for j in r["jobs"].values() if j.get("gpu") == g) for g in ("0", "1")} for t, r in res.items()}
    spread = {t: spread_share(r["jobs"]) for t, r in res.items()}
    ratio = c["drain"] / p["drain"]
    greedy = sum(1 for j in c["jobs"].values() if j["greedy"])
    rep.figure("drain", "drain, first submit to an empty queue", c["drain"], "s", p["drain"], "plain gres/shard")
    rep.figure("failed", f"failed jobs (of {args.jobs}, {greedy} greedy)", failed["colo"], "", failed["plain"],
               "plain gres/shard", note=f"greedy among them: colo {greedy_failed['colo']}, plain {greedy_failed['plain']}; "
               f"no result at all: colo {silent['colo']}, plain {silent['plain']} (the others: an allocation refused)")
    rep.figure("requeues", "requeues under colo", len(req), "", note=f"false {len(false)}; restarts seen by jobs {restarts}")
    rep.figure("spread", "samples with 2+ jobs, all on one GPU, other idle", 100 * spread["colo"], "%",
               100 * spread["plain"],
               "plain gres/shard")
    rep.figure("jobs_gpu0", "jobs on GPU0 (of the 2)", per_gpu["colo"]["0"], "", per_gpu["plain"]["0"], "plain gres/shard")
    rep.figure("jobs_gpu1", "jobs on GPU1", per_gpu["colo"]["1"], "", per_gpu["plain"]["1"], "plain gres/shard")
    extra = {t: max((j.get("extra", 0) for j in r["jobs"].values() if j["greedy"]), default=0) for t, r in res.items()}
    rep.figure("greed", "most a greedy job got past its own use", extra["colo"], "MiB", extra["plain"], "plain gres/shard")
    h = c.get("helper", {})
    per_job = [sum(v) for v in h.values()]
    if per_job:
        rep.figure("helper", "colo's helper time per job (median)", statistics.median(per_job), "s",
                   note=f"max {max(per_job):.2f} s, {statistics.mean(len(v) for v in h.values()):.1f} helper runs per job")
    hooks = c.get("hooks", {})
    if hooks:
        starts = statistics.mean(sum(py for _, _, py in v) for v in hooks.values())
        each = [sec for v in hooks.values() for _, sec, _ in v]
        rep.figure("python_starts", "Python starts per job (the plugin's hooks)", starts, "",
                   note=f"{len(hooks)} jobs; hooks per job {statistics.mean(len(v) for v in hooks.values()):.1f}")
        rep.figure("hook_time", "plugin hook time (median)", statistics.median(each), "s", note=f"max {max(each):.2f} s; "
                   + ", ".join(f"{k} median {statistics.median(x):.3f} s" for k in ("attach", "batch_exit", "end")
                               if (x := [sec for v in hooks.values() for n, sec, _ in v if n == k])))
    rpc = {t: sum(r["rpcs"].values()) / args.jobs for t, r in res.items()}
    diff = {k: c["rpcs"].get(k, 0) - p["rpcs"].get(k, 0) for k in set(c["rpcs"]) | set(p["rpcs"])}
    rep.figure("rpcs", "slurmctld RPCs per job (sdiag)", rpc["colo"], "", rpc["plain"], "plain gres/shard",
               note=f"extra per job {rpc['colo'] - rpc['plain']:.1f}: " + ", ".join(
                   f"{k} {v / args.jobs:+.2f}" for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1])) if v))
    for t, sj, why in req:
        rep.note(f"requeue of Slurm job {sj}{' (false)' if (t, sj, why) in false else ''}: {why}")
    rep.extra = {"per_gpu": per_gpu, "drain": {t: r["drain"] for t, r in res.items()}, "failed": failed,
                 "requeues": len(req), "false_requeues": len(false), "spread": spread,
                 "rpcs": {t: r["rpcs"] for t, r in res.items()}, "load": os.getloadavg()}
    code = rep.finish(args.json_out)
    print(f"slurm_bench: drain {ratio:.2f} x plain gres/shard, requeues {len(req)} (false {len(false)}), "
          f"failed colo {failed['colo']} plain {failed['plain']}, spread {spread['colo']:.2f}")
    return code


def hook_times(log: Path) -> dict[str, list[tuple[str, float, int]]]:
    """Slurm job id -> (hook, seconds, whether it started Python) of each plugin hook that did
    colo's work for it (the plugin's timing=FILE)."""
    out: dict[str, list[tuple[str, float, int]]] = {}
    if not log.exists():
        return out
    for line in log.read_text().splitlines():
        m = re.match(r"(\w+) job=(\d+) seconds=(\S+) python=(\d)$", line)
        if m:
            out.setdefault(m.group(2), []).append((m.group(1), float(m.group(3)), int(m.group(4))))
    return out


def helper_times(log: Path) -> dict[str, list[float]]:
    """Slurm job id -> seconds of each helper run for it."""
    out: dict[str, list[float]] = {}
    if not log.exists():
        return out
    for line in log.read_text().splitlines():
        m = re.match(r"(\S+) (\S+) .*--job=(\d+)", line)
        if m:
            out.setdefault(m.group(3), []).append(float(m.group(2)) - float(m.group(1)))
    return out


if __name__ == "__main__":
    sys.exit(main())
