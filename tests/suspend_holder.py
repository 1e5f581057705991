"""A CUDA program for the suspend tests (run as a job, as its user): holds MIB MiB of device memory
through the driver API (ctypes), writes DIR/ready, then for each DIR/poke-N that appears makes one
CUDA call and writes its answer to DIR/done-N. Usage: suspend_holder.py MIB DIR [SM]: SM, a busy
job's simulated SM activity in percent (the simulated driver's fakegpuSetActivity)."""
import ctypes
import os
import sys
import time

mib, folder = int(sys.argv[1]), sys.argv[2]
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_ulonglong()
assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20)) == 0
if len(sys.argv) > 3:
    assert cu.fakegpuSetActivity(int(sys.argv[3]), int(sys.argv[3]) // 2) == 0


def put(name: str, text: str) -> None:
    tmp = os.path.join(folder, f".{name}")
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, os.path.join(folder, name))


put("ready", f"{os.getpid()} {ptr.value}")
n = 1
while True:
    if os.path.exists(os.path.join(folder, f"poke-{n}")):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        r = cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        put(f"done-{n}", f"{r} {free.value} {total.value}")
        n += 1
    time.sleep(0.05)
