"""colo under a real Slurm: slurmctld and slurmd (Debian's slurm-wlm) on localhost with a private
config, munge, colo's SPANK plugin, and a real colo daemon on one simulated 16 GiB GPU.

Jobs are submitted with sbatch by a second Unix user and run a small CUDA program (ctypes on the
simulated libcuda.so.1), so what is checked is what Slurm, the plugin, the daemon, the interposer
and the (fake) MPS control daemon do together. Skips when Slurm is not installed here; fails
instead when COLO_REQUIRE_SLURM=1 (CI).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from colo.node import fakegpu, native
from colo import profiles
from colo.cli.slurm import SlurmError, allocation, job_exit, profile_key, slurm_count
from daemon_util import DaemonProc, wait_for
from slurm_util import SlurmNode, munge_up

GiB = 1024**3
REQUIRE = os.environ.get("COLO_REQUIRE_SLURM") == "1"

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
assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
r1 = cu.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(mem << 20))
r2 = cu.cuMemAlloc_v2(ctypes.byref(b), ctypes.c_size_t(over << 20)) if over else -1
cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
out.write(f"alloc {r1} over {r2} total {total.value}\n")
term = []
signal.signal(signal.SIGTERM, lambda *_: term.append(time.monotonic()))
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


def _need(msg: str):
    if REQUIRE:
        pytest.fail(f"COLO_REQUIRE_SLURM=1 but {msg}")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def cluster(other_user, native_dir):
    for exe in ("slurmctld", "slurmd", "sbatch", "munged"):
        if shutil.which(exe) is None:
            _need(f"{exe} is not installed (apt-get install slurm-wlm munge libslurm-dev)")
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
    fk = root / "fakegpu"
    fk.mkdir(mode=0o777)
    os.chmod(fk, 0o777)
    fakegpu.create(fk / "state", count=1, mem=16 * GiB)
    prof = root / "profiles"
    prof.mkdir()
    n = 30
    p = profiles.from_samples("light", {"times": list(range(n)), "sm": [0.2] * n, "mem": [512 << 20] * n,
                                        "membw": [0.1] * n}, runtime=600, cache_bound=False)
    profiles.save(p, prof / "light.profile")
    home = root / "colo"
    home.mkdir(mode=0o755)
    node = SlurmNode(root / "slurm", gpumem="12G", plugstack="", extra=("KillWait=30",))
    d = DaemonProc(home, fk / "state", {"profile_dirs": [str(prof)], "mps_idle_stop": 600.0, "multi_user_mps": True,
                                         "shared_profiles": str(root / "shared-profiles")},
                   env={"SLURM_CONF": str(node.conf)}).start()
    (node.root / "plugstack.conf").write_text(
        f"required {plugin} python={sys.executable} socket={d.socket} slurm_conf={node.conf} timeout=60\n")
    try:
        node.start()
    except BaseException:
        d.stop()
        node.stop()
        raise
    node.shared, node.daemon, node.fake, node.profiles = shared, d, fk / "state", root / "shared-profiles"
    yield node
    node.stop()
    d.stop()
    shutil.rmtree(root, ignore_errors=True)


def script(node, name: str, mem: int, over: int, seconds: int) -> Path:
    """A batch script that runs the CUDA job as a child (so the shell is the batch task)."""
    s = node.shared / f"{name}.sh"
    s.write_text(f"#!/bin/sh\n/usr/bin/python3 {node.shared}/cuda_job.py {mem} {over} {seconds} "
                 f"{node.shared}/{name}.result\n")
    s.chmod(0o755)
    return s


def result(node, name: str) -> str:
    p = node.shared / f"{name}.result"
    return p.read_text() if p.exists() else ""


def colo_job(node, slurm_job: int) -> dict | None:
    return next((j for j in node.daemon.client.ls() if j.get("slurm_job") == slurm_job), None)


def test_allocation_and_exit_parsing():
    show = ("JobId=7 JobName=x\n   TresPerNode=gres:gpumem:4G\n"
            "     Nodes=vm[1-2] CPU_IDs=0 Mem=0 GRES=gpumem(CNT:4294967296)\n"
            "     Nodes=vm3 CPU_IDs=0 Mem=0 GRES=gpu:a100:2(IDX:0,2-3),gpumem(CNT:1073741824)\n   ExitCode=0:15\n")
    expand = {"vm[1-2]": ["vm1", "vm2"]}
    assert allocation(show, "vm3", lambda n: expand.get(n, [n])) == (GiB, [0, 2, 3])
    assert allocation(show, "vm2", lambda n: expand.get(n, [n])) == (4 * GiB, [])
    with pytest.raises(SlurmError):
        allocation(show, "other", lambda n: [n])
    assert allocation("JobId=8\n   TresPerNode=gres:gpumem:512M\n", "vm") == (512 << 20, [])
    assert allocation("JobId=9\n   TresPerNode=cpu:1\n", "vm") == (0, [])
    assert job_exit(show) == (0, 15)
    assert profile_key(show) == "slurm-x"
    assert profile_key("JobId=3 JobName=my train (v2).sh\n   UserId=a") == "slurm-my-train-v2-.sh"
    assert slurm_count("16G") == 16 * GiB
    with pytest.raises(SlurmError):
        slurm_count("4GB")


def test_slurm_jobs_share_a_gpu_queue_on_gpumem_and_are_held_to_their_budget(cluster, other_user):
    node = cluster
    # 12G of gpumem on the node: two 5G jobs run together, a third waits in Slurm's own queue.
    a = node.sbatch(script(node, "a", 1024, 0, 120), "--gres=gpumem:5G", "--colo-profile=light",
                    "-o", f"{node.shared}/a.out", user=other_user)
    b = node.sbatch(script(node, "b", 1024, 8192, 120), "--gres=gpumem:5G", "--colo-profile=light",
                    "-o", f"{node.shared}/b.out", user=other_user)
    wait_for(lambda: result(node, "a") and result(node, "b"), 60, "both jobs to have allocated")
    c = node.sbatch(script(node, "c", 512, 0, 3), "--gres=gpumem:5G", "-o", f"{node.shared}/c.out",
                    user=other_user)
    assert node.state(a)[0] == node.state(b)[0] == "RUNNING"
    wait_for(lambda: node.state(c) == ("PENDING", "Resources"), 30, "the third job to wait for gpumem")

    ja, jb = colo_job(node, a), colo_job(node, b)
    assert ja and jb, node.daemon.client.ls()
    gpu = fakegpu.FakeNode(node.fake).read()["devices"][0]["uuid"]
    assert ja["gpus"] == jb["gpus"] == [gpu]
    assert ja["state"] == jb["state"] == "running" and ja["user"] == jb["user"] == other_user.pw_name
    assert ja["budget"] == jb["budget"] == 5 * GiB and ja["mode"] == "mps"
    # Inside the job the card is its budget; past it the allocation fails in that process only.
    assert result(node, "a").split() == ["alloc", "0", "over", "-1", "total", str(5 * GiB)]
    assert result(node, "b").split()[:4] == ["alloc", "0", "over", "2"]
    assert node.state(a)[0] == "RUNNING" and node.state(b)[0] == "RUNNING"
    top = {j["id"] for j in node.daemon.client.top()["jobs"]}
    assert {ja["id"], jb["id"]} <= top
    ls = node.daemon.cli("ls", check=True).stdout
    rows = [r for r in ls.splitlines() if f"slurm-{a}" in r or f"slurm-{b}" in r]
    assert len(rows) == 2 and all(other_user.pw_name in r and "running" in r for r in rows), ls

    # scancel of an MPS job: the batch shell dies of SIGTERM at once, its CUDA program lingers;
    # colo sends terminate_client before Slurm's SIGKILL, and the program sees it while alive.
    client_pid = next(p["pid"] for p in fakegpu.FakeNode(node.fake).read()["devices"][0]["processes"]
                      if p["kind"] == "mps_client" and _slurm_job_of(p["pid"]) == a)
    assert node.run("scancel", str(a)).returncode == 0
    wait_for(lambda: "terminated" in result(node, "a"), 60, "the cancelled job's client to be terminated")
    assert result(node, "a").splitlines()[-1] == "terminated after SIGTERM"
    log = next((node.daemon.state_dir / "mps").glob("*/log/control.log")).read_text()
    assert any("terminate_client" in line and str(client_pid) in line for line in log.splitlines()), log[-2000:]
    done = wait_for(lambda: (j := node.daemon.job(ja["id"]))["state"] != "running" and j, 60, "colo to see the end")
    assert done["state"] == "cancelled", done

    # Its gpumem is Slurm's again: the third job starts, and the neighbour ran on untouched.
    wait_for(lambda: result(node, "c"), 60, "the third job to run once gpumem was freed")
    assert node.state(b)[0] == "RUNNING" and "terminated" not in result(node, "b")
    jc = wait_for(lambda: colo_job(node, c), 30, "job c in colo")
    assert jc["budget"] == 5 * GiB
    assert node.daemon.job(jc["id"])["spec"]["profile"] == "slurm-c.sh"  # no --colo-profile: its job name
    wait_for(lambda: node.daemon.job(jc["id"])["state"] == "succeeded", 60, "job c to succeed in colo")
    # What it did was learned, into the folder every node shares.
    # (its user's own copy: a user's runs teach only their own profiles, invariant 13)
    learned = node.profiles / "users" / str(jc["uid"]) / "slurm-c.sh.profile"
    wait_for(learned.exists, 30, f"{learned} (have {list(node.profiles.rglob('*'))})")
    # A colo restart (even SIGKILL) loses no Slurm job: it is found again and still followed.
    node.daemon.kill9()
    node.daemon.start()
    assert node.daemon.job(jb["id"])["state"] == "running"
    # `colo cancel` of a Slurm job goes through Slurm (scancel), after terminate_client.
    node.daemon.cli("cancel", str(jb["id"]), check=True)
    wait_for(lambda: node.daemon.job(jb["id"])["state"] == "cancelled", 60, "job b to end in colo")
    assert result(node, "b").splitlines()[-1].startswith("terminated")
    wait_for(lambda: node.state(b)[0] == "", 60, "Slurm to end job b")
    # What colo kept for the jobs' later steps goes with them.
    wait_for(lambda: not list((node.daemon.state_dir / "slurm").glob("*.json")), 30, "the jobs' env files to go")


def _slurm_job_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"SLURM_JOB_ID=")), None)


def test_job_without_gpumem_sees_no_gpu_and_a_budget_no_gpu_holds_is_refused(cluster, other_user):
    node = cluster
    s = node.shared / "env.sh"
    s.write_text(f"#!/bin/sh\necho \"cvd=[$CUDA_VISIBLE_DEVICES] preload=[$LD_PRELOAD]\" > {node.shared}/env.result\n")
    s.chmod(0o755)
    j = node.sbatch(s, "-o", "/dev/null", user=other_user)
    wait_for(lambda: (node.shared / "env.result").exists() and node.state(j)[0] == "", 60, "the CPU job to end")
    assert (node.shared / "env.result").read_text().strip() == "cvd=[] preload=[]"
    # Every step of a job (here the batch step and one srun step) gets the same place and ledger.
    st = node.shared / "steps.sh"
    line = 'echo "$COLO_JOB_ID $COLO_LEDGER $COLO_GPU_BUDGET $CUDA_VISIBLE_DEVICES ${LD_PRELOAD%%:*}"'
    st.write_text(f"#!/bin/sh\n{line} > {node.shared}/steps.batch\nsrun sh -c '{line}' > {node.shared}/steps.srun\n")
    st.chmod(0o755)
    j = node.sbatch(st, "--gres=gpumem:1G", "-o", "/dev/null", user=other_user)
    wait_for(lambda: node.state(j)[0] == "" and (node.shared / "steps.srun").exists(), 60, "the two-step job to end")
    batch, step = ((node.shared / f"steps.{k}").read_text().split() for k in ("batch", "srun"))
    assert batch == step and len(batch) == 5 and batch[2] == str(GiB) and batch[4].endswith("libcolo-interpose.so"), batch

    # Slurm does not see jobs submitted to colo on the node: when one holds the GPU's memory, a
    # Slurm job that fits Slurm's count fails at start with colo's line, and the node stays up.
    local = node.daemon.submit("--process", "--gpu-mem", "10GiB", "--", "/bin/sleep", "120")
    node.daemon.wait_state(local, "running")
    j = node.sbatch(s, "--gres=gpumem:8G", "-o", f"{node.shared}/refused.out", user=other_user)
    wait_for(lambda: node.state(j)[0] == "", 60, "the refused job to end")
    out = (node.shared / "refused.out").read_text()
    assert "colo: cannot place this job on the node's GPUs: no GPU on this node can hold" in out, out
    assert node.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle"
    assert "ExitCode=1:0" in node.run("scontrol", "show", "job", str(j)).stdout
    node.daemon.cli("cancel", str(local), check=True)

    # More gpumem than the node has: Slurm itself refuses it at submit, colo never sees it.
    r = node.run("sbatch", "--gres=gpumem:13G", str(s), user=other_user)
    assert r.returncode != 0 and "Requested node configuration is not available" in r.stderr, r.stderr


def test_place_now_never_waits_when_memory_fits_and_never_overcommits():
    """A job Slurm already started cannot wait in colo's queue: where plan() would wait for a
    saturated GPU, place_now starts it time-sliced; where no GPU has the memory, it waits (the
    plugin then fails the step) rather than break invariant 1."""
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


def test_only_root_may_register_slurm_jobs(daemon, other_user):
    """The Slurm ops set budgets and GPUs for others: a user who calls them is refused."""
    from colo.client import Client
    from daemon_util import as_user

    kind, err = as_user(other_user, lambda: Client(daemon.socket).slurm(
        "attach", job=1, uid=other_user.pw_uid, gid=other_user.pw_gid, gpu_mem=GiB))
    assert kind == "err" and err[2] == "forbidden", err
    assert daemon.client.ls() == []
    # root with malformed values: one line, nothing stored
    for bad in ({"job": "1"}, {"job": 1, "uid": -1}, {"job": 1, "uid": 0, "gid": 0, "gpu_mem": True}):
        with pytest.raises(Exception) as e:
            daemon.client.slurm("attach", **bad)
        assert "malformed" in str(e.value)
    assert daemon.client.ls() == []
