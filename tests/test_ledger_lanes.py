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

from colo.node import interposer
from harness.interpose import JOB_BUDGET as BUDGET
from harness.interpose import build_native_helper

MiB = 1 << 20


@pytest.fixture(scope="module")
def lanes_bin(native_dir, tmp_path_factory):
    return build_native_helper(native_dir, tmp_path_factory.mktemp("lanes"), "ledger_lanes")


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


def keeper_alone(env, ledger, k):
    """Nothing but the keeper's 16 MiB is held (the rest of the budget fits exactly), and the
    keeper then frees it all."""
    fill_exactly(env, ledger, 16 * MiB)
    never_too_low(ledger)
    assert k.communicate("free\n", timeout=60)[0] == "done\n"


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
        keeper_alone(env, ledger, k)
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
        keeper_alone(env, ledger, k)
    finally:
        k.kill()


# A reclaimer killed half-way. COLO_TEST_LEDGER_STOP makes a job process stop itself (SIGSTOP) at a
# named point of its reclaim of a dead slot; the test then SIGKILLs it there and lets the next job
# process finish the reclaim. At every step the shared counter may be too high, never below what
# the live processes hold; then a resync makes it exact and the budget holds to the byte.

STEP = textwrap.dedent("""
    import ctypes, sys
    cu = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    for line in sys.stdin:
        print(cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(int(line))), flush=True)
""")


def stepper(env, stop=None):
    """A job process running STEP; `stop`: its COLO_TEST_LEDGER_STOP points."""
    return subprocess.Popen([sys.executable, "-c", STEP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**env, "COLO_TEST_LEDGER_STOP": stop} if stop else env)


