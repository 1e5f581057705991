"""Which GPU a Slurm job runs on, under a real Slurm on this host: one node (`slurmd -N s1`, its
own ports, no accounting) with two simulated 16 GiB GPUs, colo's SPANK plugin and one colo daemon,
and no cgroup device constraint, so colo picks the physical GPU (slurm_gpu_choice = "colo",
docs/slurm.md). Slurm 22.05 puts shard jobs on the first GPU that has the shards and hands a GPU
out whole while shards of it are in use; here two shard jobs run on different GPUs, and a
gres/gpu job that finds both GPUs in use gets the GPU colo kept free for it once that GPU's job
ends. Every wait is on an event (Slurm's job states, colo's records), never on the clock.
Skips when Slurm is not installed here; fails instead when COLO_REQUIRE_SLURM=1 (CI).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from colo.daemon.slurmgpu import devices_constrained, for_whole, least_loaded
from colo.node import fakegpu, native
from colo.sched import policy
from harness.daemon import DaemonProc, wait_for
from slurm_util import SlurmCluster, munge_up

GiB = 1024**3
REQUIRE = os.environ.get("COLO_REQUIRE_SLURM") == "1"
LONG = 180  # seconds: generous, for a busy 2-core machine; every wait ends at its event

# A shard job's program: a CUDA context and `mem` MiB on the simulated driver, then it stays until
# Slurm ends it (scancel).
HOLD = r"""
import ctypes, sys, time
mem, out = int(sys.argv[1]), sys.argv[2]
cu = ctypes.CDLL("libcuda.so.1")
ctx, a = ctypes.c_void_p(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
r = cu.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(mem << 20))
open(out, "w").write(f"alloc {r}\n")
while True:
    time.sleep(1)
"""


def _need(msg: str):
    if REQUIRE:
        pytest.fail(f"COLO_REQUIRE_SLURM=1 but {msg}")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def spread(other_user, native_dir):
    for exe in ("slurmctld", "slurmd", "sbatch", "munged"):
        if shutil.which(exe) is None:
            _need(f"{exe} is not installed (apt-get install slurmctld slurmd slurm-client munge libslurm-dev)")
    try:
        plugin = native.path("colo_spank.so")
    except native.NativeMissing:
        _need("colo's SPANK plugin is not built (libslurm-dev missing when native/ was built)")
    if os.geteuid() != 0:
        _need("slurmd must run as root")
    munge_up()
    root = Path(tempfile.mkdtemp(prefix="colo-spread-"))
    os.chmod(root, 0o755)
    shared = root / "jobs"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    (shared / "hold.py").write_text(HOLD)
    dev = root / "dev"
    dev.mkdir()
    for i in range(2):
        os.mknod(dev / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
        os.chmod(dev / f"nvidia{i}", 0o666)
    conf = root / "slurm" / "slurm.conf"
    fk = root / "fakegpu"
    fk.mkdir(mode=0o777)
    os.chmod(fk, 0o777)
    fakegpu.create(fk / "state", count=2, mem=16 * GiB,
                   uuids=[f"GPU-s1000000-0000-0000-0000-00000000000{i}" for i in range(2)])
    (root / "colo-s1").mkdir(mode=0o755)
    d = DaemonProc(root / "colo-s1", fk / "state",
                   {"mps_idle_stop": 600.0, "multi_user_mps": True, "reserve": "256MiB", "patrol_grace": 2.0},
                   env={"SLURM_CONF": str(conf)}).start()
    d.fake = fk / "state"
    node = None
    try:
        out = subprocess.run([sys.executable, "-m", "colo.cli.slurm", "gres-conf", "--node", "s1",
                              "--socket", str(d.socket), "--devices", f"{dev}/nvidia%d"],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        gres = re.search(r"\bGres=(\S+)", out[0]).group(1)
        node = SlurmCluster(
            root / "slurm", {"s1": f"CPUs=8 Gres={gres}"},
            cluster="colospread", gres="\n".join(out[1:]) + "\n", gres_types="gpu,shard",
            users=("root", other_user.pw_name),
            plugstack=f"required {plugin} python={sys.executable} socket={root}/colo-%n/run/colo.sock "
                      f"slurm_conf={conf} timeout=120",
            extra=("KillWait=5", "AuthInfo=cred_expire=10"))  # a requeued job comes back after 10 s
        assert node.conf == conf
        node.start()
    except BaseException:
        d.stop()
        if node is not None:
            node.stop()
        raise
    node.shared, node.daemon = shared, d
    yield node
    node.stop()
    d.stop()
    if os.environ.get("COLO_KEEP_SLURM_TEST") != "1":
        shutil.rmtree(root, ignore_errors=True)


def _script(node, name: str, body: str) -> Path:
    s = node.shared / f"{name}.sh"
    s.write_text(f"#!/bin/sh\n{body}\n")
    s.chmod(0o755)
    return s


def _shard_job(node, user, name: str, mib: int) -> int:
    s = _script(node, name, f"exec /usr/bin/python3 {node.shared}/hold.py 512 {node.shared}/{name}.result")
    return node.sbatch(s, f"--gres=shard:{mib}", "-o", f"{node.shared}/{name}.out", user=user)


def _colo_job(d, slurm_job: int) -> dict | None:
    return next((j for j in d.client.ls(all=True) if j.get("slurm_job") == slurm_job), None)


def _running_in_colo(node, slurm_job: int) -> dict:
    """colo's record of the job once it runs there."""
    return wait_for(lambda: (j := _colo_job(node.daemon, slurm_job)) and j["state"] == "running" and j,
                    LONG, f"Slurm job {slurm_job} to run in colo", 0.5)


