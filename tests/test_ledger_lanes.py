"""The ledger's per-thread lanes (native/interpose/ledger.c): threads of one process each count
in a lane of their own and give it back when they exit; a process holds the sum of its lanes,
also when one thread frees what another allocated, and that sum is what comes back when it is
killed. Real threads and processes on the simulated driver (tests/native_helpers/ledger_lanes.c)."""
from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
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
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    a = cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(64 << 20))
    b = cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(1))
    print(a, b)
""")


def test_a_killed_multithreaded_process_gives_back_exactly_the_sum_of_its_lanes(lanes_bin, job):
    env, ledger = job
    p = holder(lanes_bin, env)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 0 and led.processes == []  # dead: counts for nothing at once
    assert led.counted[0] == 25 * MiB                # until a job process reclaims it
    # The whole budget fits again (nothing left too high), and not a byte more (nothing taken
    # back twice).
    r = subprocess.run([sys.executable, "-c", FILL], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "2"]
    led = interposer.read_ledger(ledger)  # the filler exited holding the budget, just that
    assert led.counted[0] == BUDGET and led.used[0] == 0 and led.refused == 1
