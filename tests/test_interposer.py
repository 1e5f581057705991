"""The memory-budget interposer against the simulated driver: real processes, real files, the real
pynvml; C callers (tests/native_helpers/interpose_probe.c) and ctypes callers."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from colo.node import interposer
from harness.interpose import CTYPES_CALLER, MiB, codes, info, run
from harness.interpose import JOB_BUDGET as BUDGET

HERE = Path(__file__).parent
NATIVE = HERE.parent / "native"


# name -> (script under budget, bytes the ledger counts for it, script that passes the budget)
FAMILIES = {
    "alloc": (["alloc", "32M"], 32 * MiB, ["alloc", "40M"]),
    "pitch": (["pitch", "1000", "8K"], None, ["pitch", "4000", "16K"]),
    "managed": (["managed", "32M"], 32 * MiB, ["managed", "40M"]),
    "async": (["async", "32M"], 32 * MiB, ["async", "40M"]),
    "pool": (["pool", "32M"], 32 * MiB, ["pool", "40M"]),
    "create": (["create", "32M"], 32 * MiB, ["create", "40M"]),
    "vmm": (["vmm", "32M"], 32 * MiB, ["vmm", "40M"]),
    "array": (["array", "2048", "4096"], 32 * MiB, ["array", "4096", "4096"]),
    "array3d": (["array3d", "256", "256", "128"], 32 * MiB, ["array3d", "256", "256", "256"]),
    "mipmap": (["mipmap", "1024", "1024", "1", "3"], (4 * MiB + MiB + MiB // 4), ["mipmap", "4096", "4096", "1", "2"]),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_counted_refused_over_budget_and_freed_exactly(probe, job, family):
    env, ledger = job
    under, size, over = FAMILIES[family]
    # ctxsync: stream-ordered frees count until the stream is known to have reached them
    lines, err = run(probe, env, "init", "info", *under, "info", *over, "info", "rawused", "freeall", "ctxsync",
                     "info", "rawused")
    cmd = under[0]
    assert codes(lines, cmd) == [0, 2], lines
    if family == "pitch":
        pitch = int(next(line.split()[2] for line in lines if line.startswith("pitch 0")))
        size = pitch * 8 * 1024
    views = info(lines)
    assert views[0] == (BUDGET, BUDGET)
    assert views[1] == (BUDGET - size, BUDGET)       # exactly what the allocation took
    assert views[2] == views[1]                      # the refused one took nothing
    assert views[3] == (BUDGET, BUDGET)              # and every byte came back
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")][-1] == 0
    assert err.count("colo: allocation of") == 1 and "refused: job budget 64.0 MiB" in err
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 0 and led.refused == 1 and 0 < led.peak[0] <= BUDGET


def test_vmm_memory_counts_until_released_and_unmapped(probe, job):
    env, _ = job
    # vmm: created, mapped, handle released at once: still counted while mapped.
    lines, _ = run(probe, env, "init", "vmm", "48M", "info", "alloc", "32M", "freeall", "info", "alloc", "60M")
    assert info(lines) == [(BUDGET - 48 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert codes(lines, "alloc") == [2, 0]


@pytest.mark.parametrize("via,extra", [
    ("direct", []), ("dlsym", []), ("gpa", ["--ver", "12000"]), ("gpa", ["--ver", "11040"]),
    ("gpa", ["--ver", "12000", "--ptds"]), ("gpa2", ["--ver", "12080"]), ("gpa2", ["--ver", "13000", "--ptds"]),
])
def test_every_lookup_path_is_enforced(probe, job, via, extra):
    env, ledger = job
    lines, _ = run(probe, env, "init", "alloc", "40M", "async", "20M", "alloc", "8M", "managed", "8M",
                   "info", "freeall", via=via, extra=extra)
    assert codes(lines, "alloc") == [0, 2] and codes(lines, "async") == [0] and codes(lines, "managed") == [2]
    assert info(lines) == [(4 * MiB, BUDGET)]
    assert interposer.read_ledger(ledger).refused == 2


@pytest.mark.parametrize("via", ["gpa", "gpa2"])
def test_get_proc_address_wraps_by_name_version_and_flags(probe, job, via):
    env, _ = job
    lines, _ = run(probe, env, "init",
                   "which", "cuMemAlloc", "3000", "0",        # the 32-bit v1 ABI: its own wrapper
                   "which", "cuMemAlloc", "12000", "0",
                   "which", "cuMemFree", "12000", "0",
                   "which", "cuMemGetInfo", "12000", "0",
                   "which", "cuMemAllocAsync", "12000", "2",  # per-thread default stream
                   "which", "cuGetProcAddress", "12000", "0",
                   "which", "cuGetProcAddress", "11030", "0",
                   "which", "cuCtxGetDevice", "13000", "0",   # not counted: behind colo suspend's gate
                   "which", "cuNoSuchFunction", "12000", "0", via=via)
    got = [line.split()[1:] for line in lines if line.startswith("which")]
    assert got == [
        ["0", "cuMemAlloc", "interpose", "cuMemAlloc"],
        ["0", "cuMemAlloc", "interpose", "cuMemAlloc_v2"],
        ["0", "cuMemFree", "interpose", "cuMemFree_v2"],
        ["0", "cuMemGetInfo", "interpose", "cuMemGetInfo_v2"],
        ["0", "cuMemAllocAsync", "interpose", got[4][3]],
        ["0", "cuGetProcAddress", "interpose", "cuGetProcAddress_v2"],
        ["0", "cuGetProcAddress", "interpose", "cuGetProcAddress"],
        ["0", "cuCtxGetDevice", "interpose", "?"],  # a trampoline of gate.c to the driver's function
        ["500", "cuNoSuchFunction", "driver", "?"],
    ]
    assert got[4][3].startswith("cuMemAllocAsync")


def test_ctypes_caller_is_enforced(job):
    env, _ = job
    r = subprocess.run([sys.executable, "-c", CTYPES_CALLER], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "2", str(16 * MiB), str(BUDGET)]


NVML_CALLER = textwrap.dedent("""
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    other = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(1))
    print(m.total, m.free, m.used, m2.total, m2.free, other.total)