def _uuid(node, index: int) -> str:
    return fakegpu.FakeNode(node.daemon.fake).read()["devices"][index]["uuid"]


def _index(node, uuid: str) -> int:
    return next(d["index"] for d in fakegpu.FakeNode(node.daemon.fake).read()["devices"] if d["uuid"] == uuid)


def _slurm_gpu(node, job: int, name: str) -> int:
    r = node.run("scontrol", "show", "job", "-d", str(job)).stdout
    return int(re.search(rf"GRES=\S*{name}:\d+\(IDX:(\d+)\)", r).group(1))


def _end(node, *jobs: int) -> None:
    node.run("scancel", *map(str, jobs))
    for j in jobs:
        wait_for(lambda j=j: node.state(j)[0] == "", LONG, f"Slurm job {j} to end", 0.5)


def test_shard_jobs_spread_and_a_gpu_job_gets_the_gpu_kept_free_for_it(spread, other_user):
    node, d = spread, spread.daemon
    # Two shard jobs: Slurm 22.05 would put both on GPU0 (its first GPU with the shards); colo runs
    # them on different GPUs, each with its budget, and says where on the job.
    a = _shard_job(node, other_user, "a", 2048)
    ja = _running_in_colo(node, a)
    b = _shard_job(node, other_user, "b", 2048)
    jb = _running_in_colo(node, b)
    assert ja["gpus"] != jb["gpus"] and ja["budget"] == jb["budget"] == 2 * GiB, (ja, jb)
    assert _slurm_gpu(node, a, "shard") == _slurm_gpu(node, b, "shard") == 0  # Slurm's own: both on GPU0
    moved = next(j for j in (ja, jb) if j["gpus"] == [_uuid(node, 1)])
    assert "(colo's choice, the least loaded GPU; Slurm bound GPU0)" in d.cli("explain", str(moved["id"])).stdout
    for name, j in (("a", ja), ("b", jb)):
        assert wait_for(lambda name=name: (node.shared / f"{name}.result").exists(), LONG, f"job {name}'s program",
                        0.5) and (node.shared / f"{name}.result").read_text().split() == ["alloc", "0"]
        note = node.show(j["slurm_job"])["AdminComment"]
        gpu = _index(node, j["gpus"][0])
        assert note.startswith(f"colo: job {j['id']} on GPU{gpu} ({j['gpus'][0]})"), note

    # A whole-GPU job: both GPUs hold colo's jobs, so it is requeued, and colo keeps one GPU (the
    # least loaded) free of new jobs until it comes back.
    # (its second step starts once the test says so, after a colo restart)
    gsh = _script(node, "gpujob", f'echo "cvd=$CUDA_VISIBLE_DEVICES" > {node.shared}/$SLURM_JOB_ID.cvd\n'
                                  f"while [ ! -e {node.shared}/$SLURM_JOB_ID.go ]; do sleep 0.2; done\n"
                                  f"srun -n1 sh -c 'echo cvd=$CUDA_VISIBLE_DEVICES' > {node.shared}/$SLURM_JOB_ID.step\n"
                                  f"exec sleep 600")
    g = node.sbatch(gsh, "--gres=gpu:1", "-o", "/dev/null", user=other_user)
    note = wait_for(lambda: (s := node.show(g)).get("Restarts") == "1" and "colo places no new job on GPU"
                    in s.get("AdminComment", "") and s["AdminComment"], LONG, "the gpu job to be requeued", 0.5)
    kept = int(re.search(r"colo places no new job on GPU (\d+) until it comes back", note).group(1))
    assert not (node.shared / f"{g}.cvd").exists()
    # A shard job that comes meanwhile goes to the other GPU, whichever GPU Slurm bound it to.
    c = _shard_job(node, other_user, "c", 1024)
    jc = _running_in_colo(node, c)
    assert jc["gpus"] == [_uuid(node, 1 - kept)], (kept, jc)
    # The job on the kept GPU ends: the gpu job, back from Slurm's queue, gets that GPU whole.
    on_kept = next(j for j in (ja, jb) if j["gpus"] == [_uuid(node, kept)])
    _end(node, on_kept["slurm_job"])
    wait_for(lambda: d.job(on_kept["id"])["state"] in ("cancelled", "failed", "succeeded"), LONG,
             "the kept GPU's job to end in colo", 0.5)
    cvd = wait_for(lambda: (p := node.shared / f"{g}.cvd").exists() and p.read_text().strip(), LONG,
                   "the gpu job to run once the kept GPU was free", 0.5)
    assert node.state(g)[0] == "RUNNING"
    bound = _slurm_gpu(node, g, "gpu")
    assert cvd == (f"cvd={bound}" if bound == kept else f"cvd={_uuid(node, kept)}"), (cvd, bound, kept)
    # While it runs, no shard job goes to its GPU, whatever Slurm bound.
    e = _shard_job(node, other_user, "e", 1024)
    je = _running_in_colo(node, e)
    assert je["gpus"] == [_uuid(node, 1 - kept)], (kept, je)
    # colo killed and started again: the gpu job's next step gets the GPU its first step got (the
    # job's mark keeps it), and from then on colo keeps shard jobs off it again.
    d.kill9()
    d.start()
    (node.shared / f"{g}.go").touch()
    step = wait_for(lambda: (p := node.shared / f"{g}.step").exists() and p.read_text().strip(), LONG,
                    "the gpu job's second step", 0.5)
    assert step == cvd, (step, cvd)
    f = _shard_job(node, other_user, "f", 1024)
    jf = _running_in_colo(node, f)
    assert jf["gpus"] == [_uuid(node, 1 - kept)], (kept, jf)
    _end(node, g, c, e, f, *(j["slurm_job"] for j in (ja, jb) if j is not on_kept))


