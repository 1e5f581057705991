"""N shard jobs through colo under Slurm beside the same N jobs under plain Slurm shards, in one run
on this host: two one-node Slurm clusters (slurmctld + `slurmd -N`, their own free ports, no
accounting), each on two simulated 16 GiB GPUs; the first with colo's SPANK plugin and a colo
daemon (ConstrainDevices off, so colo picks the GPU: docs/slurm.md), the second with neither.

Every job is `--gres=shard:S` (S from 512 to 2048 MiB, the same sequence for both) and runs a small
fake-GPU workload: a CUDA context and S/2 MiB on the simulated driver (native/fakegpu), then
--steps steps of --step seconds of "kernel" time. The simulated driver has no model of GPU time,
so the workload carries the simplest one: a step takes k times as long while k jobs are on its GPU
(time-slicing shares a GPU's time; the GPU is the CUDA_VISIBLE_DEVICES the job got, Slurm's index
or colo's UUID). So the makespan shows what the jobs' spread over GPUs costs.

Figures (colo, then plain Slurm as the baseline): how many jobs ran on each GPU; the share of the
time with two or more jobs running that every running job sat on one GPU while the other had none
(`spread`); the makespan, first submit to last end; per job, the time colo's helper ran for it
(the SPANK plugin's steps: attach at the batch step, batch_exit, the epilog's end), from a wrapper
around the helper's interpreter. Refused unless every job ran its workload to the end on both.

Run (as root; apt-get install slurmctld slurmd slurm-client munge libslurm-dev):
    python bench/slurm_bench.py [--jobs 24] [--steps 10] [--step 0.3] [--json-out FILE]
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

# The job: a context and memory on the simulated driver, then `steps` steps of `step` s, each k
# times as long while k jobs are registered on its GPU (a file each in a folder per GPU).
WORK = r"""
import ctypes, os, sys, time
mem, steps, step, reg, out = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
t0 = time.time()
cu = ctypes.CDLL("libcuda.so.1")
ctx, a = ctypes.c_void_p(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
assert cu.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(mem << 20)) == 0
gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "none").replace("/", "_")
here = os.path.join(reg, gpu)
os.makedirs(here, exist_ok=True)
me = os.path.join(here, os.environ["SLURM_JOB_ID"])
open(me, "w").close()
t1 = time.time()
done = 0.0
while done < steps * step:
    k = max(1, len(os.listdir(here)))
    time.sleep(0.05)
    done += 0.05 / k
os.unlink(me)
open(out, "w").write(f"{gpu} {t0} {t1} {time.time()}\n")
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
                f"socket={root}/colo-%n/run/colo.sock slurm_conf={conf} timeout=120")
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


def run_queue(s: SlurmCluster, shared: Path, tag: str, args, fk: Path) -> dict:
    """Submits the queue, waits for every job to leave Slurm; what each did."""
    reg = shared / f"reg-{tag}"
    reg.mkdir(mode=0o777)
    lib = native.path(native.FAKEGPU_DIR)
    jobs = {}
    t0 = time.time()
    for i, mib in enumerate(sizes(args.jobs)):
        name = f"{tag}{i}"
        sc = shared / f"{name}.sh"
        sc.write_text(f"#!/bin/sh\nexport LD_LIBRARY_PATH=${{LD_LIBRARY_PATH:-{lib}}}\n"
                      f"export COLO_FAKEGPU_STATE=${{COLO_FAKEGPU_STATE:-{fk}}}\n"
                      f"exec {sys.executable} -I {shared}/work.py {mib // 2} {args.steps} {args.step} {reg} "
                      f"{shared}/{name}.result\n")
        sc.chmod(0o755)
        jobs[s.sbatch(sc, f"--gres=shard:{mib}", "-o", f"{shared}/{name}.out")] = name
    wait_for(lambda: not s.run("squeue", "-h", "-o", "%i").stdout.strip(), LONG, f"the {tag} queue to drain", 0.5)
    out = {}
    for j, name in jobs.items():
        r = shared / f"{name}.result"
        if r.exists():
            gpu, a, b, c = r.read_text().split()
            out[j] = {"gpu": gpu, "start": float(a), "run": float(b), "end": float(c)}
    return {"t0": t0, "jobs": out, "ids": list(jobs)}


