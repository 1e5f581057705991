"""colo under a real Slurm: a two-node cluster on this host (slurmctld, `slurmd -N n1` and `-N n2`
with one port each, slurmdbd on a private MariaDB, munge), colo's SPANK plugin, and one real colo
daemon per node on simulated 16 GiB GPUs (n1: two, n2: one; 256 MiB reserve, so 15.75 GiB usable).

Each GPU's usable memory is a per-GPU `gres/shard` count in MiB bound to its device file (the
gres.conf lines come from `python -m colo.cli.slurm gres-conf`, as docs/slurm.md says), a QOS caps
a job's shards per node at one GPU's, and cgroup device constraint is on where cgroup v1 has its
devices controller. Jobs are submitted with sbatch by a second Unix user and run a small CUDA
program (ctypes on the simulated libcuda.so.1), so what is checked is what Slurm, the plugin, the
daemons, the interposer and the (fake) MPS control daemon do together. One cluster serves the
module. Skips when Slurm is not installed here; fails instead when COLO_REQUIRE_SLURM=1 (CI).
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

from colo import profiles
from colo.cli.slurm import SlurmError, allocation, job_exit, job_record, profile_key, reference
from colo.node import fakegpu, native
from harness.daemon import DaemonProc, wait_for
from slurm_util import SlurmCluster, cgroup_v1_devices, munge_up

GiB = 1024**3
MiB = 1024**2
REQUIRE = os.environ.get("COLO_REQUIRE_SLURM") == "1"
USABLE = 16128  # MiB of a 16 GiB GPU less colo's 256 MiB reserve: 15.75 GiB
DOCS = Path(__file__).resolve().parent.parent / "docs" / "slurm.md"

# The job's program: allocates MEM MiB, then OVER MiB more (the budget should refuse it), reports
# what the driver said, then stays an active CUDA process for SECONDS. On SIGTERM it keeps running
# (as a framework saving a checkpoint would) until the driver says colo sent terminate_client.
CUDA_JOB = r"""
import ctypes, signal, sys, time
mem, over, seconds, out = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), open(sys.argv[4], "w", buffering=1)
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
ctx, a, b = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_uint64()
free, total = ctypes.c_size_t(), ctypes.c_size_t()
term = []
signal.signal(signal.SIGTERM, lambda *_: term.append(time.monotonic()))  # before it says it is ready
assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
r1 = cu.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(mem << 20))
r2 = cu.cuMemAlloc_v2(ctypes.byref(b), ctypes.c_size_t(over << 20)) if over else -1
cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
out.write(f"alloc {r1} over {r2} total {total.value}\n")
end = time.monotonic() + seconds
while time.monotonic() < end:
    if cu.cuCtxSynchronize() == 810:  # CUDA_ERROR_MPS_CLIENT_TERMINATED: terminate_client reached us
        out.write("terminated" + (" after SIGTERM" if term else "") + "\n")
        sys.exit(0)
    if term and time.monotonic() - term[0] > 25:
        out.write("SIGTERM but no terminate_client\n")
        sys.exit(1)
    time.sleep(0.05)
out.write("done\n")
"""
# Whether this process may open each GPU device file: ENXIO (no driver behind it) means the
# cgroup let it through, EPERM that Slurm's device constraint refused it.
DEV_CHECK = r"""
import errno, os, sys
for p in sys.argv[1:]:
    try:
        os.close(os.open(p, os.O_RDWR))
        print("open", end=" ")
    except OSError as e:
        print(errno.errorcode[e.errno], end=" ")
