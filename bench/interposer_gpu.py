"""The interposer on a real NVIDIA GPU, for what the simulated driver cannot tell (run it where a
GPU is; it refuses to run on the simulated driver):

  1. device memory the driver takes for each cuCtxSetLimit (0 stack, 2 heap, 3 device-runtime
     sync depth, 4 pending launches): what docs/interposer.md assumes for 3 and 4 is checked here;
  2. the framework patterns of interposer_bench.py's section 4 under a 2 GiB budget, through the C
     test caller: graph replays (no sync, sync each, auto-free), a pool at the edge, a RTLD_DEEPBIND
     library, a context destroyed under allocating threads, device-runtime limits;
  3. what this driver's cuGetProcAddress answers above CUDA 13.0, and what the interposer makes of it;
  4. PyTorch with its cudaMallocAsync backend replaying a captured graph that allocates 2 GiB,
     bare and under a 4 GiB budget.

    python bench/interposer_gpu.py
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import checkout  # noqa: E402
checkout.use_colo()

from interposer_bench import build_probe  # noqa: E402

from colo.node import interposer, native  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20


def limits(cu) -> None:
    print("1. device memory the driver takes for cuCtxSetLimit (no interposer)")
    ctx, free, total, v, sms = (ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_int(),
                                ctypes.c_int())
    cu.cuDriverGetVersion(ctypes.byref(v))
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cu.cuCtxSetCurrent(ctx)
    cu.cuDeviceGetAttribute(ctypes.byref(sms), 16, 0)
    print(f"   driver CUDA version {v.value}, {sms.value} SMs")

    def free_now() -> int:
        cu.cuCtxSynchronize()
        cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        return free.value

    for limit, values in ((2, [64 << 20]), (0, [4096]), (4, [4096, 65536]), (3, [3, 8])):
        for value in values:
            f0 = free_now()
            rc = cu.cuCtxSetLimit(limit, ctypes.c_size_t(value))
            f1 = free_now()
            got = ctypes.c_size_t()
            cu.cuCtxGetLimit(ctypes.byref(got), limit)
            print(f"   limit {limit} set to {value}: rc {rc}, now {got.value}, taken {(f0 - f1) / MiB:+.1f} MiB")
    cu.cuDevicePrimaryCtxReset_v2(0)


def job(budget: int) -> dict:
    ledger = Path(tempfile.mkdtemp(prefix="colo-gpu-")) / "ledger"
    interposer.create_ledger(ledger, budget)
    return {**os.environ, **interposer.job_env(budget, str(ledger), str(interposer.library_path()))}


def probe(exe: Path, env: dict, *args: str, via: str = "direct", extra: tuple = ()) -> None:
    r = subprocess.run([str(exe), "--via", via, *extra, *args], env=env, capture_output=True, text=True, timeout=300)
    print(f"   $ probe --via {via} {' '.join(extra)} {' '.join(args)}: rc {r.returncode}")
    print("     " + r.stdout.strip().replace("\n", "\n     "))
    if r.stderr.strip():
        print("     stderr: " + r.stderr.strip()[-400:])


TORCH = r'''
import torch
static_in = torch.ones(256 << 20, device="cuda")  # 1 GiB of float32
s, g = torch.cuda.Stream(), torch.cuda.CUDAGraph()
with torch.cuda.stream(s):
    for _ in range(2):
        z = static_in * 2 * 3  # warm-up
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=s):
        y = static_in * 2  # 1 GiB inside the graph
        z = y * 3          # 1 GiB more, left to the next replay (AUTO_FREE_ON_LAUNCH)
for i in range(30):
    g.replay()
    if i % 10 == 9:
        torch.cuda.synchronize()
torch.cuda.synchronize()
print("replays ok", float(z[0]))
'''


def main() -> None:
    native.ensure_built()
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise SystemExit("interposer_gpu: no NVIDIA driver (libcuda.so.1) here: run it on a machine with a GPU")
    if hasattr(cu, "fakegpuCounts"):
        raise SystemExit("interposer_gpu: libcuda.so.1 is the simulated driver: run it on a machine with a GPU")
    if cu.cuInit(0) != 0:
        raise SystemExit("interposer_gpu: cuInit failed: no usable GPU")
    limits(cu)
    with tempfile.TemporaryDirectory(prefix="colo-gpu-") as d:
        exe, deep = build_probe(Path(d), native.path("fakegpu"))  # linked by soname: runs on the real driver
        budget = 2 * GiB
        env = {k: v for k, v in job(budget).items() if k != "LD_LIBRARY_PATH"}
        print(f"2. framework patterns under a {budget // GiB} GiB budget")
        probe(exe, env, "init", "streamnew", "graph", "gnode", "1200M", "gfree", "instantiate", "replay", "50", "0",
              "replay", "50", "1", "greserved", "info")
        probe(exe, env, "init", "streamnew", "graph", "gnode", "1200M", "instflags", "1", "replay", "50", "0", "info")
        probe(exe, env, "init", "streamnew", "threshold", str(budget * 9 // 10), "async", str(budget * 7 // 10),
              "poolloop", "200", str(budget // 5), "1", "reserved", "info")
        probe(exe, env, "init", "deep", str(deep), "1200M", "info")
        probe(exe, env, "init", "ctxrace", "20", "4", "64M", "info")
        probe(exe, env, "init", "limit", "4", "65536", "info", "limit", "3", "4", "info", "reset", "info")
        print("3. cuGetProcAddress above CUDA 13.0")
        for via in ("gpa", "gpa2"):
            probe(exe, env, "init", "which", "cuMemAlloc", "13000", "0", "which", "cuMemAlloc", "13020", "0",
                  "which", "cuMemAllocAsync", "13020", "2", "which", "cuGraphLaunch", "13020", "0", via=via)
        print("4. PyTorch (cudaMallocAsync), a captured graph allocating 2 GiB replayed 30 times")
        for who, e in (("bare", dict(os.environ)), ("colo, 4 GiB budget", job(4 * GiB))):
            e = {**e, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
            r = subprocess.run([sys.executable, "-c", TORCH], env=e, capture_output=True, text=True, timeout=300)
            print(f"   {who}: rc {r.returncode}: {r.stdout.strip()} {r.stderr.strip()[-400:]}")


if __name__ == "__main__":
    main()