def test_a_gpu_job_slurm_gives_a_shard_jobs_gpu_runs_on_the_free_one(spread, other_user):
    """Slurm 22.05 hands out GPU0 whole while a shard job runs there and GPU1 is idle: colo runs the
    gpu job on GPU1 at once (no requeue), and keeps shard jobs off it while it runs."""
    node = spread
    h = _shard_job(node, other_user, "h", 2048)
    assert _running_in_colo(node, h)["gpus"] == [_uuid(node, 0)]
    gsh = _script(node, "gpu2", f'echo "cvd=$CUDA_VISIBLE_DEVICES" > {node.shared}/$SLURM_JOB_ID.cvd\nexec sleep 600')
    g = node.sbatch(gsh, "--gres=gpu:1", "-o", "/dev/null", user=other_user)
    cvd = wait_for(lambda: (p := node.shared / f"{g}.cvd").exists() and p.read_text().strip(), LONG,
                   "the gpu job to run", 0.5)
    bound = _slurm_gpu(node, g, "gpu")
    assert node.show(g).get("Restarts") == "0"
    assert cvd == (f"cvd={_uuid(node, 1)}" if bound == 0 else f"cvd={bound}"), (cvd, bound)
    i = _shard_job(node, other_user, "i", 1024)
    assert _running_in_colo(node, i)["gpus"] == [_uuid(node, 0)]
    _end(node, g, h, i)