print()
"""


def _need(msg: str):
    if REQUIRE:
        pytest.fail(f"COLO_REQUIRE_SLURM=1 but {msg}")
    pytest.skip(msg)


def _wrapper(path: Path, log: Path, real: str, tag: str = "") -> None:
    """An executable that notes each call (with `tag`) in `log`, then runs `real`."""
    path.write_text(f'#!/bin/sh\necho "{tag}$*" >> {log}\nexec {real} "$@"\n')
    path.chmod(0o755)


@pytest.fixture(scope="module")
def cluster(other_user, native_dir):
    for exe in ("slurmctld", "slurmd", "slurmdbd", "sbatch", "sacctmgr", "munged", "mariadbd", "mariadb"):
        if shutil.which(exe) is None:
            _need(f"{exe} is not installed (apt-get install slurmctld slurmd slurmdbd slurm-client munge "
                  "libslurm-dev mariadb-server)")
    try:
        plugin = native.path("colo_spank.so")
    except native.NativeMissing:
        _need("colo's SPANK plugin is not built (libslurm-dev missing when native/ was built)")
    if os.geteuid() != 0:
        _need("slurmd must run as root")
    munge_up()
    root = Path(tempfile.mkdtemp(prefix="colo-slurm-"))
    os.chmod(root, 0o755)
    shared = root / "jobs"  # scripts and outputs of the jobs' user
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    (shared / "cuda_job.py").write_text(CUDA_JOB)
    (shared / "dev_check.py").write_text(DEV_CHECK)
    dev = root / "dev"  # the GPUs' device files, as the driver makes them (no driver behind them here)
    dev.mkdir()
    for i in range(2):
        os.mknod(dev / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
        os.chmod(dev / f"nvidia{i}", 0o666)  # as the driver's default NVreg_DeviceFileMode
    prof = root / "profiles"
    prof.mkdir()
    n = 30
    p = profiles.from_samples("light", {"times": list(range(n)), "sm": [0.2] * n, "mem": [512 << 20] * n,
                                        "membw": [0.1] * n}, runtime=600, cache_bound=False)
    profiles.save(p, prof / "light.profile")
    # Every call colo makes of squeue, and every start of its helper, noted (item: scale).
    wrap = root / "wrap"
    wrap.mkdir()
    _wrapper(wrap / "squeue", root / "squeue.log", shutil.which("squeue"), "$COLO_TEST_NODE ")
    _wrapper(wrap / "python", root / "helper.log", sys.executable)
    conf = root / "slurm" / "slurm.conf"
    daemons, gres, node_gres = {}, [], {}
    try:
        for name, count in (("n1", 2), ("n2", 1)):
            fk = root / f"fakegpu-{name}"
            fk.mkdir(mode=0o777)
            os.chmod(fk, 0o777)
            fakegpu.create(fk / "state", count=count, mem=16 * GiB,
                           uuids=[f"GPU-{name}0000-0000-0000-0000-00000000000{i}" for i in range(count)])
            (root / f"colo-{name}").mkdir(mode=0o755)
            d = daemons[name] = DaemonProc(
                root / f"colo-{name}", fk / "state",
                {"profile_dirs": [str(prof)], "mps_idle_stop": 600.0, "multi_user_mps": True, "reserve": "256MiB",
                 "patrol_grace": 2.0, "shared_profiles": str(root / "shared-profiles")},
                env={"SLURM_CONF": str(conf), "PATH": f"{wrap}:{os.environ['PATH']}", "COLO_TEST_NODE": name}).start()
            d.fake = fk / "state"
            out = subprocess.run([sys.executable, "-m", "colo.cli.slurm", "gres-conf", "--node", name,
                                  "--socket", str(d.socket), "--devices", f"{dev}/nvidia%d"],
                                 capture_output=True, text=True, check=True).stdout.splitlines()
            node_gres[name] = re.search(r"\bGres=(\S+)", out[0]).group(1)
            gres += out[1:]
        node = SlurmCluster(
            root / "slurm", {n: f"CPUs=4 Gres={g}" for n, g in node_gres.items()}, gres="\n".join(gres) + "\n",
            gres_types="gpu,shard", accounting=True, cgroup=cgroup_v1_devices(), users=("root", other_user.pw_name),
            plugstack=f"required {plugin} python={wrap}/python socket={root}/colo-%n/run/colo.sock "
                      f"slurm_conf={conf} timeout=120",  # the helper may wait 88 s for a restarting daemon
            # a requeued job waits for its old credential to expire (Slurm's default: 120 s)
            extra=("KillWait=30", "AuthInfo=cred_expire=10"))
        assert node.conf == conf
        node.start()
        # A job's shards per node capped at one GPU's: a request no GPU can hold is refused at submit.
        node.sacctmgr(*QOS_LIMIT.split()[2:])
    except BaseException:
        for d in daemons.values():
            d.stop()
        if "node" in locals():
            node.stop()
        raise
    node.shared, node.daemons, node.dev, node.root = shared, daemons, dev, root
    node.profiles = root / "shared-profiles"
    yield node
    node.stop()
    for d in daemons.values():
        d.stop()
    if os.environ.get("COLO_KEEP_SLURM_TEST") != "1":  # =1: the logs of slurmd, slurmctld and the daemons stay
        shutil.rmtree(root, ignore_errors=True)


QOS_LIMIT = f"sacctmgr -i modify qos normal set MaxTRESPerNode=gres/shard={USABLE} Flags=DenyOnLimit"


def script(node, name: str, body: str) -> Path:
    s = node.shared / f"{name}.sh"
    s.write_text(f"#!/bin/sh\n{body}\n")
    s.chmod(0o755)
    return s


def cuda(node, name: str, mem: int, over: int, seconds: int, pre: str = "") -> Path:
    """A batch script that runs the CUDA job as a child (so the shell is the batch task)."""
    return script(node, name, f"{pre}/usr/bin/python3 {node.shared}/cuda_job.py {mem} {over} {seconds} "
                              f"{node.shared}/{name}.result")


def result(node, name: str) -> str:
    p = node.shared / f"{name}.result"
    return p.read_text() if p.exists() else ""


def out(node, name: str) -> str:
    p = node.shared / f"{name}.out"
    return p.read_text() if p.exists() else ""


def colo_job(d: DaemonProc, slurm_job: int) -> dict | None:
    return next((j for j in d.client.ls(all=True) if j.get("slurm_job") == slurm_job), None)


def uuid_of(d: DaemonProc, index: int) -> str:
    return fakegpu.FakeNode(d.fake).read()["devices"][index]["uuid"]


def slurm_gpu(node, job: int | str, name: str = "shard") -> int:
    """The GPU index Slurm bound the job's `name` GRES to (on its one node)."""
    r = node.run("scontrol", "show", "job", "-d", str(job)).stdout
    return int(re.search(rf"GRES=\S*{name}:\d+\(IDX:(\d+)\)", r).group(1))


def seen_as(index: int) -> int:
    """CUDA_VISIBLE_DEVICES as Slurm sets it for a gres/gpu job's one GPU: its index, or 0 where
    the job's cgroup shows it that one device only (ConstrainDevices)."""
    return 0 if cgroup_v1_devices() else index


def requeued(node, job: int | str) -> dict:
    """A job colo sent back to Slurm's queue: pending again, not failed."""
    f = wait_for(lambda: (s := node.show(job)).get("Restarts") == "1" and s["JobState"] == "PENDING" and s, 60,
                 f"job {job} to be requeued")
    return f


