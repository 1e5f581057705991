"""The ledger's per-thread lanes (native/interpose/ledger.c): threads of one process each count
in a lane of their own and give it back when they exit; a process holds the sum of its lanes,
also when one thread frees what another allocated, and that sum is what comes back when it is
killed. Real threads and processes on the simulated driver (tests/native_helpers/ledger_lanes.c)."""
from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from colo import interposer

MiB = 1 << 20
BUDGET = 64 * MiB
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def lanes_bin(native_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lanes") / "ledger_lanes"
    subprocess.run(["cc", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-o", str(out),
                    str(HERE / "native_helpers" / "ledger_lanes.c"), str(native_dir / "fakegpu" / "libcuda.so.1"),
                    "-lpthread"], check=True, timeout=120)
    return out


@pytest.fixture
def job(tmp_path, fakegpu):
    ledger = tmp_path / "ledger"
    interposer.create_ledger(ledger, BUDGET)
    env = {**os.environ, **fakegpu.env,
           **interposer.job_env(BUDGET, str(ledger), str(interposer.library_path()))}
    return env, ledger


def lanes(ledger: Path, slot: int) -> list[tuple[int, int, int]]:
    """(started, finished, bytes on device 0) of each lane of a slot, read raw."""
    with open(ledger, "rb") as f:
        f.seek(interposer.HEADER_SIZE + slot * interposer.SLOT_SIZE + 64)
        raw = f.read(interposer.LANES * interposer.LANE_SIZE)
    return [struct.unpack_from("<QQQ", raw, k * interposer.LANE_SIZE) for k in range(interposer.LANES)]


def holder(lanes_bin, env):
    # 2 waves of 20 threads, each holding 1 MiB at once (more threads than private lanes), then
    # the main thread frees 15 of the 40 MiB they left.
    p = subprocess.Popen([str(lanes_bin), "2", "20", "15"], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready 40 0\n"
    return p


def test_threads_take_lanes_give_them_back_and_the_process_holds_their_sum(lanes_bin, job):
    env, ledger = job
    p = holder(lanes_bin, env)
    try:
        led = interposer.read_ledger(ledger)
        assert led.used[0] == 25 * MiB and led.counted[0] == 25 * MiB
        [proc] = led.processes
        assert proc["used"] == 25 * MiB and proc["host_pid"] == p.pid
        ls = lanes(ledger, proc["slot"])
        assert all(started == finished for started, finished, _ in ls)  # nothing in flight
        # Lane 0 is shared by the threads that found all 15 private lanes taken: 5 of each wave
        # (a few more if the main thread already holds one). Had the first wave's threads not
        # given theirs back at exit, all 20 of the second would have shared it.
        assert 10 <= ls[0][0] <= 12
        assert sum(b for _, _, b in ls) % (1 << 64) == 25 * MiB
        assert any(b >> 63 for _, _, b in ls)  # the main thread's lane: freed what others allocated
        out, err = p.communicate("free\n", timeout=60)
        assert out == "done\n" and p.returncode == 0, err
    finally:
        p.kill()
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 0 and led.counted[0] == 0 and led.peak[0] == 40 * MiB


FILL = textwrap.dedent("""
    import ctypes, sys
    cu = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    a = cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(int(sys.argv[1])))
    b = cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(1))
    print(a, b)
""")


def keeper(lanes_bin, env):
    """A live process of the job holding 16 MiB (so that a total taken too low would show)."""
    p = subprocess.Popen([str(lanes_bin), "1", "16", "0"], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready 16 0\n"
    return p


def fill_exactly(env, ledger, keep):
    """What the live keeper leaves of the budget fits (nothing left counted too high), and not a
    byte more (nothing given back twice); the filler then exits holding it."""
    r = subprocess.run([sys.executable, "-c", FILL, str(BUDGET - keep)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "2"]
    led = interposer.read_ledger(ledger)
    assert led.counted[0] == BUDGET and led.used[0] == keep


def test_a_killed_multithreaded_process_gives_back_exactly_the_sum_of_its_lanes(lanes_bin, job):
    env, ledger = job
    k = keeper(lanes_bin, env)
    try:
        p = holder(lanes_bin, env)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        led = interposer.read_ledger(ledger)
        assert led.used[0] == 16 * MiB and len(led.processes) == 1  # the dead one counts for nothing at once
        assert led.counted[0] == 41 * MiB                           # until a job process reclaims it
        fill_exactly(env, ledger, 16 * MiB)
        assert k.communicate("free\n", timeout=60)[0] == "done\n"
    finally:
        k.kill()


def test_processes_killed_while_threads_free_each_others_memory_leave_nothing_behind(lanes_bin, job):
    env, ledger = job
    # 20 threads (private lanes and the shared one) allocating and freeing each other's memory,
    # killed at random points: each time, what the dead process held is reclaimed from the sum of
    # its lanes, and one killed mid-update is resynced, so that afterwards the whole budget fits
    # and not a byte more.
    rnd = random.Random(14)
    k = keeper(lanes_bin, env)
    try:
        for _ in range(6):
            p = subprocess.Popen([str(lanes_bin), "churn", "20"], env=env, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 60
            while interposer.read_ledger(ledger).used[0] <= 16 * MiB:
                assert time.monotonic() < deadline and p.poll() is None, "the churn never allocated"
                time.sleep(0.005)
            time.sleep(rnd.uniform(0, 0.05))
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        fill_exactly(env, ledger, 16 * MiB)
        assert k.communicate("free\n", timeout=60)[0] == "done\n"
    finally:
        k.kill()
