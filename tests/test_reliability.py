"""colo under load and faults (issue 8): the bench scenarios at test size, plus the faults that
need their own set-up. Real daemon, real processes, real SQLite, the simulated driver.

Full-size runs and their figures: bench/load_bench.py, bench/crash_trials.py, docs/reliability.md.
"""
from __future__ import annotations

import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from colo.node import fakegpu, interposer, native
from colo.client import ClientError
from colo.jobs import JobSpec, State
from colo.store import Store
from harness.daemon import DaemonProc, wait_for
from harness.probes import db_ro
from harness.users import ensure_users, shared_root

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import crash_trials  # noqa: E402
import load_bench  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


# `node`: a daemon on two 1 GiB simulated GPUs in a dir other users can traverse
pytestmark = pytest.mark.node("colo-rel-", count=2, mem=GiB, then=lambda n: n.daemon(home=None))


# load ----------------------------------------------------------------------------------------------
def test_1000_submissions_from_10_users_all_stored_once_and_ls_stays_fast(node):
    users = ensure_users(10)
    r = load_bench.submit_load(node, users, 1000)
    assert load_bench.check_submissions(r) == []
    assert len(r["stored"]) == 1000 and r["submits"] == 1000
    if os.geteuid() == 0:
        assert r["uids"] == 10 and {u for _, _, u in r["stored"]} == {pw.pw_uid for pw in users}
    # `ls` kept answering during the load (its speed is bench/load_bench.py's figure, not a test)
    assert r["ls_errors"] == [] and r["ls_n"] >= 1
    # the held-back jobs all end (their dependency was cancelled) with a reason
    wait_for(lambda: all(j["state"] in load_bench.TERMINAL for j in node.client.ls()), 60, "dependents to fail")
    assert all("dependency failed" in j["reason"] for j in node.client.ls() if j["name"] != "holder")


def test_200_short_jobs_never_overcommit_none_stuck_rss_flat(node):
    r = load_bench.short_jobs(node, 200)
    assert r["states"] == {"succeeded": 200}
    assert r["over_commits"] == []
    assert max(r["peak"].values()) > GiB // 2  # the queue really packed the GPUs
    assert r["rss_kib"]["end"] - r["rss_kib"]["warm"] < 16 * 1024, r["rss_kib"]


def test_occupancy_replay_catches_an_overcommit(tmp_path):
    """The invariant-1 check is not vacuous: two 600 MiB jobs on one 1 GiB GPU are reported."""
    (tmp_path / "state").mkdir()
    s = Store(tmp_path / "state" / "colo.db")
    ids = [s.add_job(JobSpec(argv=["true"], gpu_mem=600 * MiB), 0, 0, "root").id for _ in range(3)]
    s.transition(ids[0], State.STARTING, "t", gpus=["GPU-a"])
    s.transition(ids[0], State.RUNNING, "t")
    s.transition(ids[1], State.STARTING, "t", gpus=["GPU-b"])
    s.transition(ids[2], State.STARTING, "t", gpus=["GPU-a"])
    s.close()
    bad = load_bench.occupancy_violations(tmp_path / "state", {"GPU-a": GiB, "GPU-b": GiB})
    assert len(bad) == 1 and "GPU-a" in bad[0]


# crash consistency ---------------------------------------------------------------------------------
def test_sigkill_daemon_at_random_moments(native_dir):
    root = shared_root("colo-crash-")
    try:
        r = crash_trials.run_trials(root, trials=8, seed=8)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert r["violations"] == []
    assert r["acked"] >= 8 and r["states"]  # each trial's kill comes after its first acknowledged submit.get("succeeded", 0) > 0 and "lost" not in r["states"]


def test_container_followed_again_after_sigkill(daemon, test_image, tmp_path):
    gate = tmp_path / "gates"
    gate.mkdir()
    j = daemon.submit("--image", test_image, "--gpus", "0", "--mount", f"{gate}:/g:ro", "--",
                      "sh", "-c", "echo up; while [ ! -e /g/go ]; do sleep 0.05; done; exit 6")
    daemon.wait_state(j, "running")
    daemon.kill9()
    daemon.start()
    assert daemon.job(j)["state"] == "running"
    (gate / "go").touch()
    job = daemon.wait_state(j, "failed", timeout=60)
    assert job["exit_code"] == 6 and [e["new"] for e in job["events"]].count("running") == 1
    assert "up" in daemon.cli("logs", str(j)).stdout


# faults in jobs ------------------------------------------------------------------------------------
def _ledger(d: DaemonProc, job_id: int) -> interposer.Ledger | None:
    try:
        return interposer.read_ledger(d.state_dir / "jobs" / str(job_id) / "ledger")
    except (OSError, interposer.LedgerError):
        return None