def ended(node, job: int | str, timeout: float = 60) -> None:
    wait_for(lambda: node.state(job)[0] == "", timeout, f"Slurm job {job} to end")


def test_parsing_slurms_records():
    show = ("JobId=8 ArrayJobId=7 ArrayTaskId=1 JobName=x\n   TresPerNode=gres:shard:4096\n"
            "     Nodes=n[1-2] CPU_IDs=0 Mem=0 GRES=shard:4096(IDX:1)\n"
            "     Nodes=n3 CPU_IDs=0 Mem=0 GRES=gpu:a100:2(IDX:0,2-3),shard:a100:1024(IDX:0)\n"
            "   ExitCode=0:15\n   AdminComment=site: x \n\n"
            "JobId=7 ArrayJobId=7 ArrayTaskId=2 JobName=x\n     Nodes=n1 CPU_IDs=1 Mem=0 GRES=shard:1(IDX:0)\n")
    rec = job_record(show, 8)
    assert job_record(show, 7).startswith("JobId=7") and "ArrayTaskId=2" in job_record(show, 7)
    with pytest.raises(SlurmError):
        job_record(show, 9)
    expand = {"n[1-2]": ["n1", "n2"]}
    assert allocation(rec, "n3", lambda n: expand.get(n, [n])) == (1024 * MiB, [0], [0, 2, 3])
    assert allocation(rec, "n2", lambda n: expand.get(n, [n])) == (4096 * MiB, [1], [])
    with pytest.raises(SlurmError):
        allocation(rec, "other", lambda n: [n])
    assert allocation("JobId=9 JobName=y\n   TresPerNode=cpu:1\n", "n1") == (0, [], [])
    assert reference(rec) == "7_1" and reference("JobId=12 HetJobId=11 HetJobOffset=1 JobName=z") == "11+1"
    assert reference("JobId=5 JobName=z") == "5"
    assert job_exit(rec) == (0, 15)
    # a batch shell whose child died of scancel's SIGTERM exits 143: cancelled, not failed
    assert job_exit("ExitCode=143:0") == (0, 15) and job_exit("ExitCode=1:0") == (1, 0)
    assert profile_key(rec) == "slurm-x"
    assert profile_key("JobId=3 JobName=my train (v2).sh\n   UserId=a") == "slurm-my-train-v2-.sh"


def test_a_shard_job_starts_python_once_and_its_end_needs_none(cluster, other_user):
    """A job's cost (issue 49 item 5): its first step starts colo's helper (attach); the batch
    script's end and the epilog are sent to the daemon by the plugin itself, the job's exit taken
    from the batch script's status (no Python, no scontrol)."""
    node, d = cluster, cluster.daemons["n2"]
    jobs = {}
    for name, code in (("once0", 0), ("once3", 3)):
        s = cuda(node, name, 256, 0, 1)
        s.write_text(s.read_text() + f"exit {code}\n")
        jobs[name] = node.sbatch(s, "-w", "n2", "--gres=shard:1024", "--colo-profile=light",
                                 "-o", f"{node.shared}/{name}.out", user=other_user)
    for name, code in (("once0", 0), ("once3", 3)):
        j = jobs[name]
        c = wait_for(lambda: (c := colo_job(d, j)) and c["state"] in ("succeeded", "failed") and c, 120,
                     f"job {j}'s end in colo")
        assert (c["state"], d.job(c["id"])["exit_code"]) == (("succeeded", 0) if code == 0 else ("failed", 3)), c
        assert result(node, name).startswith("alloc 0"), (result(node, name), out(node, name))
        runs = [r for r in (node.root / "helper.log").read_text().splitlines() if f"--job={j} " in r + " "]
        assert len(runs) == 1 and " attach " in runs[0], runs
        assert node.show(j)["AdminComment"].startswith(f"colo: job {c['id']} on GPU0"), node.show(j)


def test_a_request_no_gpu_can_hold_and_a_bad_profile_are_refused_at_submit(cluster, other_user):
    node = cluster
    s = script(node, "nothing", "true")
    # One GPU holds 15.75 GiB = 16128 MiB; a job's shards on a node come from one GPU.
    r = node.run("sbatch", f"--gres=shard:{USABLE + 1}", str(s), user=other_user)
    assert r.returncode != 0 and "QOSMaxGRESPerNode" in r.stderr, r.stderr
    j = node.sbatch(s, f"--gres=shard:{USABLE}", "-H", "-o", "/dev/null", user=other_user)  # held: only submitted
    node.run("scancel", str(j))
    # A bare `--gres=shard` is one shard, 1 MiB: refused with the reason, not given a 1 MiB budget.
    b = node.sbatch(s, "--gres=shard", "-w", "n2", "-o", f"{node.shared}/bare.out", user=other_user)
    ended(node, b)
    assert "less than colo's least budget of 64MiB: one shard is one MiB" in out(node, "bare"), out(node, "bare")
    # The profile name is checked where sbatch parses the option, not when the step starts.
    r = node.run("sbatch", "--colo-profile=../../etc/x", "--gres=shard:64", str(s), user=other_user)
    assert r.returncode != 0 and "--colo-profile=../../etc/x: a profile name is" in r.stderr, r.stderr


