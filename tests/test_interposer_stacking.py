"""The interposer beside other code that shapes symbol lookup: a library loaded with RTLD_DEEPBIND, a
second interposer preloaded after it (as HAMi-core would be), and one that counts its system calls.
Real processes against the simulated driver; the helpers are tests/native_helpers/*.c."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from colo.node import interposer
from harness.interpose import JOB_BUDGET as BUDGET
from harness.interpose import CTYPES_CALLER, MiB, info, run

HELPERS = Path(__file__).parent / "native_helpers"


def _cc(out: Path, src: str, *args) -> Path:
    subprocess.run(["cc", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-o", str(out),
                    str(HELPERS / src), *args], check=True, timeout=120)
    return out


@pytest.fixture
def deep_lib(tmp_path, native_dir):
    """A library linked against the simulated libcuda, meant to be loaded with RTLD_DEEPBIND."""
    return _cc(tmp_path / "libdeep.so", "deepbind_lib.c", "-shared", str(native_dir / "fakegpu" / "libcuda.so.1"),
               "-ldl")


def test_a_deepbind_library_is_held_to_the_budget(probe, job, deep_lib):
    env, ledger = job
    # Its own scope (with libcuda in it) comes first: without the interposer stepping in, both its
    # direct call and the function its own dlsym finds bypass the budget (80 MiB of 64).
    lines, err = run(probe, env, "init", "deep", str(deep_lib), "40M", "info", "rawused")
    assert lines[1] == "deep 0 0 2 interpose"  # direct: counted; through its dlsym: ours, refused
    assert info(lines) == [(BUDGET - 40 * MiB, BUDGET)] and lines[3] == f"rawused 0 {40 * MiB}"
    assert "refused" in err and interposer.read_ledger(ledger).refused == 1


RUNPATH_CALLER = textwrap.dedent("""
    #define _GNU_SOURCE
    #include <dlfcn.h>
    #include <stdio.h>
    typedef int CUresult; typedef unsigned long long CUdeviceptr; typedef void *CUcontext;
    CUresult cuInit(unsigned); CUresult cuDevicePrimaryCtxRetain(CUcontext *, int); CUresult cuCtxSetCurrent(CUcontext);
    int main(void) {
        CUcontext c;
        if (cuInit(0) || cuDevicePrimaryCtxRetain(&c, 0) || cuCtxSetCurrent(c)) return 3;
        void *h = dlopen("libdeep.so", RTLD_NOW | RTLD_DEEPBIND); /* found through this program's RUNPATH */
        if (!h) { printf("%s\\n", dlerror()); return 4; }
        CUresult (*a)(CUdeviceptr *, size_t) = (CUresult (*)(CUdeviceptr *, size_t))dlsym(h, "deep_alloc");
        CUdeviceptr p;
        CUresult r1 = a(&p, 40 << 20), r2 = a(&p, 40 << 20);
        printf("%d %d\\n", r1, r2);
        return 0;
    }
""")


def test_a_deepbind_library_named_bare_is_found_through_the_callers_runpath(job, deep_lib, native_dir, tmp_path):
    env, _ = job
    # The dlopen is made by the interposer: the caller's RUNPATH must still be the one searched.
    src = tmp_path / "main.c"
    src.write_text(RUNPATH_CALLER)
    exe = tmp_path / "main"
    subprocess.run(["cc", "-o", str(exe), str(src), str(native_dir / "fakegpu" / "libcuda.so.1"), "-ldl",
                    f"-Wl,--enable-new-dtags,-rpath,{deep_lib.parent}"], check=True, timeout=120)
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "0 2\n"), r.stderr


def _second_count(err: str, what: str) -> int:
    return int(re.search(rf"second: .*\b{what} (\d+)", err).group(1))


def test_a_second_interposer_preloaded_after_it_starts_and_both_hold(probe, job, tmp_path):
    env, _ = job
    # The second one sets itself up when its dlsym first sees a cu* name (as HAMi-core does): the
    # program's lookups must reach it, or the first of its hooks we call aborts the process.
    second = _cc(tmp_path / "libsecond.so", "second_preload.c", "-shared", "-ldl")
    env = {**env, "LD_PRELOAD": f"{env['LD_PRELOAD']} {second}"}
    r = subprocess.run([sys.executable, "-c", CTYPES_CALLER], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "2", str(16 * MiB), str(BUDGET)]
    assert _second_count(r.stderr, "alloc") == 1  # its cuMemAlloc_v2 sits under ours
    for via in ("direct", "dlsym", "gpa", "gpa2"):
        lines, err = run(probe, env, "init", "alloc", "40M", "alloc", "40M", "info", via=via, extra=["--ver", "12000"])
        assert [x.split()[1] for x in lines[1:3]] == ["0", "2"] and info(lines) == [(24 * MiB, BUDGET)], via
        assert _second_count(err, "alloc") == 1, (via, err)


def test_capacity_views_do_not_scan_the_ledger_each_time(probe, job, tmp_path):
    env, _ = job
    # 8 other processes of the job hold memory; a process asks for free memory 2,000 times. Each
    # scan for dead processes costs one fcntl per slot: at most one scan per 50 ms.
    counter = _cc(tmp_path / "libcount.so", "count_fcntl.c", "-shared", "-ldl")
    holders = [subprocess.Popen([str(probe), "init", "alloc", "1M", "ready", "wait"], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(8)]
    try:
        for h in holders:
            assert h.stdout.readline() == "init 0\n" and h.stdout.readline() == "alloc 0\n"
        counted = {**env, "LD_PRELOAD": f"{counter} {env['LD_PRELOAD']}"}
        t0 = time.monotonic()
        lines, err = run(probe, counted, "init", "infos", "2000")
        elapsed = time.monotonic() - t0
    finally:
        for h in holders:
            h.communicate("go\n", timeout=30)
    assert lines[1] == f"infos 0 {BUDGET - 8 * MiB} {BUDGET}"
    calls = int(re.search(r"fcntl calls: (\d+)", err).group(1))
    # claiming a slot tries the 8 taken ones (and locks its own twice), then at most one scan of the
    # 8 others per 50 ms begun; before, every view scanned (16,000)
    assert calls <= 10 + 8 * (1 + int(elapsed / 0.05)), (calls, elapsed)
    assert calls < 1000