def spread_share(jobs: dict) -> float:
    """Of the time with 2+ jobs running, the share in which they all sat on one GPU (the other idle)."""
    ev = sorted([(j["run"], 1, j["gpu"]) for j in jobs.values()] + [(j["end"], -1, j["gpu"]) for j in jobs.values()])
    on: dict[str, int] = {}
    busy = piled = 0.0
    last = None
    for t, step, gpu in ev:
        if last is not None:
            n = sum(on.values())
            if n >= 2:
                busy += t - last
                if sum(1 for v in on.values() if v) == 1:
                    piled += t - last
        on[gpu] = on.get(gpu, 0) + step
        last = t
    return piled / busy if busy else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=24)
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
                        j["gpu"] = uuid.get(j["gpu"], j["gpu"])
                    res[tag]["requeues"] = sum(int(s.show(j).get("Restarts", "0") or 0) for j in res[tag]["ids"])
                    res[tag]["helper"] = helper_times(root / "helper.log")
                    probs = daemon_log_problems(d.log)
                    rep.check(not probs, f"colo's daemon logged an error: {probs[:3]}")
            finally:
                s.stop()
                if d is not None:
                    d.stop()
    finally:
        if os.environ.get("COLO_KEEP_SLURM_TEST") != "1":
            shutil.rmtree(top, ignore_errors=True)
    for tag in ("colo", "plain"):
        rep.check(len(res[tag]["jobs"]) == args.jobs,
                  f"{tag}: {len(res[tag]['jobs'])} of {args.jobs} jobs ran their workload to the end")
    c, p = res["colo"], res["plain"]
    span = {t: max(j["end"] for j in r["jobs"].values()) - r["t0"] for t, r in res.items() if r["jobs"]}
    per_gpu = {t: {g: sum(1 for j in r["jobs"].values() if j["gpu"] == g) for g in ("0", "1")} for t, r in res.items()}
    rep.figure("jobs_gpu0", "jobs on GPU0 (of the 2)", per_gpu["colo"]["0"], "", per_gpu["plain"]["0"], "plain gres/shard")
    rep.figure("jobs_gpu1", "jobs on GPU1", per_gpu["colo"]["1"], "", per_gpu["plain"]["1"], "plain gres/shard")
    rep.figure("spread", "time all on one GPU, other idle", 100 * spread_share(c["jobs"]), "%",
               100 * spread_share(p["jobs"]), "plain gres/shard")
    if "colo" in span and "plain" in span:
        rep.figure("makespan", "makespan (first submit to last end)", span["colo"], "s", span["plain"],
                   "plain gres/shard")
    h = c.get("helper", {})
    per_job = [sum(v) for v in h.values()]
    if per_job:
        rep.figure("helper", "colo's helper time per job (median)", statistics.median(per_job), "s",
                   note=f"max {max(per_job):.2f} s, {statistics.mean(len(v) for v in h.values()):.1f} helper runs per job")
    rep.figure("requeues", "requeues under colo", c.get("requeues", 0), "")
    rep.extra = {"per_gpu": per_gpu, "makespan": span}
    code = rep.finish(args.json_out)
    if not rep.failures:
        ratio = span["colo"] / span["plain"]
        print(f"slurm_bench: makespan {ratio:.2f}x plain gres/shard, jobs per GPU colo "
              f"{per_gpu['colo']['0']}/{per_gpu['colo']['1']} plain {per_gpu['plain']['0']}/{per_gpu['plain']['1']}, "
              f"spread colo {spread_share(c['jobs']):.2f} plain {spread_share(p['jobs']):.2f}, "
              f"helper {statistics.median(per_job) if per_job else 0:.2f} s/job, requeues {c.get('requeues', 0)}")
    return code


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