def test_gpu_jobs_keep_their_gpus_and_cpu_jobs_run_no_python(cluster, other_user):
    node, d = cluster, cluster.daemons["n1"]
    # A CPU-only job (batch step and an srun step) runs nothing of colo's: no Python, no scontrol.
    cpu = script(node, "cpu", f'echo "cvd=[$CUDA_VISIBLE_DEVICES] preload=[$LD_PRELOAD]" > {node.shared}/cpu.result\n'
                              f"srun true")
    j = node.sbatch(cpu, "-w", "n1", "-o", "/dev/null", user=other_user)
    ended(node, j)
    assert result(node, "cpu").strip() == "cvd=[] preload=[]"
    helper = (node.root / "helper.log").read_text() if (node.root / "helper.log").exists() else ""
    assert f"--job={j} " not in helper + " ", helper

    # A plain gres/gpu job keeps its GPU and sees it (Slurm's CUDA_VISIBLE_DEVICES, not emptied).
    gsh = script(node, "gpujob", f'echo "cvd=$CUDA_VISIBLE_DEVICES" > {node.shared}/$SLURM_JOB_ID.cvd\nsleep 120')
    g = node.sbatch(gsh, "-w", "n1", "--gres=gpu:1", "-o", "/dev/null", user=other_user)
    wait_for(lambda: (node.shared / f"{g}.cvd").exists(), 60, "the gpu job to run")
    gi = slurm_gpu(node, g, "gpu")
    assert (node.shared / f"{g}.cvd").read_text().strip() == f"cvd={seen_as(gi)}"
    # A shard job goes to the other GPU (Slurm keeps shards off a GPU a gpu job holds), and colo
    # places it on exactly the GPU Slurm bound; with cgroup device constraint, that GPU's device
    # is the one it may open.
    dsh = script(node, "shardjob", f"/usr/bin/python3 {node.shared}/dev_check.py {node.dev}/nvidia0 "
                                   f"{node.dev}/nvidia1 > {node.shared}/shardjob.result\nsleep 120")
    s = node.sbatch(dsh, "-w", "n1", "--gres=shard:2048", "-o", f"{node.shared}/shardjob.out", user=other_user)
    js = wait_for(lambda: colo_job(d, s), 60, "the shard job in colo")
    si = slurm_gpu(node, s)
    assert si != gi and js["gpus"] == [uuid_of(d, si)] and js["budget"] == 2 * GiB, js
    if cgroup_v1_devices():
        seen = wait_for(lambda: result(node, "shardjob").split(), 30, "the device check")
        assert seen[si] == "ENXIO" and seen[gi] == "EPERM", seen
    # Slurm 22.05 hands a second gpu job the shards' GPU whole; colo does not let the two share
    # it: the gpu job waits in Slurm's queue (requeued, with the reason) until the shard job ends.
    g2 = node.sbatch(gsh, "-w", "n1", "--gres=gpu:1", "-o", "/dev/null", user=other_user)
    wait_for(lambda: node.state(g2)[0] == "PENDING" and (node.state(g2)[1] == "Resources" or
                                                         node.show(g2).get("Restarts") == "1"), 60, "the second gpu job to wait")
    assert not (node.shared / f"{g2}.cvd").exists()
    if node.show(g2).get("Restarts") == "1":
        assert f"colo: requeued: Slurm gave it GPU {si} whole, but colo's jobs run there ({js['id']} on GPU{si})" \
            in node.show(g2)["AdminComment"], node.show(g2)
    node.run("scancel", str(s))
    wait_for(lambda: d.job(js["id"])["state"] == "cancelled", 60, "the shard job to end in colo")
    wait_for(lambda: (node.shared / f"{g2}.cvd").exists(), 90, "the second gpu job to run once the GPU is free")
    assert slurm_gpu(node, g2, "gpu") == si and (node.shared / f"{g2}.cvd").read_text().strip() == f"cvd={seen_as(si)}"
    node.run("scancel", str(g), str(g2))
    ended(node, g)
    ended(node, g2)