""")


def test_capacity_views_show_the_budget(probe, job):
    env, _ = job
    holder = subprocess.Popen([str(probe), "init", "alloc", "24M", "total", "ready", "wait"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "init 0\n"
        assert holder.stdout.readline() == "alloc 0\n"
        assert holder.stdout.readline() == f"total 0 {BUDGET}\n"
        assert holder.stdout.readline() == "ready 0\n"
        lines, _ = run(probe, env, "init", "info", "total")
        assert info(lines) == [(BUDGET - 24 * MiB, BUDGET)]
        # pynvml as a job would use it; CUDA_VISIBLE_DEVICES=1 makes NVML device 1 the job's GPU 0.
        r = subprocess.run([sys.executable, "-c", NVML_CALLER], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        total, free, used, total2, free2, other = map(int, r.stdout.split())
        assert (total, free, used) == (BUDGET, BUDGET - 24 * MiB, 24 * MiB)
        assert (total2, free2) == (BUDGET, BUDGET - 24 * MiB)
        assert other == BUDGET  # no CUDA_VISIBLE_DEVICES: every device is the job's
        r = subprocess.run([sys.executable, "-c", NVML_CALLER], env={**env, "CUDA_VISIBLE_DEVICES": "1"},
                           capture_output=True, text=True, timeout=60)
        total, free, _, _, _, other = map(int, r.stdout.split())
        assert total > BUDGET and other == BUDGET  # NVML device 0 is not the job's: untouched
    finally:
        holder.communicate("go\n", timeout=30)


def test_racing_threads_and_processes_never_pass_the_budget(probe, job):
    env, ledger = job
    # 4 processes x 8 threads, each allocating 24 MiB against 64 MiB: at most two fit at once. Each
    # thread checks the simulated driver's own count after every allocation it got.
    procs = [subprocess.Popen([str(probe), "init", "race", "8", "500", "24M", str(BUDGET)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    seen = 0
    while any(p.poll() is None for p in procs):
        led = interposer.read_ledger(ledger)
        assert led.used[0] <= BUDGET and led.counted[0] <= BUDGET
        seen = max(seen, led.used[0])
    totals = [0, 0, 0, 0]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        fields = next(line for line in out.splitlines() if line.startswith("race")).split()[2:]
        totals = [t + int(f) for t, f in zip(totals, fields)]
    ok, oom, over, other = totals
    assert over == 0 and other == 0
    assert ok > 0 and oom > 0 and ok + oom == 4 * 8 * 500  # they really did contend
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 0 and led.counted[0] == 0 and led.peak[0] == 48 * MiB and seen <= BUDGET


def _wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_sigkill_mid_allocation_is_reclaimed(probe, job):
    env, ledger = job
    holder = subprocess.Popen([str(probe), "init", "alloc", "48M", "ready", "wait"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "init 0\n" and holder.stdout.readline() == "alloc 0\n"
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 48 * MiB and [p["host_pid"] for p in led.processes] == [holder.pid]
    holder.kill()
    holder.wait(timeout=10)
    assert interposer.read_ledger(ledger).used[0] == 0  # a dead process counts for nothing at once
    # Processes killed at random points of a tight allocate/free loop (inside the ledger lock too).
    rnd = random.Random(4)
    for _ in range(6):
        p = subprocess.Popen([str(probe), "init", "loop", "100000000", "16M"], env=env, stdout=subprocess.DEVNULL)
        _wait_for(lambda: any(x["used"] for x in interposer.read_ledger(ledger).processes))
        time.sleep(rnd.uniform(0, 0.02))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    lines, _ = run(probe, env, "init", "info", "alloc", "64M", "rawused", "freeall")
    assert info(lines) == [(BUDGET, BUDGET)] and codes(lines, "alloc") == [0]
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 0 and led.counted[0] == 0 and led.processes == []


def test_fork_child_gets_its_own_slot(probe, job):
    env, ledger = job
    lines, _ = run(probe, env, "init", "alloc", "16M",
                   "fork", "init", "alloc", "8M", "info", "alloc", "48M", "exit",
                   "--parent", "info", "alloc", "48M", "info", "freeall", "info")
    child = [line for line in lines if line.startswith("child ")]
    assert child[2] == f"child info 0 {BUDGET - 24 * MiB} {BUDGET}"   # parent's 16M + its own 8M
    assert child[3] == "child alloc 2"
    parent = [line for line in lines if not line.startswith("child ")]
    # The child died holding 8M: reclaimed; the parent's own 16M stayed the parent's.
    assert info(parent) == [(BUDGET - 16 * MiB, BUDGET), (0, BUDGET), (BUDGET, BUDGET)]
    assert interposer.read_ledger(ledger).used[0] == 0


def test_200_sequential_processes_reuse_the_ledgers_slots(probe, job, tmp_path):
    """Each process takes the lowest free slot, reclaiming a dead one's: 200 processes one after
    another, half of them exiting with their 60 MiB still held, all fit a ledger of two slots,
    and nothing is left counted. (Their start time beside the bare driver: bench/interposer_bench.py
    --only 5.)"""
    env, _ = job
    ledger = tmp_path / "two-slots"
    interposer.create_ledger(ledger, BUDGET, slots=2)
    env = {**env, interposer.ENV_LEDGER: str(ledger)}
    for i in range(200):
        script = ["init", "alloc", "60M"] + (["exit"] if i % 2 else ["free"])  # half leave it to die
        r = subprocess.run([str(probe), *script], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and r.stdout.split()[3] == "0", (i, r.stdout, r.stderr)
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 0 and led.refused == 0 and led.peak[0] == 60 * MiB and led.processes == []
    # the last one exited holding its 60 MiB: the next process reclaims it before counting its own
    r = subprocess.run([str(probe), "init", "alloc", "60M", "free"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0 and r.stdout.split()[3] == "0", (r.stdout, r.stderr)
    led = interposer.read_ledger(ledger)
    assert led.counted[0] == 0 and led.peak[0] == 60 * MiB and led.refused == 0


def test_null_arguments_return_the_drivers_codes(probe, job):
    env, _ = job
    plain = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", "COLO_GPU_BUDGET", "COLO_LEDGER")}
    for via in ("direct", "dlsym", "gpa"):
        with_lib, _ = run(probe, env, "init", "null", via=via)
        without, _ = run(probe, plain, "init", "null", via=via)
        assert with_lib == without
        assert all(int(c) in (0, 1, 400) for c in with_lib[1].split()[1:])


def test_no_budget_means_no_change(probe, job):
    env, _ = job
    plain = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", "COLO_GPU_BUDGET", "COLO_LEDGER")}
    preloaded = {**plain, "LD_PRELOAD": env["LD_PRELOAD"]}
    script = ["init", "info", "total", "alloc", "1G", "pitch", "1000", "100", "async", "20G", "create", "64M",
              "array", "100", "100", "info", "rawused", "freeall", "info", "null"]
    for via in ("direct", "dlsym", "gpa2"):
        a = run(probe, plain, *script, via=via)
        b = run(probe, preloaded, *script, via=via)
        assert a == b and "info 0 17179869184 17179869184" in a[0]


def test_fails_closed_when_the_ledger_is_unusable(probe, job, tmp_path):
    env, _ = job
    for bad in ({"COLO_LEDGER": str(tmp_path / "missing")}, {"COLO_GPU_BUDGET": "lots"}):
        lines, err = run(probe, {**env, **bad}, "init", "alloc", "1M", "alloc", "1M", "info")
        assert codes(lines, "alloc") == [2, 2] and info(lines)[0][0] == 0
        assert len(err.strip().splitlines()) == 1 and "refusing all GPU allocations" in err


def test_run_budgeted(probe, fakegpu, capfd):
    rc = interposer.run_budgeted([str(probe), "init", "alloc", "40M", "alloc", "40M", "info"], BUDGET,
                                 extra_env=fakegpu.env)
    out, err = capfd.readouterr()
    assert rc == 0 and "alloc 0\nalloc 2\n" in out and f"info 0 {24 * MiB} {BUDGET}" in out
    assert "refused: job budget 64.0 MiB, in use 40.0 MiB" in err
    assert interposer.run_budgeted(["sh", "-c", "exit 7"], BUDGET) == 7
    assert interposer.library_problem() is None


def test_docker_job_hits_its_budget_and_keeps_running(probe, fakegpu, docker_client, test_image, tmp_path):
    ledger = tmp_path / "ledger"
    interposer.create_ledger(ledger, BUDGET, uid=65534, gid=65534)
    os.chmod(fakegpu.env["COLO_FAKEGPU_STATE"], 0o666)
    native = interposer.library_path().parent
    env = {"COLO_FAKEGPU_STATE": "/run/colo/fakegpu.state", "LD_LIBRARY_PATH": "/opt/colo/fakegpu",
           **interposer.job_env(BUDGET, "/run/colo/ledger", "/opt/colo/libcolo-interpose.so")}
    box = docker_client.containers.run(
        test_image, ["sh", "-c", "/opt/probe init alloc 40M alloc 40M info; echo still-running"],
        environment=env, user="65534:65534", detach=True, network_mode="none",
        volumes={str(native): {"bind": "/opt/colo", "mode": "ro"}, str(probe): {"bind": "/opt/probe", "mode": "ro"},
                 str(ledger): {"bind": "/run/colo/ledger", "mode": "rw"},
                 fakegpu.env["COLO_FAKEGPU_STATE"]: {"bind": "/run/colo/fakegpu.state", "mode": "rw"}},
    )
    try:
        assert box.wait(timeout=60)["StatusCode"] == 0
        # read each stream on its own: how docker interleaves the two is not defined
        out = box.logs(stdout=True, stderr=False).decode()
        err = box.logs(stdout=False, stderr=True).decode()
    finally:
        box.remove(force=True)
    assert "alloc 0\nalloc 2\n" in out and f"info 0 {24 * MiB} {BUDGET}" in out
    assert out.rstrip().endswith("still-running") and out.count("still-running") == 1
    assert err.count("colo: allocation of 40.0 MiB refused: job budget 64.0 MiB") == 1
    led = interposer.read_ledger(ledger)  # read from the host, written from inside the container
    assert led.refused == 1 and led.peak[0] == 40 * MiB and led.used[0] == 0


def test_a_job_that_sees_one_gpu_counts_it_as_ordinal_0(probe, job):
    env, ledger = job
    lines, _ = run(probe, {**env, "CUDA_VISIBLE_DEVICES": "1"}, "init", "alloc", "40M", "alloc", "40M", "info",
                   "ready", "wait")
    assert codes(lines, "alloc") == [0, 2] and info(lines) == [(24 * MiB, BUDGET)]
    assert interposer.read_ledger(ledger).peak == {0: 40 * MiB}


def _ask(proc, request, timeout=60.0):
    """Send one `serve` request and read its answer; fails (instead of hanging) if none comes."""
    import selectors
    proc.stdin.write(request + "\n")
    proc.stdin.flush()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout), f"no answer to {request!r}: blocked"
    return proc.stdout.readline()


def test_a_stopped_process_blocks_no_other(probe, job, tmp_path):
    env, ledger = job
    # The stopped process gets a simulated driver of its own, so that the ledger is the only thing
    # the two share (the simulated driver itself serialises its processes under a file lock). Its
    # 40 MiB allocations fit one at a time: its other threads are refused, in the ledger alone.
    from colo.node import fakegpu as fg
    own = tmp_path / "own.state"
    fg.create(own, count=1, mem=16 << 30)
    stopper = subprocess.Popen([str(probe), "init", "race", "8", "100000000", "40M", str(BUDGET)],
                               env={**env, "COLO_FAKEGPU_STATE": str(own)}, stdout=subprocess.DEVNULL)
    checker = subprocess.Popen([str(probe), "init", "serve"], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert checker.stdout.readline() == "init 0\n"
        _wait_for(lambda: any(x["used"] for x in interposer.read_ledger(ledger).processes))
        rnd = random.Random(5)
        for _ in range(100):  # stopped at random points: most of its threads spin in the ledger
            time.sleep(rnd.uniform(0, 0.004))
            stopper.send_signal(signal.SIGSTOP)
            assert _ask(checker, "50 1M") == "serve 0\n"
            stopper.send_signal(signal.SIGCONT)
        stopper.send_signal(signal.SIGSTOP)
        stopper.kill()  # killed mid-way: everything it held or was reserving comes back
        stopper.wait(timeout=10)
        assert _ask(checker, f"1 {BUDGET}") == "serve 0\n"
    finally:
        stopper.kill()
        checker.stdin.close()
        checker.wait(timeout=30)
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 0 and led.counted[0] == 0 and led.peak[0] <= BUDGET


@pytest.mark.parametrize("via", ["direct", "dlsym", "gpa"])
@pytest.mark.parametrize("teardown", [
    ["reset"],                   # cuDevicePrimaryCtxReset_v2
    ["release"],                 # the last cuDevicePrimaryCtxRelease_v2
    ["ctxdestroy"],              # cuCtxDestroy_v2 of a context of its own
])
def test_context_teardown_gives_its_memory_back(probe, job, via, teardown):
    env, ledger = job
    made = ["ctxcreate"] if teardown == ["ctxdestroy"] else []
    lines, _ = run(probe, env, "init", *made, "alloc", "40M", "array", "1024", "1024", "create", "8M",
                   *teardown, "info", "rawused", "alloc", "48M", "rawused", "alloc", "16M", "freeall", "info",
                   via=via)
    assert codes(lines, teardown[0]) == [0]
    # The driver freed the 40 MiB and the 4 MiB array with the context; the VMM handle outlives it.
    assert info(lines) == [(BUDGET - 8 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [8 * MiB, 56 * MiB]
    assert codes(lines, "alloc") == [0, 0, 2]  # 48 MiB fit again (it was refused before); 16 more did not
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 0 and led.peak[0] == 56 * MiB


def test_pool_allocations_count_on_the_pools_device(probe, job):
    env, ledger = job
    lines, _ = run(probe, env, "init", "0", "poolnew", "1", "pool", "40M", "info", "rawused", "rawused1",
                   "pool", "40M", "pooldefault", "0", "pool", "40M", "info")
    assert codes(lines, "pool") == [0, 2, 0]  # device 1's budget holds one; device 0's is untouched
    assert info(lines) == [(BUDGET, BUDGET), (BUDGET - 40 * MiB, BUDGET)]
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [0, 40 * MiB]
    assert interposer.read_ledger(ledger).peak == {0: 40 * MiB, 1: 40 * MiB}


def test_an_address_handed_out_again_replaces_the_lost_allocation(probe, job):
    env, ledger = job
    # The driver frees 20 MiB on a path the interposer does not see, then hands the same address
    # out again (as real drivers do): the old entry's bytes leave the ledger, none leak.
    lines, _ = run(probe, env, "init", "alloc", "20M", "lose", "alloc", "20M", "info", "rawused", "freeall", "info")
    assert codes(lines, "lose") == [0] and codes(lines, "alloc") == [0, 0]
    assert info(lines) == [(BUDGET - 20 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert interposer.read_ledger(ledger).counted[0] == 0


def test_an_unknown_newer_abi_of_a_counted_function_is_refused(probe, job):
    env, _ = job
    plain = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", "COLO_GPU_BUDGET", "COLO_LEDGER")}
    # The simulated driver answers cuMemAlloc at CUDA 14000 with a made-up cuMemAlloc_v3.
    script = ["init", "which", "cuMemAlloc", "14000", "0", "which", "cuMemAlloc", "13000", "0",
              "dlsym", "cuMemAlloc_v3", "dlsym", "cuMemAlloc_v2", "dlsym", "cuMemAllocAsync_ptsz"]
    lines, err = run(probe, env, *script, via="gpa2")
    assert [x.split()[1:] for x in lines[1:]] == [
        ["500", "cuMemAlloc", "driver", "?"], ["0", "cuMemAlloc", "interpose", "cuMemAlloc_v2"],
        ["500", "cuMemAlloc_v3"], ["0", "cuMemAlloc_v2"], ["0", "cuMemAllocAsync_ptsz"]]
    assert "cuMemAlloc (CUDA 14000) is an ABI this library does not know" in err
    lines, _ = run(probe, plain, *script, via="gpa2")
    assert lines[1].split()[1:] == ["0", "cuMemAlloc", "driver", "cuMemAlloc_v3"] and lines[3] == "dlsym 0 cuMemAlloc_v3"


def test_no_host_memory_to_record_an_allocation_fails_it(probe, job):
    env, ledger = job
    # The table is capped at 1,024 cells (test hook): it cannot grow past 512 entries.
    lines, _ = run(probe, {**env, "COLO_TEST_TABLE_MAX": "1024"}, "init", "many", "600", "1K", "info", "rawused",
                   "freeall", "info", "rawused")
    assert lines[1] == "many 2 512"  # the 513th fails, and the driver has it back
    assert info(lines) == [(BUDGET - 512 * 1024, BUDGET), (BUDGET, BUDGET)]
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [512 * 1024, 0]
    assert interposer.read_ledger(ledger).counted[0] == 0


def test_dlsym_passes_through_as_the_caller_at_any_optimisation(job, tmp_path):
    env, _ = job
    src = HERE / "native_helpers" / "dlsym_scope.c"
    cc = ["cc", "-std=gnu11", "-fPIC", "-o"]
    subprocess.run([*cc, str(tmp_path / "libdep.so"), "-shared", "-DDEP", str(src)], check=True, timeout=120)
    subprocess.run([*cc, str(tmp_path / "libplug.so"), "-shared", "-DPLUG", str(src), f"-L{tmp_path}", "-Wl,--no-as-needed", "-ldep",
                    f"-Wl,-rpath,{tmp_path}", "-ldl"], check=True, timeout=120)
    subprocess.run([*cc, str(tmp_path / "main"), str(src), "-ldl"], check=True, timeout=120)
    o0 = tmp_path / "o0"
    subprocess.run(["make", "-s", "-C", str(NATIVE), f"BUILD={o0}", "CFLAGS=-O0 -g", f"{o0}/libcolo-interpose.so"],
                   check=True, timeout=300, capture_output=True)
    for lib in (interposer.library_path(), o0 / "libcolo-interpose.so"):
        for budget in (env["COLO_GPU_BUDGET"], ""):
            r = subprocess.run([str(tmp_path / "main"), str(tmp_path / "libplug.so")], capture_output=True, text=True,
                               env={**env, "LD_PRELOAD": str(lib), "COLO_GPU_BUDGET": budget}, timeout=60)
            assert (r.returncode, r.stdout) == (0, "7 2\n"), (lib, budget, r.stderr)


def test_managed_memory_charging_is_a_stated_choice(probe, job):
    env, ledger = job
    for managed, free_after in (("full", BUDGET - 40 * MiB), ("none", BUDGET)):
        e = {**env, **interposer.job_env(BUDGET, str(ledger), str(interposer.library_path()), managed=managed)}
        lines, _ = run(probe, e, "init", "managed", "40M", "info", "alloc", "40M", "freeall")
        assert codes(lines, "managed") == [0] and info(lines) == [(free_after, BUDGET)]
        assert codes(lines, "alloc") == ([2] if managed == "full" else [0])


@pytest.mark.parametrize("via", ["direct", "gpa"])
def test_context_limits_are_device_memory_and_counted(probe, job, via):
    env, ledger = job
    # CU_LIMIT_MALLOC_HEAP_SIZE (2) and CU_LIMIT_STACK_SIZE (0, per resident thread: 108 SMs x 2048).
    lines, _ = run(probe, env, "init", "limit", "2", "32M", "info", "limit", "2", "16M", "info", "limit", "2", "80M",
                   "info", "limit", "0", "1K", "rawused", "reset", "info", "rawused", via=via)
    assert codes(lines, "limit") == [0, 0, 2, 2]  # a 216 MiB stack would pass the budget: refused
    assert info(lines) == [(BUDGET - 32 * MiB, BUDGET), (BUDGET - 16 * MiB, BUDGET), (BUDGET - 16 * MiB, BUDGET),
                           (BUDGET, BUDGET)]  # and the context's reset gives the heap back
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [16 * MiB, 0]
    assert interposer.read_ledger(ledger).counted[0] == 0


NVML_AND_CUDA = textwrap.dedent("""
    import ctypes, sys, pynvml
    if sys.argv[1] == "cuda":  # CUDA up in this process, 24 MiB on CUDA ordinal 0
        cu = ctypes.CDLL("libcuda.so.1")
        ctx, p = ctypes.c_void_p(), ctypes.c_uint64()
        assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert cu.cuCtxSetCurrent(ctx) == 0 and cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(24 << 20)) == 0
    pynvml.nvmlInit()
    for i in range(2):
        m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
        print(m.total, m.free)