def killed_holding(lanes_bin, env, mib):
    """A job process that allocated `mib` MiB and was SIGKILLed: its slot is left to reclaim."""
    p = subprocess.Popen([str(lanes_bin), "1", str(mib), "0"], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == f"ready {mib} 0\n"
    p.kill()
    p.wait(timeout=30)


def stopped(p):
    """Wait (generously) until p stops itself at its next test point."""
    deadline = time.monotonic() + 120
    while True:
        pid, status = os.waitpid(p.pid, os.WUNTRACED | os.WNOHANG)
        if pid:
            assert os.WIFSTOPPED(status), f"exited before its stop point (status {status:#x})"
            return
        assert time.monotonic() < deadline, "never reached its stop point"
        time.sleep(0.01)


def kill_when_stopped(p):
    stopped(p)
    p.kill()
    p.wait(timeout=30)


def ask(p, size):
    """Have a STEP process allocate `size` bytes (its answer is read by the caller)."""
    p.stdin.write(f"{size}\n")
    p.stdin.flush()


def killed_mid_update(ledger, slot, extra):
    """Write by hand what a process SIGKILLed between its two counter updates leaves (as in
    test_interposer.py): a dead slot mid-operation, and `extra` bytes in the counter that no slot
    holds. Only a resync takes them off."""
    with open(ledger, "r+b") as f:
        f.seek(52)
        hwm = struct.unpack("<I", f.read(4))[0]
        assert hwm <= slot
        f.seek(52)
        f.write(struct.pack("<I", slot + 1))                   # hwm: the slot was used
        f.seek(interposer.DEV_AT)
        counted = struct.unpack("<Q", f.read(8))[0]
        f.seek(interposer.DEV_AT)
        f.write(struct.pack("<Q", counted + extra))
        at = interposer.HEADER_SIZE + slot * interposer.SLOT_SIZE
        f.seek(at)
        f.write(struct.pack("<IIiIQ", 1, 1, 99999, 0, 0))      # owned (by no one alive)
        f.seek(at + 64 + interposer.LANE_SIZE)
        f.write(struct.pack("<QQQ", 3, 2, 0))                  # lane 1: mid-operation


def never_too_low(ledger):
    led = interposer.read_ledger(ledger)
    assert led.counted[0] >= led.used[0], f"counter {led.counted[0]} below the live processes' {led.used[0]}"


def test_a_reclaimer_killed_after_subtracting_leaves_nothing_to_subtract_twice(lanes_bin, job):
    env, ledger = job
    k = keeper(lanes_bin, env)                      # slot 0, 16 MiB
    try:
        killed_holding(lanes_bin, env, 8)           # slot 1, dead with 8 MiB
        # The next process claims the dead slot, reclaiming it on the way, and is killed right after
        # it took the 8 MiB off the counter, before it cleared the slot's lanes.
        r = subprocess.Popen([str(lanes_bin), "1", "1", "0"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={**env, "COLO_TEST_LEDGER_STOP": "reclaim-subtracted"})
        kill_when_stopped(r)
        assert interposer.read_ledger(ledger).counted[0] == 16 * MiB
        # Another process takes the slot: the 8 MiB must not come off a second time.
        assert subprocess.run([str(lanes_bin), "1", "1", "0"], env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=60).stdout == "ready 1 0\n"
        never_too_low(ledger)
        keeper_alone(env, ledger, k)
    finally:
        k.kill()


def test_a_reclaimer_killed_before_subtracting_leaves_the_counter_high_until_a_resync(lanes_bin, job):
    env, ledger = job
    k = keeper(lanes_bin, env)                      # slot 0, 16 MiB
    r = stepper(env, "reclaim-marked")
    try:
        ask(r, MiB)
        assert r.stdout.readline() == "0\n"         # slot 1, 1 MiB
        killed_holding(lanes_bin, env, 8)           # slot 2, dead with 8 MiB
        # Refused at first (16 + 1 + 8 + 48 > 64), r reclaims slot 2 and is killed as it begins.
        ask(r, 48 * MiB)
        kill_when_stopped(r)
        never_too_low(ledger)
        # A process killed mid-update: only a resync can take its 20 MiB off the counter, and an
        # interrupted reclaim must not have turned resyncs off.
        killed_mid_update(ledger, 5, 20 * MiB)
        never_too_low(ledger)
        keeper_alone(env, ledger, k)
    finally:
        k.kill()
        r.kill()


def test_a_resync_overtaken_by_a_free_and_an_allocation_never_sets_the_counter_too_low(lanes_bin, job):
    env, ledger = job
    # The resync reads the counters and the slots at different times. Here a free lands before
    # its collects and an allocation of the same size after them, before it commits: the counter
    # is then back at its old value, but what the slots hold is not what the resync summed.
    k = keeper(lanes_bin, env)                      # slot 0, 16 MiB
    q = stepper(env)
    r = stepper(env, "resync-start,resync-commit")
    try:
        ask(q, MiB)
        assert q.stdout.readline() == "0\n"         # slot 1, 1 MiB
        killed_mid_update(ledger, 5, 20 * MiB)      # a resync is due
        ask(r, 48 * MiB)                            # refused at first (16 + 1 + 20 + 48 > 64): r
        stopped(r)                                  # reclaims slot 5 and begins a resync
        assert k.communicate("free\n", timeout=60)[0] == "done\n"
        r.send_signal(signal.SIGCONT)
        stopped(r)                                  # collected, about to commit
        ask(q, 16 * MiB)
        assert q.stdout.readline() == "0\n"
        never_too_low(ledger)
        r.send_signal(signal.SIGCONT)
        assert r.stdout.readline() in ("0\n", "2\n")
        never_too_low(ledger)
        fill_exactly(env, ledger, interposer.read_ledger(ledger).used[0])
    finally:
        for p in (k, q, r):
            p.kill()


def test_two_resyncs_at_once_never_set_the_counter_too_low(lanes_bin, job):
    env, ledger = job
    # One resync (b) has read the counter and summed the slots and is about to commit when another
    # (a) commits first; an allocation then takes the counter back to what b read.
    k = keeper(lanes_bin, env)                      # slot 0, 16 MiB
    q, a, b = stepper(env), stepper(env), stepper(env, "resync-commit")
    try:
        ask(q, MiB)
        assert q.stdout.readline() == "0\n"         # slot 1, 1 MiB
        killed_mid_update(ledger, 5, 20 * MiB)      # a resync is due
        ask(b, 48 * MiB)                            # refused at first (16 + 1 + 20 + 48 > 64): b
        stopped(b)                                  # reclaims slot 5 and resyncs up to its commit
        ask(a, 48 * MiB)                            # the same, without stopping
        assert a.stdout.readline() == "2\n"         # 16 + 1 + 48 > 64 even once resynced
        ask(q, 20 * MiB)
        assert q.stdout.readline() == "0\n"
        never_too_low(ledger)
        b.send_signal(signal.SIGCONT)
        assert b.stdout.readline() == "2\n"
        never_too_low(ledger)
        fill_exactly(env, ledger, 37 * MiB)
    finally:
        for p in (k, q, a, b):
            p.kill()