def test_shard_jobs_share_the_gpu_slurm_chose_and_are_held_to_their_budget(cluster, other_user):
    node, d = cluster, cluster.daemons["n2"]
    # n2's one GPU: 16128 shards. Two 5 GiB jobs run together (5120 shards; Slurm reads 5K as 5120),
    # an 8 GiB one waits in Slurm's queue.
    a = node.sbatch(cuda(node, "a", 1024, 0, 120), "-w", "n2", "--gres=shard:5120", "--colo-profile=light",
                    "-o", f"{node.shared}/a.out", user=other_user)
    b = node.sbatch(cuda(node, "b", 1024, 8192, 120), "-w", "n2", "--gres=shard:5K", "--colo-profile=light",
                    "-o", f"{node.shared}/b.out", user=other_user)
    wait_for(lambda: result(node, "a") and result(node, "b"), 60, "both jobs to have allocated")
    c = node.sbatch(cuda(node, "c", 512, 0, 3), "-w", "n2", "--gres=shard:8192", "-o", f"{node.shared}/c.out",
                    user=other_user)
    assert node.state(a)[0] == node.state(b)[0] == "RUNNING"
    wait_for(lambda: node.state(c) == ("PENDING", "Resources"), 30, "the third job to wait for shards")

    ja, jb = colo_job(d, a), colo_job(d, b)
    assert ja and jb, d.client.ls()
    gpu = uuid_of(d, 0)
    assert ja["gpus"] == jb["gpus"] == [gpu]
    assert ja["state"] == jb["state"] == "running" and ja["user"] == jb["user"] == other_user.pw_name
    assert ja["budget"] == jb["budget"] == 5 * GiB and ja["mode"] == "mps"
    # What colo chose is on the Slurm job (its admin comment).
    assert node.show(a)["AdminComment"] == f"colo: job {ja['id']} on GPU0 ({gpu}), mps, budget 5GiB"
    # Inside the job the card is its budget; past it the allocation fails in that process only.
    assert result(node, "a").split() == ["alloc", "0", "over", "-1", "total", str(5 * GiB)]
    assert result(node, "b").split()[:4] == ["alloc", "0", "over", "2"]
    assert node.state(a)[0] == "RUNNING" and node.state(b)[0] == "RUNNING"
    assert {ja["id"], jb["id"]} <= {j["id"] for j in d.client.top()["jobs"]}
    ls = d.cli("ls", check=True).stdout
    rows = [r for r in ls.splitlines() if f"slurm-{a}" in r or f"slurm-{b}" in r]
    assert len(rows) == 2 and all(other_user.pw_name in r and "running" in r for r in rows), ls

    # scancel of an MPS job: the batch shell dies of SIGTERM at once, its CUDA program lingers
    # (it ignores SIGTERM); colo sends terminate_client before Slurm's SIGKILL, and the program
    # sees it while alive.
    client_pid = next(p["pid"] for p in fakegpu.FakeNode(d.fake).read()["devices"][0]["processes"]
                      if p["kind"] == "mps_client" and _slurm_job_of(p["pid"]) == a)
    assert node.run("scancel", str(a)).returncode == 0
    wait_for(lambda: "terminated" in result(node, "a"), 60, "the cancelled job's client to be terminated")
    assert result(node, "a").splitlines()[-1].startswith("terminated")  # alive when it came: before any SIGKILL
    log = next((d.state_dir / "mps").glob("*/log/control.log")).read_text()
    assert any("terminate_client" in line and str(client_pid) in line for line in log.splitlines()), log[-2000:]
    done = wait_for(lambda: (j := d.job(ja["id"]))["state"] != "running" and j, 60, "colo to see the end")
    assert done["state"] == "cancelled", done

    # Its shards are Slurm's again: the third job starts, and the neighbour ran on untouched.
    wait_for(lambda: result(node, "c"), 60, "the third job to run once shards were freed")
    assert node.state(b)[0] == "RUNNING" and "terminated" not in result(node, "b")
    jc = wait_for(lambda: colo_job(d, c), 30, "job c in colo")
    assert jc["budget"] == 8 * GiB
    assert d.job(jc["id"])["spec"]["profile"] == "slurm-c.sh"  # no --colo-profile: its job name
    wait_for(lambda: d.job(jc["id"])["state"] == "succeeded", 60, "job c to succeed in colo")
    # What it did was learned, into the folder every node shares (its user's own copy).
    learned = node.profiles / "users" / str(jc["uid"]) / "slurm-c.sh.profile"
    wait_for(learned.exists, 30, f"{learned} (have {list(node.profiles.rglob('*'))})")
    # A colo restart (even SIGKILL) loses no Slurm job: it is found again and still followed.
    d.kill9()
    d.start()
    assert d.job(jb["id"])["state"] == "running"
    # `colo cancel` of a Slurm job goes through Slurm (scancel), after terminate_client, and says so.
    d.cli("cancel", str(jb["id"]), check=True)
    wait_for(lambda: d.job(jb["id"])["state"] == "cancelled", 60, "job b to end in colo")
    assert result(node, "b").splitlines()[-1].startswith("terminated")
    ended(node, b)
    assert node.show(b)["AdminComment"].endswith("; colo: cancelled by root")
    wait_for(lambda: not list((d.state_dir / "slurm").glob("*.json")), 30, "the jobs' env files to go")


def _slurm_job_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"SLURM_JOB_ID=")), None)


def test_memory_outside_budgets_makes_a_job_wait_not_fail(cluster, other_user):
    """Slurm does not see memory held outside colo's budgets: the job Slurm sent is requeued with
    the reason (sizes exact) and runs once the memory is free."""
    node, d = cluster, cluster.daemons["n2"]
    stray = subprocess.Popen([sys.executable, str(node.shared / "cuda_job.py"), "10240", "0", "300",
                              str(node.root / "stray.result")], env={**os.environ, **fakegpu.FakeNode(d.fake).env})
    try:
        wait_for(lambda: d.client.gpus()["gpus"][0]["unbudgeted"] >= 10 * GiB, 30, "the patrol to see the stray memory")
        j = node.sbatch(cuda(node, "late", 512, 0, 2), "-w", "n2", "--gres=shard:8192", "-o", f"{node.shared}/late.out",
                        user=other_user)
        f = requeued(node, j)
        held = d.client.gpus()["gpus"][0]["unbudgeted"]
        why = (f"GPU0 cannot hold its 8GiB now: {_exact(USABLE * MiB - held)} free of 15.75GiB usable "
               f"(0B in colo's budgets, {_exact(held)} held outside any budget)")
        assert f["AdminComment"] == f"colo: requeued: {why}", f
        said = out(node, "late")  # the step's own line, unless Slurm ended the step (requeue) before its tasks
        assert "colo: this step does not run" not in said or f"requeued, it runs again later: {why}" in said, said
        assert node.run("sinfo", "-h", "-n", "n2", "-o", "%T").stdout.strip() in ("idle", "mixed")
        assert colo_job(d, j) is None
    finally:
        stray.kill()
        stray.wait()
    wait_for(lambda: d.client.gpus()["gpus"][0]["unbudgeted"] == 0, 30, "the stray memory to be gone")
    ended(node, j, 90)  # run again, by Slurm, once its requeue delay is over
    assert result(node, "late").startswith("alloc 0") and node.show(j)["JobState"] == "COMPLETED"
    assert d.job(colo_job(d, j)["id"])["state"] == "succeeded"


