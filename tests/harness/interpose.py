"""The interposer's test callers: the C helpers of tests/native_helpers, built against the simulated
libcuda (the probe, interpose_probe.c, among them), and what reads their output; JOB_BUDGET, the
budget of conftest's `job` fixture (test_interposer*.py, test_ledger_lanes.py, test_table_shards.py)."""
from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

MiB = 1 << 20
JOB_BUDGET = 64 * MiB  # the `job` fixture's budget per device
HERE = Path(__file__).resolve().parent.parent  # tests/


def build_native_helper(native_dir, out_dir, name):
    """tests/native_helpers/NAME.c, threaded and linked directly against the simulated libcuda."""
    out = out_dir / name
    subprocess.run(["cc", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-o", str(out),
                    os.path.join(HERE, "native_helpers", name + ".c"), str(native_dir / "fakegpu" / "libcuda.so.1"),
                    "-lpthread"], check=True, timeout=120)
    return out


def build_probe(native_dir, out_dir) -> Path:
    """The interposer's C test caller (tests/native_helpers/interpose_probe.c), linked directly
    against the simulated libcuda."""
    native_src = os.path.join(HERE, "..", "native")
    out = out_dir / "interpose_probe"
    subprocess.run(
        ["cc", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", f"-I{native_src}/interpose",
         f"-I{native_src}/fakegpu", "-o", str(out), os.path.join(HERE, "native_helpers", "interpose_probe.c"),
         str(native_dir / "fakegpu" / "libcuda.so.1"), "-ldl", "-lpthread"],
        check=True, timeout=120,
    )
    return out


def run(probe, env, *script, via="direct", extra=(), timeout=60):
    """The probe running `script` ("init", "alloc", "32M", ...): (its output's lines, its stderr)."""
    r = subprocess.run([str(probe), "--via", via, *extra, *script], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return r.stdout.splitlines(), r.stderr


def codes(lines, cmd):
    """The result codes of the probe's `cmd` lines."""
    return [int(line.split()[1]) for line in lines if line.split()[0] == cmd]


def info(lines):
    """(free, total) of every `info` line."""
    return [tuple(map(int, line.split()[2:4])) for line in lines if line.startswith("info ")]


# A ctypes caller: 48 MiB then 32 MiB more, and what cuMemGetInfo says then.
CTYPES_CALLER = textwrap.dedent("""
    import ctypes, sys
    cu = ctypes.CDLL("libcuda.so.1")
    ctx, p, free, total = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_size_t()
    assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    a = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(48 << 20))
    b = cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_uint64()), ctypes.c_size_t(32 << 20))
    cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    print(a, b, free.value, total.value)
""")