def _children_named(pid: int, name: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
                if stat[stat.index("(") + 1:stat.rindex(")")] == name and _descends(int(p.name), pid):
                    out.append(int(p.name))
            except (OSError, ValueError):
                continue
    return out


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            return False
    return False


def test_process_killed_mid_allocation_returns_its_budget(tmp_path, native_dir):
    """A job's colo-burn is SIGKILLed while it is still allocating: its bytes leave the ledger and
    the driver, a second allocation that needs them succeeds, and the neighbour is untouched."""
    fakegpu.create(tmp_path / "gpus", count=1, mem=2 * GiB)
    node = fakegpu.FakeNode(tmp_path / "gpus")
    d = DaemonProc(tmp_path, tmp_path / "gpus").start()
    try:
        burn = native.path("colo-burn")
        gate = tmp_path / "go"
        neighbour = d.submit("--process", "--gpu-mem", "256MiB", "--", str(burn), "--mem", "128MiB",
                             "--seconds", "120")
        victim = d.submit("--process", "--gpu-mem", "512MiB", "--", "sh", "-c",
                          f"{burn} --mem 320MiB --step 16MiB --interval 0.05 --seconds 120; echo first=$?; "
                          f"{burn} --mem 448MiB; echo second=$?; while [ ! -e {gate} ]; do sleep 0.05; done")
        d.wait_state(victim, "running")
        d.wait_state(neighbour, "running")
        led = wait_for(lambda: (x := _ledger(d, victim)) and 0 < x.total_used < 320 * MiB and x, 20,
                       "the victim to be part-way through allocating")
        (pid,) = _children_named(_shim_pid(d, victim), "colo-burn")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: "second=" in "".join(d.client.logs(victim)), 20, "the second allocation")
        out = "".join(d.client.logs(victim))
        assert "first=137" in out and "second=0" in out, out  # 448 MiB fit only once the dead bytes returned
        after = _ledger(d, victim)
        assert after.total_used == 0 and after.processes == [] and after.peak[0] <= 512 * MiB, after
        dev = node.read()["devices"][0]
        assert dev["used"] == 128 * MiB  # only the neighbour's bytes are left on the GPU
        n = _ledger(d, neighbour)
        assert n.total_used == 128 * MiB and d.job(neighbour)["state"] == "running"
        assert led.budget == 512 * MiB
        gate.touch()
        assert d.wait_state(victim, "succeeded")["exit_code"] == 0
        d.cli("cancel", str(neighbour), check=True)
        assert d.wait_state(neighbour, "cancelled")["reason"].startswith("cancelled by")
    finally:
        d.stop()


def _shim_pid(d: DaemonProc, job_id: int) -> int:
    with db_ro(d.state_dir) as db:
        (handle,) = db.execute("SELECT handle FROM jobs WHERE id=?", (job_id,)).fetchone()
    return int(handle.split(":")[0])


def test_container_removed_behind_colos_back_is_lost(daemon, test_image, docker_client):
    victim = daemon.submit("--image", test_image, "--gpus", "0", "--", "sh", "-c", "echo up; sleep 300")
    other = daemon.submit("--image", test_image, "--gpus", "0", "--", "sh", "-c", "echo up; sleep 300")
    for j in (victim, other):
        daemon.wait_state(j, "running", timeout=60)
    with db_ro(daemon.state_dir) as db:
        (handle,) = db.execute("SELECT handle FROM jobs WHERE id=?", (victim,)).fetchone()
    docker_client.containers.get(handle).remove(force=True)
    job = daemon.wait_state(victim, "lost", "failed", "succeeded", "cancelled", timeout=30)
    assert daemon.job(other)["state"] == "running"  # the neighbour is untouched
    daemon.cli("cancel", str(other), check=True)
    daemon.wait_state(other, "cancelled", timeout=30)
    assert job["state"] == "lost" and "no longer exists" in job["reason"] and handle[:12] in job["reason"], job


# the state disk full -------------------------------------------------------------------------------
@pytest.fixture
def tiny_state(tmp_path, native_dir):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    state = tmp_path / "state"
    state.mkdir()
    # Room for the daemon's own files (its published native/ copy is ~1.5 MiB with debug info)
    # and a WAL that grows; the tests fill the rest themselves.
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(state)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield state
    subprocess.run(["umount", "-l", str(state)], check=True)


def _fill(path: Path) -> None:
    """Take every free block of the file system (it may be full already: the WAL grows)."""
    try:
        f = open(path, "wb", buffering=0)
    except OSError:
        return
    with f:
        for chunk in (65536, 512):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass


def test_state_disk_full_refuses_clearly_and_recovers(tmp_path, tiny_state, fakegpu):
    d = DaemonProc(tmp_path, fakegpu.state).start()
    try:
        first = d.client.submit({"argv": ["true"], "gpus": 0})["id"]
        d.wait_state(first, "succeeded")
        _fill(tiny_state / "filler")
        refused = 0
        for _ in range(20):  # the WAL may hold a few more pages: fill until a submission is refused
            try:
                d.client.submit({"argv": ["true"], "gpus": 0, "env": {"PAD": "x" * 20000}})
            except ClientError as e:
                msg, code = str(e), e.code
                refused += 1
                break
        assert refused, "no submission was refused on a full disk"
        assert "full" in msg and str(d.state_dir) in msg and "\n" not in msg and code != "internal", (msg, code)
        assert d.proc.poll() is None
        assert d.client.hello() and any(j["id"] == first for j in d.client.ls())
        (tiny_state / "filler").unlink()
        later = d.client.submit({"argv": ["true"], "gpus": 0})["id"]
        assert d.wait_state(later, "succeeded")["reason"] == "exited with code 0"
        ids = [j["id"] for j in d.client.ls()]
        assert len(ids) == len(set(ids))
    finally:
        d.stop()
        log = (tmp_path / "daemon.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def test_job_ending_on_a_full_disk_is_recorded_when_space_returns(tmp_path, tiny_state, fakegpu):
    d = DaemonProc(tmp_path, fakegpu.state, config={"stop_grace": 1.0}).start()
    try:
        gate = tmp_path / "go"
        j = d.client.submit({"argv": ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done"], "gpus": 0})["id"]
        d.wait_state(j, "running")
        shim = _shim_pid(d, j)
        _fill(tiny_state / "filler")
        gate.touch()  # it ends while its end cannot be stored
        wait_for(lambda: not crash_trials._alive(shim), 60, "the job to end")
        (tiny_state / "filler").unlink()
        d.wait_state(j, "succeeded", "failed", "lost", timeout=60)
    finally:
        d.kill9()


# MPS control daemon killed -------------------------------------------------------------------------
@pytest.fixture
def short_daemon(native_dir):
    """A daemon whose state dir path is short: MPS pipe paths must fit a Unix socket name."""
    root = Path(tempfile.mkdtemp(prefix="cr-"))
    fakegpu.create(root / "gpus", count=2, mem=16 * GiB)
    d = DaemonProc(root, root / "gpus").start()
    yield d
    d.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_mps_control_daemon_killed(short_daemon):
    daemon = short_daemon
    burn = native.path("colo-burn")
    j = daemon.submit("--process", "--gpu-mem", "1GiB", "--profile", "alexnet", "--", str(burn), "--mem", "256MiB",
                      "--duty", "10", "--seconds", "120")
    job = daemon.wait_state(j, "running")
    if job["mode"] != "mps":
        pytest.skip(f"the policy placed the job {job['mode']}, not under MPS")
    # attached to its server (past cuInit's handshake with the control daemon) before the kill
    wait_for(lambda: "allocated" in daemon.cli("logs", str(j)).stdout, 60, "the client to allocate")
    pidfiles = list((daemon.state_dir / "mps").glob("*/pipe/nvidia-cuda-mps-control.pid")) or \
        list((daemon.state_dir / "mps").rglob("nvidia-cuda-mps-control.pid"))
    assert pidfiles, "no MPS control daemon pid file"
    os.kill(int(pidfiles[0].read_text().split()[0]), signal.SIGKILL)
    # colo notices, says so, and starts a new control daemon; the running client is not harmed
    wait_for(lambda: "died; restarted" in daemon.log.read_text(), 60, "the MPS daemon to be restarted")
    job = daemon.job(j)
    assert job["state"] == "running" and daemon.proc.poll() is None, (job, daemon.log.read_text()[-3000:])
    other = daemon.submit("--process", "--gpu-mem", "1GiB", "--profile", "alexnet", "--", str(burn), "--mem", "64MiB")
    end = daemon.wait_state(other, "succeeded", "failed", timeout=30)
    assert end["state"] == "succeeded" and end["mode"] == "mps", end
    daemon.cli("cancel", str(j), check=True)
    assert daemon.wait_state(j, "cancelled", timeout=30)["reason"].startswith("cancelled by")


# the interposer under a seeded random sequence of calls ----------------------------------------------
FUZZER = textwrap.dedent(r"""
    import ctypes, os, random, sys, threading
    seed, nthreads, nops, budget = map(int, sys.argv[1:5])
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    P = ctypes.c_uint64
    held, lock, bad = {}, threading.Lock(), []
    stats = {"ok": 0, "oom": 0, "free": 0}

    def worker(t):
        rng = random.Random(seed * 1000 + t)
        ctx = ctypes.c_void_p()
        assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
        mine = []
        for _ in range(nops):
            if mine and rng.random() < 0.45:
                p, n, kind = mine.pop(rng.randrange(len(mine)))
                # out of `held` before the free: `held` must never count bytes the driver has
                # already given back (another thread may be handed them, even the same address)
                with lock:
                    del held[p]
                    stats["free"] += 1
                rc = cu.cuMemFreeAsync(P(p), None) if kind == "async" else cu.cuMemFree_v2(P(p))
                if rc:
                    bad.append(f"free -> {rc}")
                continue
            n = rng.choice([rng.randint(1, 1 << 20), rng.randint(1, 8) << 20, (1 << 20) + rng.randint(-4096, 4096)])
            kind = rng.choice(["alloc", "managed", "async"])
            p = P()
            rc = (cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) if kind == "alloc" else
                  cu.cuMemAllocManaged(ctypes.byref(p), ctypes.c_size_t(n), 1) if kind == "managed" else
                  cu.cuMemAllocAsync(ctypes.byref(p), ctypes.c_size_t(n), None))
            if rc == 0:
                mine.append((p.value, n, kind))
                with lock:
                    held[p.value] = n
                    stats["ok"] += 1
                    if sum(held.values()) > budget:
                        bad.append("this process alone holds more than the budget")
            elif rc == 2:
                with lock:
                    stats["oom"] += 1
            else:
                bad.append(f"alloc {n} -> {rc}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
    for th in threads: th.start()
    for th in threads: th.join()
    # frees on a stream are counted until the stream gets there (docs/interposer.md): let it
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
    assert cu.cuCtxSynchronize() == 0
    print(f"held {sum(held.values())} ok {stats['ok']} oom {stats['oom']} free {stats['free']} bad {len(bad)} {bad[:3]}",
          flush=True)
    sys.stdin.readline()   # the parent compares the ledger with the driver while we hold our bytes
""")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_interposer_randomised_threads_and_processes(tmp_path, fakegpu, seed):
    budget = 48 * MiB
    ledger = tmp_path / "ledger"
    interposer.create_ledger(ledger, budget)
    env = {**os.environ, **fakegpu.env, **interposer.job_env(budget, str(ledger), str(interposer.library_path()))}
    rng = random.Random(seed)
    nproc = 4
    procs = [subprocess.Popen([sys.executable, "-c", FUZZER, str(seed * 10 + i), "4", "60", str(budget)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(nproc)]
    victim = procs[rng.randrange(nproc)]
    highest = 0
    killed = False
    deadline = time.monotonic() + 60
    reports = {}
    while len(reports) < nproc - 1 and time.monotonic() < deadline:
        led = interposer.read_ledger(ledger)
        highest = max(highest, led.total_used)
        if not killed and led.total_used > budget // 4:
            victim.kill()  # SIGKILL, mid-run, holding memory
            victim.wait()
            killed = True
        for p in procs:
            if p is not victim and p.pid not in reports and p.poll() is None:
                if select.select([p.stdout], [], [], 0)[0]:
                    reports[p.pid] = p.stdout.readline().split()
    assert killed and len(reports) == nproc - 1, (killed, reports, [p.stderr.read() for p in procs if p.poll()])
    for fields in reports.values():
        assert fields[0] == "held" and fields[9] == "0", fields  # every call answered 0 or OOM only
    led = interposer.read_ledger(ledger)
    fake = {p["pid"]: p["used"] for p in fakegpu.read()["devices"][0]["processes"]}
    by_pid = {p["host_pid"] or p["pid"]: p["used"] for p in led.processes}
    held = {pid: int(f[1]) for pid, f in reports.items()}
    try:
        assert victim.pid not in by_pid and victim.pid not in fake  # the dead process's bytes are gone
        assert by_pid == held, (by_pid, held)  # the ledger is exact per process...
        assert {p: fake.get(p, 0) for p in held} == held  # ...and equals the driver's own count
        assert fakegpu.read()["devices"][0]["used"] == led.total_used
        assert max(highest, led.peak[0]) <= budget, (highest, led.peak)
        assert sum(int(f[5]) for f in reports.values()) > 0  # the budget was really hit
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.write("\n")
                p.stdin.flush()
        for p in procs:
            p.wait(30)
    assert interposer.read_ledger(ledger).total_used == 0
    assert fakegpu.read()["devices"][0]["used"] == 0


def test_many_running_jobs_do_not_block_new_starts(node):
    """Every running job holds a worker thread in wait(); with more running jobs than asyncio's
    default pool has threads (cpu + 4), new jobs used to stay `starting` until one ended."""
    gate = node.root / "go"
    held = [node.client.submit({"argv": ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done"], "gpus": 0})["id"]
            for _ in range((os.cpu_count() or 1) + 8)]
    for j in held:
        node.wait_state(j, "running")
    quick = node.client.submit({"argv": ["true"], "gpus": 0})["id"]
    assert node.wait_state(quick, "succeeded", timeout=60)
    gate.touch()
    for j in held:
        node.wait_state(j, "succeeded")