def _exact(n: int) -> str:
    from colo.units import format_size_exact
    return format_size_exact(n)


def test_a_node_whose_colo_does_not_answer_is_drained_and_its_jobs_requeued(cluster, other_user):
    node, d = cluster, cluster.daemons["n2"]
    d.kill9()
    try:
        # A CPU job needs nothing of colo: it runs, and the node is not drained for it.
        j = node.sbatch(script(node, "cpu2", "true"), "-w", "n2", "-o", "/dev/null", user=other_user)
        ended(node, j)
        assert node.show(j)["JobState"] == "COMPLETED"
        assert node.run("sinfo", "-h", "-n", "n2", "-o", "%T").stdout.strip() in ("idle", "mixed")  # not drained
        # A GPU job is sent back to the queue, and the node drained with the reason.
        g = node.sbatch(cuda(node, "orphan", 256, 0, 2), "-w", "n2", "--gres=shard:1024", "-o",
                        f"{node.shared}/orphan.out", user=other_user)
        f = requeued(node, g)
        assert f["AdminComment"].startswith("colo: requeued: its daemon on n2 does not answer: colo daemon is not "
                                            "running (stale socket"), f
        r = node.run("sinfo", "-h", "-R", "-n", "n2", "-o", "%T|%E").stdout.strip()
        assert r.startswith(("drained|", "draining|")) and "|colo: its daemon on n2 does not answer" in r, r
        # colo's health check (HealthCheckProgram) drains it too, before any GPU job comes
        assert node.run("scontrol", "update", "nodename=n2", "state=resume").returncode == 0
        hc = healthcheck(node, "n2")
        assert hc.returncode == 1 and hc.stdout.strip().endswith("; n2 drained"), hc
        r = node.run("sinfo", "-h", "-R", "-n", "n2", "-o", "%T|%E").stdout.strip()
        assert r.startswith(("drained", "draining")) and "|colo: its daemon on n2 does not answer: colo daemon " \
            "is not running" in r, r
    finally:
        d.start()
    # once colo answers, the health check resumes the node it drained (no admin needed) ...
    hc = healthcheck(node, "n2")
    assert hc.returncode == 0 and "resumed" in hc.stdout, hc
    assert "drain" not in node.run("sinfo", "-h", "-n", "n2", "-o", "%T").stdout
    ended(node, g, 90)
    # ... but never a node an admin drained for a reason of their own
    assert node.run("scontrol", "update", "nodename=n2", "state=drain", "reason=site: maintenance").returncode == 0
    hc = healthcheck(node, "n2")
    assert hc.returncode == 0 and "resumed" not in hc.stdout, hc
    assert node.run("sinfo", "-h", "-R", "-n", "n2", "-o", "%E").stdout.strip() == "site: maintenance"
    assert node.run("scontrol", "update", "nodename=n2", "state=resume").returncode == 0
    assert node.show(g)["JobState"] == "COMPLETED" and result(node, "orphan").startswith("alloc 0")


HEALTHCHECK = Path(__file__).resolve().parent.parent / "packaging" / "slurm-healthcheck"


def healthcheck(node, name: str) -> subprocess.CompletedProcess:
    """colo's health check as the package installs it and slurmd runs it (HealthCheckProgram: root,
    SLURMD_NODENAME set): the packaged script, with this tree's Python and the node's socket."""
    text = HEALTHCHECK.read_text()
    assert "/opt/colo/bin/python3 " in text and "--socket=/run/colo/colo.sock " in text, text
    run = node.root / "slurm-healthcheck"
    run.write_text(text.replace("/opt/colo/bin/python3 ", f"{sys.executable} ")
                   .replace("/run/colo/colo.sock", f"{node.root}/colo-%n/run/colo.sock"))
    run.chmod(0o755)
    return subprocess.run([str(run)], capture_output=True, text=True, cwd="/",
                          env={"SLURMD_NODENAME": name, "SLURM_CONF": str(node.conf), "PATH": os.environ["PATH"]})


def restart_slurmctld(node) -> None:
    """slurmctld stopped and started again from its saved state (running jobs go on)."""
    ctld = next(p for p in node.procs if p.args[0] == "slurmctld")
    ctld.terminate()
    ctld.wait(60)
    node.procs.remove(ctld)
    node._daemon("slurmctld", "-D", "-i", log="slurmctld-again.err")
    wait_for(lambda: "is UP" in node.run("scontrol", "ping").stdout, 60, "slurmctld to answer again")