def test_with_constrained_devices_the_gpu_stays_slurms():
    """colo never moves a job off Slurm's GPU where Slurm lets the job open that device only."""
    with tempfile.TemporaryDirectory() as t:
        env = {"SLURM_CONF": f"{t}/slurm.conf"}
        assert not devices_constrained(env)  # no cgroup.conf: Slurm's default, no constraint
        Path(t, "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n# ConstrainDevices=yes\nConstrainDevices=no\n")
        assert not devices_constrained(env)
        Path(t, "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n  constrainDevices = YES # jobs see their GPUs\n")
        assert devices_constrained(env)


def test_the_least_loaded_gpu_and_a_whole_gpu_are_chosen_from_colos_view():
    g = [policy.GpuView(f"u{i}", i, 16 * GiB) for i in range(3)]
    placed = [policy.Placed(1, ("u0",), 4 * GiB), policy.Placed(2, ("u1",), 2 * GiB)]
    cand = policy.Candidate(0, GiB, 1, 1000, 0, 0, None)
    cfg = policy.PolicyConfig()
    dec, _ = least_loaded(cand, 0, g, placed, set(), {}, cfg, {})
    assert dec.gpus == ("u2",) and "Slurm bound GPU0" in dec.reason  # the empty one
    dec, _ = least_loaded(cand, 0, g, placed, {2}, {}, cfg, {})  # GPU2 held whole by a gpu job
    assert dec.gpus == ("u1",)
    dec, why = least_loaded(cand, 0, g, placed, {2}, {1: 77}, cfg, {})  # GPU1 kept free for gpu job 77
    assert dec.gpus == ("u0",) and not why
    big = policy.Candidate(0, 14 * GiB, 1, 1000, 0, 0, None)
    dec, why = least_loaded(big, 0, g, placed, {2}, {1: 77}, cfg, {})
    assert dec is None and "GPU0 cannot hold its 14GiB now: 12GiB free" in why and "kept free for Slurm job 77" in why \
        and "GPU2 is held whole" in why, why
    # A gpu job: a GPU none of colo's jobs is on, Slurm's first among free ones; else the least loaded kept.
    load = {"u0": 4 * GiB, "u1": 2 * GiB}
    assert for_whole(1, [0], g, load, set(), {}, set()) == ([2], set())
    assert for_whole(1, [0], g, load, {2}, {}, set()) == ([], {1})
    assert for_whole(1, [0], g, load, {2}, {}, {0}) == ([], {0})  # kept for it already: kept on
    assert for_whole(1, [2], g, {}, set(), {}, set()) == ([2], set())
    assert for_whole(1, [0], g, load, {2}, {1: 5}, set()) == ([], {0})  # GPU1 is another job's
