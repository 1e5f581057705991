"""A small CUDA process through the driver API (ctypes, dlopen libcuda.so.1: no CUDA headers, no
framework), for bench/gpu_check.py. Runs alike on a real driver and on native/fakegpu.

    python bench/gpu_probe.py [--mem SIZE] [--over SIZE] [--most SIZE] [--busy S] [--work N] [--hold] [--fault]
    python bench/gpu_probe.py --procaddr cuMemAlloc,cuMemFree --versions 12000,13020

Steps, in this order, each reported as one JSON line on stdout:
  init     cuInit, device name, total memory, cuMemGetInfo (what the process is told it has)
  mem      allocate SIZE in one piece                      (exit 3 if refused)
  over     try SIZE more: a budget should refuse it       (exit 4 if not refused)
  most     the largest piece up to SIZE that can be had beside the first, to 1 MiB (bisection)
  busy     keep the GPU busy for S seconds (memset + synchronize loops; the fake declares activity)
  work     N synchronised memset passes over the buffer: a fixed amount of work
  hold     print {"event": "hold"} and wait for a line on stdin (the caller looks meanwhile)
  fault    launch a kernel that writes to an unmapped address (PTX, JIT-compiled by the driver):
           cuCtxSynchronize should return CUDA_ERROR_ILLEGAL_ADDRESS (700)
  after    one memset + synchronize: does this context still work? (810 after terminate_client,
           700 after a fault in it or in its MPS server)
Exit 0 when every step went as asked, 1 on another CUDA error.

--procaddr: after cuInit only, what cuGetProcAddress_v2 answers for each name at each CUDA version
(flags 0 and per-thread default stream), and which exported symbol (dlsym) each answer is: one
"procaddr" line. Under the interposer, dlsym and cuGetProcAddress are its own.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

SIZES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}

PTX = b"""
.version 6.0
.target sm_50
.address_size 64
.visible .entry colo_fault(.param .u64 p)
{
    .reg .u64 %rd<2>;
    .reg .u32 %r<2>;
    ld.param.u64 %rd1, [p];
    mov.u32 %r1, 1;
    st.global.u32 [%rd1], %r1;
    ret;
}
"""


def size(s: str) -> int:
    s = s.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(s[:-1]) * SIZES[s[-1]]) if s and s[-1] in SIZES else int(s)


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


# exported names an answer for BASE may be (the driver's versioned ABIs and stream variants)
SUFFIXES = ("", "_v2", "_v3", "_v4", "_ptsz", "_v2_ptsz", "_ptds", "_v2_ptds")


def procaddr(cu, names: list[str], versions: list[int]) -> dict:
    # dlsym itself, not ctypes' getattr: a NULL answer without a dlerror() message (the interposer's
    # refusal of an unknown counted version) crashes ctypes' getattr on CPython 3.11
    dlsym = ctypes.CDLL(None).dlsym
    dlsym.restype, dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    exported = {}
    for base in names:
        for suf in SUFFIXES:
            if (p := dlsym(cu._handle, (base + suf).encode())):
                exported[base + suf] = p
    by_ptr = {}
    for n, p in exported.items():
        by_ptr.setdefault(p, n)  # the first (shortest) name of an address
    get = getattr(cu, "cuGetProcAddress_v2", None)
    rows = []
    for base in names:
        for ver in versions:
            for flags in (0, 2):  # CU_GET_PROC_ADDRESS_DEFAULT, _PER_THREAD_DEFAULT_STREAM
                fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
                if get is not None:
                    rc = get(base.encode(), ctypes.byref(fn), ver, ctypes.c_uint64(flags), ctypes.byref(status))
                else:
                    rc = cu.cuGetProcAddress(base.encode(), ctypes.byref(fn), ver, ctypes.c_uint64(flags))
                rows.append({"name": base, "ver": ver, "flags": flags, "rc": rc, "status": status.value,
                             "is": (by_ptr.get(fn.value, "unexported") if fn.value else None)})
    return {"via": "cuGetProcAddress_v2" if get is not None else "cuGetProcAddress", "rows": rows,
            "exported": sorted(exported)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mem", type=size, default=64 << 20)
    ap.add_argument("--over", type=size)
    ap.add_argument("--busy", type=float, default=0.0)
    ap.add_argument("--most", type=size, default=0, help="after --over: the largest piece up to SIZE that can be had")
    ap.add_argument("--work", type=int, default=0)
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--fault", action="store_true")
    ap.add_argument("--after", action="store_true")
    ap.add_argument("--procaddr", help="comma-separated base names: report cuGetProcAddress's answers and exit")
    ap.add_argument("--versions", default="12000,13000,13010,13020,13030")
    a = ap.parse_args()
    cu = ctypes.CDLL("libcuda.so.1")
    u64, sz = ctypes.c_uint64, ctypes.c_size_t
    rc = cu.cuInit(0)
    if rc:
        say(event="init", rc=rc, pid=os.getpid())
        return 1
    if a.procaddr:
        say(event="procaddr", **procaddr(cu, a.procaddr.split(","), [int(v) for v in a.versions.split(",")]))
        return 0
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    name = ctypes.create_string_buffer(256)
    cu.cuDeviceGetName(name, 256, dev)
    rc = cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)
    if rc:
        say(event="init", rc=rc, step="cuCtxCreate", pid=os.getpid())
        return 1
    total_dev, free, total = sz(), sz(), sz()
    cu.cuDeviceTotalMem_v2(ctypes.byref(total_dev), dev)
    cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    say(event="init", rc=0, pid=os.getpid(), device=name.value.decode(), device_total=total_dev.value,
        free=free.value, total=total.value)
    buf = u64()
    rc = cu.cuMemAlloc_v2(ctypes.byref(buf), sz(a.mem))
    say(event="mem", rc=rc, bytes=a.mem)
    if rc:
        return 3 if rc == 2 else 1
    if a.over:
        extra = u64()
        rc = cu.cuMemAlloc_v2(ctypes.byref(extra), sz(a.over))
        say(event="over", rc=rc, bytes=a.over, refused=rc == 2)
        if rc == 0:
            cu.cuMemFree_v2(extra)
            return 4
        if rc != 2:
            return 1
    if a.most:  # the largest one piece that can be had now, to 1 MiB (bisection: allocated and freed)
        lo, hi, extra = 0, a.most, u64()
        while hi - lo > 1 << 20:
            mid = (lo + hi) // 2
            if cu.cuMemAlloc_v2(ctypes.byref(extra), sz(mid)) == 0:
                cu.cuMemFree_v2(extra)
                lo = mid
            else:
                hi = mid
        say(event="most", rc=0, bytes=lo, held=a.mem)
    words = a.mem // 4
    set_activity = getattr(cu, "fakegpuSetActivity", None)  # only the simulated driver has it
    if a.busy:
        t0, loops, rc = time.monotonic(), 0, 0
        if set_activity:
            set_activity(100, 50)
        while time.monotonic() - t0 < a.busy and rc == 0:
            rc = cu.cuMemsetD32_v2(buf, loops, sz(words)) or cu.cuCtxSynchronize()
            loops += 1
            if set_activity:
                time.sleep(0.05)
        if set_activity:
            set_activity(0, 0)
        say(event="busy", rc=rc, seconds=round(time.monotonic() - t0, 3), loops=loops)
        if rc:
            return 1
    if a.work:
        t0, rc = time.monotonic(), 0
        for i in range(a.work):
            rc = cu.cuMemsetD32_v2(buf, i, sz(words)) or cu.cuCtxSynchronize()
            if rc:
                break
        say(event="work", rc=rc, passes=a.work, seconds=round(time.monotonic() - t0, 4))
        if rc:
            return 1
    if a.hold:
        say(event="hold", pid=os.getpid())
        sys.stdin.readline()
    if a.fault:
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        rc = cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX)) if hasattr(cu, "cuModuleLoadData") else 500
        if rc == 0:
            rc = cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"colo_fault")
        if rc:
            say(event="fault", rc=rc, launched=False)
            return 1
        p = u64(0x10)  # an address nothing is mapped at
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(p), ctypes.c_void_p))
        rc = cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
        sync = cu.cuCtxSynchronize()
        say(event="fault", rc=rc, sync=sync, launched=rc == 0, illegal_address=sync == 700)
        return 0 if sync == 700 else 1
    if a.after:
        rc = cu.cuMemsetD32_v2(buf, 7, sz(words)) or cu.cuCtxSynchronize()
        say(event="after", rc=rc)
        return 0 if rc == 0 else 1
    rc = cu.cuMemFree_v2(buf)
    say(event="done", rc=rc)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