def test_array_tasks_het_components_and_nodes_each_have_their_own_record(cluster, other_user):
    node, d1, d2 = cluster, cluster.daemons["n1"], cluster.daemons["n2"]
    # One task's placement is held where colo saves the job's env (a FIFO that nobody reads), so that
    # colo is killed in the middle of placing it: the plugin's helper asks again once colo is back,
    # and colo finishes that start (the task is neither failed nor requeued, the node not drained).
    held = max((j["id"] for j in d1.client.ls(all=True)), default=0) + 2  # the array's second job in colo
    fifo = d1.state_dir / "slurm" / f"{held}.tmp"
    fifo.parent.mkdir(mode=0o700, exist_ok=True)
    os.mkfifo(fifo, 0o600)
    arr = node.sbatch(cuda(node, "task", 256, 0, 120), "-w", "n1", "-a", "0-2", "--gres=shard:1024", "-o", "/dev/null",
                      user=other_user)
    tasks = {t: node.show(f"{arr}_{t}") for t in range(3)}
    wait_for(lambda: all((tasks.update({t: node.show(f"{arr}_{t}")}) or tasks[t].get("JobState") == "RUNNING")
                         for t in range(3)), 60, "the array's tasks to run")
    own = {t: int(tasks[t]["JobId"]) for t in range(3)}
    jobs = {t: wait_for(lambda t=t: colo_job(d1, own[t]), 60, f"task {t} in colo") for t in range(3)}
    assert {j["id"] for j in jobs.values()} == {held - 1, held, held + 1}
    wait_for(lambda: [d1.job(i)["state"] for i in (held - 1, held, held + 1)] == ["running", "starting", "running"],
             60, "two tasks to run in colo, one to be held while it is placed")

    # After a restart, one squeue for the node finds every task running (none is lost).
    log = node.root / "squeue.log"
    before = log.read_text().splitlines() if log.exists() else []
    d1.kill9()
    fifo.unlink()
    said = len(d1.log.read_text().splitlines())
    d1.start()
    since = lambda: "\n".join(d1.log.read_text().splitlines()[said:])  # noqa: E731
    wait_for(lambda: all(f"job {jobs[t]['id']} found again after restart" in since() for t in range(3)), 60,
             "the daemon to find the tasks again")
    wait_for(lambda: f"job {held}: its start under Slurm" in since(), 60, "the held task's start to be finished")
    assert all(d1.job(jobs[t]["id"])["state"] == "running" for t in range(3))
    assert all(node.state(f"{arr}_{t}")[0] == "RUNNING" and node.show(f"{arr}_{t}")["Restarts"] == "0" for t in range(3))
    assert "drain" not in node.run("sinfo", "-h", "-n", "n1", "-o", "%T").stdout
    calls = [c for c in log.read_text().splitlines()[len(before):] if c.startswith("n1 ")]
    assert calls == ["n1 --local -h -o %A %T -w n1"], calls
    # `colo cancel` of one task cancels that task in Slurm, not the array.
    d1.cli("cancel", str(jobs[1]["id"]), check=True)
    wait_for(lambda: d1.job(jobs[1]["id"])["state"] == "cancelled", 60, "task 1 to end in colo")
    assert node.state(f"{arr}_0")[0] == node.state(f"{arr}_2")[0] == "RUNNING"
    assert node.show(f"{arr}_1")["AdminComment"].endswith("colo: cancelled by root")

    # A job on both nodes (n1's allocation differs from n2's: separate rows in Slurm's record):
    # each node's colo places it, and every process of its steps has one interposer.
    line = 'echo "$SLURMD_NODENAME $COLO_GPU_BUDGET $(echo $LD_PRELOAD | tr \\":\\" \\"\\n\\" | grep -c libcolo-interpose)"'
    two = script(node, "two", f"srun -N2 sh -c '{line}' > {node.shared}/two.result")
    t = node.sbatch(two, "-N2", "-w", "n1,n2", "--gres=shard:1536", "-o", f"{node.shared}/two.out", user=other_user)
    ended(node, t)
    rows = node.run("scontrol", "show", "job", "-d", str(t)).stdout
    assert len(re.findall(r"^\s+Nodes=", rows, re.M)) == 2, rows
    assert sorted(result(node, "two").splitlines()) == [f"n1 {1536 * MiB} 1", f"n2 {1536 * MiB} 1"], out(node, "two")
    assert colo_job(d1, t)["budget"] == colo_job(d2, t)["budget"] == 1536 * MiB

    # A heterogeneous job: each component is colo's job of its own id, on its own node.
    het = script(node, "het", "#SBATCH -w n1 --gres=shard:1024\n#SBATCH hetjob\n#SBATCH -w n2 --gres=shard:2048\n"
                              f"srun --het-group=0,1 true\ntouch {node.shared}/het.stepped\nsleep 60")
    h = node.sbatch(het, "-o", f"{node.shared}/het.out", user=other_user)
    c0, c1 = (wait_for(lambda d=d, o=o: colo_job(d, h + o), 90, f"het component {o} in colo")
              for d, o in ((d1, 0), (d2, 1)))
    assert (c0["budget"], c1["budget"]) == (GiB, 2 * GiB)
    wait_for((node.shared / "het.stepped").exists, 30, "the step over both components to end")
    d2.cli("cancel", str(c1["id"]), check=True)
    wait_for(lambda: d2.job(c1["id"])["state"] == "cancelled", 60, "component 1 to end in colo")
    assert node.state(f"{h}+0")[0] == "RUNNING"
    # After a slurmctld restart slurmd runs the epilogs with SLURM_JOB_GPUS empty: colo's own mark
    # still brings them to colo, so the tasks end cancelled (scancel), none `lost`.
    restart_slurmctld(node)
    node.run("scancel", str(h), str(arr))
    ended(node, h)
    ended(node, arr)
    for t in (0, 2):
        end = wait_for(lambda t=t: (j := d1.job(jobs[t]["id"]))["state"] != "running" and j, 60, f"task {t} to end")
        assert end["state"] == "cancelled", end