""")


def test_nvml_devices_are_matched_to_cuda_ordinals_by_uuid(job, fakegpu):
    env, _ = job
    # NVML device 1 has more SMs: CUDA's default order (fastest first) makes it ordinal 0.
    subprocess.run([str(interposer.library_path().parent / "colo-fakegpu"), "set-sms", str(fakegpu.state), "1", "132"],
                   check=True)
    r = subprocess.run([sys.executable, "-c", NVML_AND_CUDA, "cuda"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    rows = [tuple(map(int, line.split())) for line in r.stdout.splitlines()]
    assert rows == [(BUDGET, BUDGET), (BUDGET, BUDGET - 24 * MiB)]  # the 24 MiB are on NVML device 1
    # NVML only (no CUDA in the process): CUDA_VISIBLE_DEVICES by UUID names the job's device.
    uuid1 = fakegpu.uuids()[1]
    r = subprocess.run([sys.executable, "-c", NVML_AND_CUDA, "nvml"], env={**env, "CUDA_VISIBLE_DEVICES": uuid1},
                       capture_output=True, text=True, timeout=60)
    total0, _, total1, _ = map(int, r.stdout.split())
    assert total0 > BUDGET and total1 == BUDGET


def test_a_process_killed_between_its_two_updates_is_resynced_exactly(probe, job):
    env, ledger = job
    # What a process SIGKILLed mid-update leaves (made by hand, so the test does not depend on
    # hitting a window of a few instructions): its slot holds 40 MiB and is mid-operation
    # (started != finished), and the shared counter also holds the 20 MiB it was reserving.
    # Its bytes are spread over two lanes (one thread freed part of what another allocated).
    import struct
    with open(ledger, "r+b") as f:
        slot = interposer.HEADER_SIZE + 3 * interposer.SLOT_SIZE
        lane = slot + 64
        f.seek(52)
        f.write(struct.pack("<I", 4))                       # hwm: slots 0..3 were used
        f.seek(interposer.DEV_AT)
        f.write(struct.pack("<Q", 60 * MiB))                # the shared counter, device 0
        f.seek(slot)
        f.write(struct.pack("<IIiIQ", 1, 1, 99999, 0, 0))   # owned
        f.seek(lane + 2 * interposer.LANE_SIZE)
        f.write(struct.pack("<QQQ", 5, 5, 50 * MiB))        # lane 2: idle, 50 MiB allocated
        f.seek(lane + 5 * interposer.LANE_SIZE)
        f.write(struct.pack("<QQQ", 7, 6, (-10 * MiB) % (1 << 64)))  # lane 5: mid-operation, freed 10
    assert interposer.read_ledger(ledger).counted[0] == 60 * MiB
    lines, _ = run(probe, env, "init", "alloc", "48M", "info", "freeall", "info")
    # Reclaiming the dead slot gave back its 40 MiB; the resync then found the 20 MiB in flight
    # that no live slot holds. Without it, 48 MiB would have been refused (20 + 48 > 64).
    assert codes(lines, "alloc") == [0] and info(lines) == [(BUDGET - 48 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert interposer.read_ledger(ledger).counted[0] == 0


@pytest.mark.parametrize("via", ["direct", "gpa"])
def test_memory_a_pool_keeps_is_counted_until_the_driver_lets_it_go(probe, job, via):
    env, ledger = job
    # The default pool keeps up to 64 MiB after its allocations are freed (PyTorch's cudaMallocAsync
    # backend, CuPy's MemoryAsyncPool set such a release threshold): the driver still holds it.
    lines, _ = run(probe, env, "init", "threshold", "64M", "async", "32M", "async", "16M", "freeall", "ctxsync",
                   "info", "rawused", "reserved",
                   "async", "8M", "info", "rawused",            # served from the reserve: nothing more held
                   "freeall", "ctxsync", "trim", "8M", "info", "rawused", "reserved",
                   "threshold", "0", "ctxsync", "info", "rawused", via=via)
    assert codes(lines, "async") == [0, 0, 0]
    assert info(lines) == [(BUDGET - 48 * MiB, BUDGET), (BUDGET - 48 * MiB, BUDGET), (BUDGET - 8 * MiB, BUDGET),
                           (BUDGET, BUDGET)]
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [48 * MiB, 48 * MiB, 8 * MiB, 0]
    assert [int(x.split()[2]) for x in lines if x.startswith("reserved")] == [48 * MiB, 8 * MiB]
    assert interposer.read_ledger(ledger).counted[0] == 0


def test_at_the_budget_edge_idle_pool_memory_is_given_back_before_refusing(probe, job):
    env, ledger = job
    # 48 MiB idle in the pool (threshold 64 MiB): a plain 40 MiB allocation would pass the budget
    # with it, so the pool is trimmed first and the allocation fits; the job then holds 40 MiB.
    lines, err = run(probe, env, "init", "threshold", "64M", "async", "48M", "freeall", "ctxsync", "info",
                     "alloc", "40M", "info", "rawused", "reserved", "alloc", "40M", "freeall")
    assert codes(lines, "alloc") == [0, 2]
    assert info(lines) == [(BUDGET - 48 * MiB, BUDGET), (BUDGET - 40 * MiB, BUDGET)]
    assert [int(x.split()[2]) for x in lines if x.startswith(("rawused", "reserved"))] == [40 * MiB, 0]
    assert err.count("refused") == 1 and interposer.read_ledger(ledger).counted[0] == 0


def test_a_free_on_a_stream_counts_until_the_stream_gets_there(probe, job):
    env, ledger = job
    # Plain memory freed with cuMemFreeAsync: the driver has it back only when the stream reaches
    # the free (the simulated stream does at synchronisation; until then cuStreamQuery says
    # CUDA_ERROR_NOT_READY), and so does the ledger.
    lines, _ = run(probe, env, "init", "streamnew", "alloc", "40M", "afree", "info", "rawused", "query",
                   "alloc", "30M", "sync", "info", "rawused", "alloc", "30M",
                   "alloc", "20M", "afree", "query", "ctxsync", "info", "freeall", "ctxsync", "info")
    assert codes(lines, "query") == [600, 600] and codes(lines, "alloc") == [0, 2, 0, 0]
    assert info(lines) == [(BUDGET - 40 * MiB, BUDGET), (BUDGET, BUDGET), (BUDGET - 30 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [40 * MiB, 0]
    # From a pool, on one stream: the free goes back to the pool, whose next allocation on that
    # stream reuses it (stream order), so a loop of allocate/free never passes the budget.
    lines, _ = run(probe, env, "init", "streamnew", *(["async", "40M", "afree"] * 20), "info", "rawused",
                   "ctxsync", "info", "rawused")
    assert codes(lines, "async") == [0] * 20
    assert info(lines) == [(BUDGET - 40 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [40 * MiB, 0]
    assert interposer.read_ledger(ledger).counted[0] == 0


@pytest.mark.parametrize("made", ["nodes", "capture"])
def test_graph_memory_is_counted_from_launch_until_trimmed(probe, job, made):
    env, ledger = job
    # A graph allocation of 40 MiB (an alloc node, or cuMemAllocAsync while the stream is captured):
    # nothing is held until the graph is launched; then the device's graph pool holds it, also after
    # the allocation is freed, until cuDeviceGraphMemTrim.
    build = ["graph", "gnode", "40M"] if made == "nodes" else ["capture", "capalloc", "40M", "endcapture"]
    lines, _ = run(probe, env, "init", "streamnew", *build, "instantiate", "info", "rawused",
                   "launch", "info", "rawused", "greserved", "alloc", "30M",
                   "gfreeout", "sync", "info", "gtrim", "info", "rawused", "alloc", "30M", "freeall")
    assert codes(lines, "launch") == [0] and codes(lines, "alloc") == [2, 0]
    assert info(lines) == [(BUDGET, BUDGET), (BUDGET - 40 * MiB, BUDGET), (BUDGET - 40 * MiB, BUDGET),
                           (BUDGET, BUDGET)]
    assert [int(x.split()[2]) for x in lines if x.startswith(("rawused", "greserved"))] == [0, 40 * MiB, 40 * MiB, 0]
    # A launch the budget cannot take fails with CUDA_ERROR_OUT_OF_MEMORY, before the driver runs it.
    lines, _ = run(probe, env, "init", "streamnew", "alloc", "30M", *build, "instantiate", "launch", "rawused", "freeall")
    assert codes(lines, "launch") == [2] and lines[-2].split()[2] == str(30 * MiB)
    assert interposer.read_ledger(ledger).counted[0] == 0


@pytest.mark.parametrize("via", ["direct", "gpa"])
def test_device_runtime_limits_are_device_memory_and_counted(probe, job, via):
    env, ledger = job
    # CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT (4): 4 KiB per launch slot (assumed, as the
    # simulated driver does); CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH (3): the state of every resident
    # thread per level, 1 KiB each: 216 MiB a level on 108 SMs, past the budget.
    lines, err = run(probe, env, "init", "limit", "4", "4096", "info", "rawused", "limit", "3", "1", "rawused",
                     "limit", "4", "1024", "info", "rawused", "reset", "info", via=via)
    assert codes(lines, "limit") == [0, 2, 0]
    assert info(lines) == [(BUDGET - 16 * MiB, BUDGET), (BUDGET - 4 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [16 * MiB, 16 * MiB, 4 * MiB]
    assert "refused" in err and interposer.read_ledger(ledger).counted[0] == 0


def test_a_context_destroyed_under_allocating_threads_leaves_nothing_counted(probe, job):
    env, ledger = job
    # 40 rounds: 4 threads allocate and free 1 MiB in a context while it is destroyed. Whatever
    # the driver freed with it, between its allocation and our record, or between our forgetting
    # a free and the driver refusing it, must leave the ledger too.
    # Each round ends once the racers have done a random number of pairs (not after a count of
    # yields: under load that took minutes), so the limit is the probe's generous one.
    lines, _ = run(probe, env, "init", "ctxrace", "40", "4", "1M", "info", "rawused", timeout=300)
    assert codes(lines, "ctxrace") == [0]
    assert info(lines) == [(BUDGET, BUDGET)] and lines[-1] == "rawused 0 0"


@pytest.mark.parametrize("kind", ["ctxchurn", "primchurn"])
def test_contexts_remade_at_a_destroyed_ones_address_keep_what_they_count(probe, job, kind):
    env, _ = job
    # 16 threads x 1,000 rounds (COLO_TEST_CTXCHURN_ROUNDS for more). ctxchurn: each makes a
    # context (the simulated driver hands out a just-destroyed context's address again, as the
    # real one may), allocates, sets its malloc heap, allocates again, then destroys its own or its
    # neighbour's context, often while that one's owner is still allocating or setting the limit.
    # primchurn: the primary context retained, used and released each round (the last release
    # destroys it while others retain it again at the same address), and reset by one thread in
    # four while others allocate in it. A teardown must release the destroyed context's memory
    # and limits only, never those of the context made at its address meanwhile. At checks (all
    # threads stopped half-way) the ledger never counts less than the driver holds, and at the
    # end it is exact. (Main's library before: counted less at 1 check of 100 in 2 of 30
    # ctxchurn runs, up to 1 MiB, and in 1 of 10 primchurn runs, 2 MiB.) Limits set on a destroyed
    # context's handle may stay counted (more, never less) until the context at that address goes.
    rounds = os.environ.get("COLO_TEST_CTXCHURN_ROUNDS", "1000")
    check = 10 if kind == "ctxchurn" else 2
    script = (["init", kind] if kind == "ctxchurn" else [kind])
    script += ["16", rounds, "1M", str(check), str(BUDGET)]
    script += ["info", "rawused"] if kind == "ctxchurn" else ["init", "info", "rawused"]
    lines, _ = run(probe, env, *script, timeout=600)
    refused, checks, under, over, worst = map(int, next(x for x in lines if x.startswith(kind)).split()[2:])
    assert (refused, under, worst) == (0, 0, 0) and checks == int(rounds) // check
    assert kind == "ctxchurn" or over == 0
    assert info(lines) == [(BUDGET, BUDGET)] and lines[-1] == "rawused 0 0"


@pytest.mark.parametrize("via", ["gpa", "gpa2"])
def test_a_newer_cuda_version_is_judged_by_the_drivers_answer(probe, job, via):
    env, _ = job
    # The driver answers with entry points of its own (not its exported symbols, as a real driver
    # may): a counted name asked at 13.2 is wrapped when the driver gives the same entry point as
    # at 13.0 (the same ABI); at 14.0 it gives another one (the made-up cuMemAlloc_v3): refused.
    env = {**env, "COLO_FAKEGPU_PROCADDR_THUNKS": "1"}
    lines, err = run(probe, env, "init", "which", "cuMemAlloc", "13020", "0", "which", "cuMemAlloc", "12000", "0",
                     "which", "cuMemAllocAsync", "13020", "2", "which", "cuGraphLaunch", "13020", "0",
                     "which", "cuMemAlloc", "14000", "0", via=via)
    assert [x.split()[1:] for x in lines if x.startswith("which")] == [
        ["0", "cuMemAlloc", "interpose", "cuMemAlloc_v2"], ["0", "cuMemAlloc", "interpose", "cuMemAlloc_v2"],
        ["0", "cuMemAllocAsync", "interpose", "cuMemAllocAsync_ptsz"], ["0", "cuGraphLaunch", "interpose", "cuGraphLaunch"],
        ["500", "cuMemAlloc", "driver", "?"]]
    assert "cuMemAlloc (CUDA 14000) is an ABI this library does not know" in err
    lines, _ = run(probe, env, "init", "alloc", "40M", "alloc", "40M", "async", "40M", "info", via=via,
                   extra=["--ver", "13020"])
    assert codes(lines, "alloc") == [0, 2] and codes(lines, "async") == [2] and info(lines) == [(24 * MiB, BUDGET)]


def test_a_function_it_does_not_wrap_meets_the_resume_gate_in_a_program_linked_to_libcuda(probe, job, fakegpu,
                                                                                           native_dir):
    from harness.daemon import wait_for

    env, ledger = job
    # The probe is linked to libcuda and calls cuCtxGetDevice (no wrapper counts it) while the
    # driver holds the process checkpointed, as `colo suspend` leaves it. The call must meet colo's
    # resume gate (ask for the GPU back, and wait) instead of blocking unseen inside the driver:
    # with only the wrapped functions exported, it went straight to the driver and waited there
    # for good, and the ledger never showed that the job wanted its GPU.
    p = subprocess.Popen([str(probe), "--via", "direct", "init", "alloc", "8M", "ready", "wait", "ctxdevice", "info"],
                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ck_env = {**os.environ, **fakegpu.env}

    def ckpt(op):
        r = subprocess.run([str(native_dir / "colo-ckpt"), op, str(p.pid)], env=ck_env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, (op, r.stdout, r.stderr)

    try:
        assert [p.stdout.readline().split()[:2] for _ in range(3)] == [["init", "0"], ["alloc", "0"], ["ready", "0"]]
        ckpt("suspend")
        interposer.suspend_word(ledger, interposer.SUSPENDED)
        p.stdin.write("go\n")
        p.stdin.flush()
        wait_for(lambda: interposer.suspend_word(ledger) & interposer.RESUME_WANTED, 120,
                 "the call to ask for the job's GPU back")
        ckpt("resume")
        interposer.suspend_word(ledger, 0)
        out, err = p.communicate(timeout=120)
        assert out.splitlines() == ["ctxdevice 0 0", f"info 0 {BUDGET - 8 * MiB} {BUDGET}"], err
    finally:
        p.kill()
        p.wait()