def test_a_patrol_kill_is_written_on_the_slurm_job_and_sacct_shows_it(cluster, other_user):
    node, d = cluster, cluster.daemons["n2"]
    if not cgroup_v1_devices():  # the patrol knows such a process as the job's by Slurm's cgroup of the job
        pytest.skip("the test cluster tracks jobs by cgroup (proctrack/cgroup) only where cgroup v1 is mounted")
    # Past its budget without the interposer (LD_PRELOAD unset): the patrol kills it through Slurm.
    j = node.sbatch(cuda(node, "greedy", 3072, 0, 120, pre="env -u LD_PRELOAD "), "-w", "n2", "--gres=shard:1024",
                    "-o", "/dev/null", user=other_user)
    jj = wait_for(lambda: colo_job(d, j), 60, "the greedy job in colo")
    wait_for(lambda: d.job(jj["id"])["state"] == "cancelled", 60, "the patrol to kill it")
    ended(node, j)
    note = node.show(j)["AdminComment"]
    assert note.startswith(f"colo: job {jj['id']} on GPU0 ") and "; colo: cancelled by the GPU memory patrol (" in note
    acct = wait_for(lambda: node.run("sacct", "-n", "-X", "-j", str(j), "-o", "State,AdminComment%400", "-P")
                    .stdout.strip(), 30, "slurmdbd to have the job")
    assert acct.startswith("CANCELLED") and "cancelled by the GPU memory patrol" in acct, acct


def test_the_docs_say_what_the_test_cluster_runs(cluster):
    """docs/slurm.md's configuration lines are the ones this cluster runs with."""
    doc = DOCS.read_text()
    assert QOS_LIMIT.replace(str(USABLE), "16128") in doc  # the limit line, as the docs give it
    assert "GresTypes=gpu,shard" in doc and "AccountingStorageTRES=gres/gpu,gres/shard" in doc
    conf = (cluster.root / "slurm" / "gres.conf").read_text().splitlines()
    shapes = {re.sub(r"Count=\d+", "Count=N", re.sub(r"File=\S*/nvidia(\d+)", r"File=/dev/nvidia\1", c))
              .replace("NodeName=n1", "NodeName=gpu01") for c in conf if c.startswith("NodeName=n1")}
    documented = {re.sub(r"Count=\d+", "Count=N", c) for c in re.findall(r"^NodeName=gpu01 Name=\S+ File=\S+(?: Count=\d+)?",
                                                                         doc, re.M)}
    assert shapes == documented, (shapes, documented)
    assert "ConstrainDevices=yes" in doc and "multi_user_mps" in doc and "DenyOnLimit" in doc
    # the health check the docs show is the one the package installs, and the tests run
    assert "\n" + HEALTHCHECK.read_text().splitlines()[-1] + "\n" in doc
    assert "HealthCheckProgram=/usr/lib/colo/slurm-healthcheck" in doc


def test_place_now_never_waits_when_memory_fits_and_never_overcommits():
    """A job Slurm already started cannot wait in colo's queue: where plan() would wait for a
    saturated GPU, place_now starts it time-sliced; where no GPU has the memory, it waits (the
    plugin then requeues the job) rather than break invariant 1."""
    from colo.sched import policy

    n = 30
    heavy = profiles.from_samples("heavy", {"times": list(range(n)), "sm": [0.95] * n, "mem": [GiB] * n,
                                            "membw": [0.9] * n}, runtime=600, cache_bound=True)
    gpus = [policy.GpuView("GPU-a", 0, 16 * GiB), policy.GpuView("GPU-b", 1, 16 * GiB)]
    placed = [policy.Placed(1, ("GPU-a",), 10 * GiB, 1000, "timesliced", heavy, 10.0),
              policy.Placed(2, ("GPU-b",), 8 * GiB, 1000, "timesliced", heavy, 10.0)]
    c = policy.Candidate(3, 4 * GiB, 1, 1000, profile=heavy)
    assert policy.plan([c], gpus, placed)[0].action == policy.WAIT
    d = policy.place_now(c, gpus, placed)
    assert (d.action, d.mode, d.gpus) == (policy.START, "timesliced", ("GPU-a",))  # best fit: 6 GiB free
    big = policy.Candidate(4, 9 * GiB, 1, 1000, profile=heavy)
    assert policy.place_now(big, gpus, placed).action == policy.WAIT


def test_only_root_may_register_slurm_jobs(shared_daemon, other_user):
    """The Slurm ops set budgets and GPUs for others: a user who calls them is refused."""
    daemon = shared_daemon  # a socket other users may reach (pytest's own folders are root's alone)
    from colo.client import Client
    from harness.daemon import as_user

    kind, err = as_user(other_user, lambda: Client(daemon.socket).slurm(
        "attach", job=1, uid=other_user.pw_uid, gid=other_user.pw_gid, gpu_mem=GiB, gpu_index=[0]))
    assert kind == "err" and err[2] == "forbidden", err
    assert daemon.client.ls() == []
    # root with malformed values: one line, nothing stored
    for bad in ({"job": "1"}, {"job": 1, "uid": -1}, {"job": 1, "uid": 0, "gid": 0, "gpu_mem": True},
                {"job": 1, "uid": 0, "gid": 0, "gpu_mem": GiB, "gpu_index": [0], "ref": "1 2"},
                {"job": 1, "uid": 0, "gid": 0, "gpu_mem": GiB, "gpu_index": ["0"]}):
        with pytest.raises(Exception) as e:
            daemon.client.slurm("attach", **bad)
        assert "malformed" in str(e.value)
    assert daemon.client.ls() == []
