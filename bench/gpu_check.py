"""colo on a real GPU, in one command: build native/, run each part in its own process with a time
limit, never stop at the first failure, and write gpu-report.json and gpu-report.md to OUT.

    python bench/gpu_check.py OUT [--parts frameworks,cost,mps,daemon] [--budget 2GiB] [--deadline 540]
    python bench/gpu_check.py OUT --simulated     # the same parts that can run on native/fakegpu

Parts (docs/gpu.md says what each checks and how to run it on a lent GPU machine):
  frameworks  each framework under the interposer with a budget: sees the budget as the card's
              size, gets its own out-of-memory error at the budget, goes on computing; the ledger
              beside NVML's per-process memory for the same process
  cost        cuMemAlloc/cuMemFree pairs natively and under the interposer, 1 and 8 threads (a C
              program compiled here, dlopen libcuda, no CUDA headers); PyTorch allocator churn
  mps         colo's per-GPU MPS control daemon: two clients with thread % and pinned-memory
              limits, get_server_list, terminate_client, NVML's view of clients and server, a
              fault in one client and what the others and colo see
  daemon      a real colo daemon (process runtime) running jobs: 8 light jobs exclusive, under
              colo and all at once time-sliced; a saturating pair under MPS vs time-sliced; a job
              over its budget fails alone
The Markdown summary ends with the table for docs/gpu.md (parts cost and daemon).

Figures from --simulated describe the simulated driver, not a GPU: they check that this command
works, and never go into docs/gpu.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROBE = HERE / "gpu_probe.py"
GiB, MiB = 1 << 30, 1 << 20
# NVML's per-process memory against the ledger (docs/interposer.md): above it by the context,
# modules and rounding, below it only by what NVML has not caught up with.
NVML_ABOVE, NVML_BELOW = 1 * GiB, 64 * MiB
PARTS = ("frameworks", "cost", "mps", "daemon")
LIMITS = {"frameworks": 330, "cost": 120, "mps": 120, "daemon": 240}  # seconds, real GPU
DEPS_DIR = ROOT / ".gpu-deps"  # colo's pure-Python dependencies, carried to a machine without network
# colo from this checkout, installed or not (a lent GPU machine has no network to install it)
sys.path[:0] = [str(ROOT)] + ([str(DEPS_DIR)] if DEPS_DIR.is_dir() else [])


# --- the context every part process gets ---------------------------------------------------------

def part_env(ctx: dict) -> dict[str, str]:
    """Environment of a part and of the processes it starts (simulated driver first when asked)."""
    env = dict(os.environ)
    for k in ("LD_PRELOAD", "COLO_GPU_BUDGET", "COLO_LEDGER", "COLO_SOCKET"):
        env.pop(k, None)
    py = [str(ROOT)]
    if DEPS_DIR.is_dir():
        py.append(str(DEPS_DIR))
    env["PYTHONPATH"] = os.pathsep.join(py + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if ctx.get("fake_state"):
        lib = str(ROOT / "native" / "build" / "fakegpu")
        env["COLO_FAKEGPU_STATE"] = ctx["fake_state"]
        env["LD_LIBRARY_PATH"] = lib + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env["PATH"] = lib + os.pathsep + env.get("PATH", "")
    return env


class Part:
    """What one part saw: checks (name, ok, detail), results, and its own notes."""

    def __init__(self, ctx: dict):
        self.ctx = ctx
        self.simulated = bool(ctx.get("fake_state"))
        self.checks: list[dict] = []
        self.results: dict = {}
        self.skipped: list[str] = []
        self.env = part_env(ctx)
        self.tmp = Path(tempfile.mkdtemp(prefix="cgc", dir="/tmp"))  # short: MPS socket paths
        os.chmod(self.tmp, 0o755)

    def check(self, name: str, ok: bool, detail="") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def done(self) -> dict:
        failed = [c for c in self.checks if not c["ok"]]
        status = "failed" if failed else ("ok" if self.checks else "skipped")
        return {"status": status, "checks": self.checks, "results": self.results, "skipped": self.skipped}


class Proc:
    """A child process whose JSON-line events are read as they come; it may wait on stdin ("hold")."""

    def __init__(self, argv: list[str], env: dict, cwd: str | None = None):
        self.argv = argv
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env, cwd=cwd, start_new_session=True)
        self.events: list[dict] = []
        self.other: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self._err.extend(self.p.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            try:
                ev = json.loads(line)
                if isinstance(ev, dict):
                    self.events.append(ev)
                    self._q.put(ev)
                    continue
            except ValueError:
                pass
            self.other.append(line.rstrip())
        self._q.put(None)

    def wait_event(self, name: str, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        for ev in self.events:
            if ev.get("event") == name:
                return ev
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self._q.get(timeout=left)
            except queue.Empty:
                return None
            if ev is None:
                return None
            if ev.get("event") == name:
                return ev
        return None

    def send(self, line: str = "go") -> None:
        try:
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def finish(self, timeout: float) -> dict:
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            rc = self.p.wait()
            self.other.append(f"killed after {timeout:g}s")
        time.sleep(0.05)  # let the reader threads drain the pipes
        return {"rc": rc, "events": {e.get("event"): e for e in self.events},
                "stderr": "".join(self._err)[-1500:], "stdout_other": self.other[-10:]}

    def event(self, name: str) -> dict:
        return next((e for e in self.events if e.get("event") == name), {})


def nvml_processes(ctx: dict) -> dict:
    """pid -> {used, mps} for device 0, through colo's own NVML view."""
    from colo.node.gpu import Nvml

    dev = Nvml(Path(ctx["fake_state"]) if ctx.get("fake_state") else None).devices()[0]
    return {p.pid: {"used": p.used, "mps": p.mps} for p in dev.processes}


def gpu0(ctx: dict) -> dict:
    from colo.node.gpu import Nvml

    d = Nvml(Path(ctx["fake_state"]) if ctx.get("fake_state") else None).devices()[0]
    return {"uuid": d.uuid, "name": d.name, "total": d.total, "compute_mode": d.compute_mode}


def budget_env(part: Part, budget: int, name: str) -> tuple[dict, Path]:
    from colo.node import interposer

    ledger = part.tmp / f"ledger-{name}"
    interposer.create_ledger(ledger, budget)
    env = {**part.env, **interposer.job_env(budget, str(ledger), str(interposer.library_path()))}
    return env, ledger


# --- part 1: frameworks under a budget ----------------------------------------------------------

PRELUDE = """
import json, os, sys
B = int(os.environ["COLO_GPU_BUDGET"])
def say(**kw): print(json.dumps(kw), flush=True)
def hold(): say(event="hold", pid=os.getpid()); sys.stdin.readline()
"""

TORCH = """
import torch
free, total = torch.cuda.mem_get_info()
say(event="init", total=total, free=free, version=torch.__version__, cuda=torch.version.cuda,
    alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
x = torch.empty(int(0.75 * B), dtype=torch.uint8, device="cuda")
try:
    y = torch.empty(int(0.5 * B), dtype=torch.uint8, device="cuda")
    say(event="over", refused=False)
except torch.cuda.OutOfMemoryError as e:
    say(event="over", refused=True, error=str(e).strip().splitlines()[0][:400])
hold()
a = torch.randn(1024, 1024, device="cuda")
v = float((a @ a).sum().item()); torch.cuda.synchronize()
say(event="after", rc=0, value=v)
"""

CUPY = """
import cupy
if os.environ.get("COLO_CHECK_POOL") == "async":
    cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
free, total = cupy.cuda.runtime.memGetInfo()
say(event="init", total=total, free=free, version=cupy.__version__, pool=os.environ.get("COLO_CHECK_POOL"))
x = cupy.empty(int(0.75 * B), dtype=cupy.uint8)
try:
    y = cupy.empty(int(0.5 * B), dtype=cupy.uint8)
    say(event="over", refused=False)
except Exception as e:
    say(event="over", refused="OutOfMemory" in type(e).__name__ or "out of memory" in str(e).lower(),
        error=(type(e).__name__ + ": " + str(e).strip().splitlines()[0])[:400])
hold()
v = float(cupy.ones((512, 512)).dot(cupy.ones((512, 512))).sum())
say(event="after", rc=0, value=v)
"""

JAX = """
import jax, jax.numpy as jnp
d = jax.devices()[0]
jnp.ones(8).block_until_ready()
st = d.memory_stats() or {}
say(event="init", total=st.get("bytes_limit"), version=jax.__version__, platform=d.platform,
    preallocate=os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true"))
x = jnp.ones(int(0.5 * B) // 4, jnp.float32).block_until_ready()
try:
    y = jnp.ones(int(0.6 * B) // 4, jnp.float32).block_until_ready()
    say(event="over", refused=False)
except Exception as e:
    m = str(e)
    say(event="over", refused="RESOURCE_EXHAUSTED" in m or "out of memory" in m.lower(),
        error=(type(e).__name__ + ": " + m.strip().splitlines()[0])[:400])
hold()
v = float((jnp.ones((512, 512)) @ jnp.ones((512, 512))).sum())
say(event="after", rc=0, value=v)
"""

TENSORFLOW = """
import tensorflow as tf
from tensorflow.python.client import device_lib
lim = [d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU"]
say(event="init", total=lim[0] if lim else None, version=tf.__version__)
with tf.device("/GPU:0"):
    x = tf.ones((int(0.5 * B) // 4,), tf.float32); float(tf.reduce_sum(x))
    try:
        y = tf.ones((int(0.6 * B) // 4,), tf.float32); float(tf.reduce_sum(y))
        say(event="over", refused=False)
    except tf.errors.ResourceExhaustedError as e:
        say(event="over", refused=True, error=str(e).strip().splitlines()[0][:400])
    hold()
    a = tf.ones((512, 512)); v = float(tf.reduce_sum(tf.matmul(a, a)))
say(event="after", rc=0, value=v)
"""

# name, module needed, code (None: the driver-API probe), extra env, how "sees the budget" is judged
FRAMEWORKS = [
    ("driver API (ctypes)", None, None, {}, "exact"),
    ("PyTorch, default allocator", "torch", TORCH, {}, "exact"),
    ("PyTorch, expandable_segments:True", "torch", TORCH, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
     "exact"),
    ("PyTorch, backend:cudaMallocAsync", "torch", TORCH, {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
     "exact"),
    ("CuPy, default pool", "cupy", CUPY, {}, "exact"),
    ("CuPy, MemoryAsyncPool", "cupy", CUPY, {"COLO_CHECK_POOL": "async"}, "exact"),
    ("JAX, preallocation on", "jax", JAX, {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, "within"),
    ("TensorFlow", "tensorflow", TENSORFLOW, {}, "within"),
]


def part_frameworks(part: Part) -> None:
    from colo.node import interposer

    budget = part.ctx["budget"]
    card = gpu0(part.ctx)
    part.results["gpu"] = card
    rows = []
    for i, (name, module, code, extra, judge) in enumerate(FRAMEWORKS):
        if module and part.simulated:
            part.skipped.append(f"{name}: needs a real driver (frameworks' cudart does not run on the simulated one)")
            continue
        if module and importlib.util.find_spec(module) is None:
            part.skipped.append(f"{name}: {module} is not installed")
            continue
        env, ledger = budget_env(part, budget, f"fw{i}")
        env.update(extra)
        if code is None:
            argv = [sys.executable, str(PROBE), "--mem", str(int(0.75 * budget)), "--over", str(int(0.5 * budget)),
                    "--hold", "--after"]
        else:
            argv = [sys.executable, "-c", PRELUDE + textwrap.dedent(code)]
        p = Proc(argv, env)
        seen: dict = {}
        if p.wait_event("hold", 150):
            pid = p.event("hold")["pid"]
            led = interposer.read_ledger(ledger)
            mine = [x for x in led.processes if x["pid"] == pid or x["host_pid"] == pid]
            try:
                nv = nvml_processes(part.ctx).get(pid)
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                nv = {"error": str(e)}
            seen = {"ledger_used": led.total_used, "ledger_process_used": sum(x["used"] for x in mine),
                    "ledger_refused": led.refused, "nvml": nv}
        p.send()
        out = p.finish(60)
        ev = out["events"]
        init, over, after = ev.get("init", {}), ev.get("over", {}), ev.get("after", {})
        total = init.get("total")
        row = {"name": name, "rc": out["rc"], "total_seen": total, "card": card["total"], "budget": budget,
               "refused": over.get("refused"), "oom_error": over.get("error"), "after_rc": after.get("rc"),
               "version": init.get("version"), "at_hold": seen, "stderr": out["stderr"][-600:] if out["rc"] else ""}
        rows.append(row)
        if judge == "exact":
            part.check(f"{name}: sees the budget as the card's size", total == budget,
                       f"total seen {total}, budget {budget}, card {card['total']}")
        else:
            part.check(f"{name}: sizes itself within the budget", total is not None and 0.3 * budget <= total <= budget,
                       f"its pool {total}, budget {budget}")
        part.check(f"{name}: its own out-of-memory error at the budget", over.get("refused") is True,
                   over.get("error") or out["stderr"][-300:])
        part.check(f"{name}: goes on computing after it", after.get("rc") == 0 and out["rc"] == 0,
                   f"exit {out['rc']}; {out['stderr'][-300:]}")
        if seen:
            part.check(f"{name}: ledger within the budget", seen["ledger_used"] <= budget, str(seen))
            nv = (seen.get("nvml") or {}).get("used")
            if isinstance(nv, int):  # docs/interposer.md, "What a budget includes": the stated margin
                diff = nv - seen["ledger_process_used"]
                part.check(f"{name}: NVML's memory for the process within {NVML_BELOW // MiB} MiB below and "
                           f"{NVML_ABOVE // MiB} MiB above its ledger", -NVML_BELOW <= diff <= NVML_ABOVE,
                           f"NVML {nv}, ledger {seen['ledger_process_used']}, difference {diff}")
        else:
            part.check(f"{name}: reached the point of holding its memory", False, out["stderr"][-300:])
    part.results["frameworks"] = rows
    interposer_gpu_tests(part)


def interposer_gpu_tests(part: Part) -> None:
    """tests/test_interposer_gpu.py (pytest mark gpu): pools with a release threshold (PyTorch's
    cudaMallocAsync backend, CuPy's MemoryAsyncPool), graph memory, the NVML margin."""
    if importlib.util.find_spec("pytest") is None:
        part.skipped.append("interposer gpu tests: pytest is not installed (python bench/gpu_check.py --prepare-deps)")
        return
    xml_out = part.tmp / "interposer-gpu.xml"
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                            str(ROOT / "tests" / "test_interposer_gpu.py"), f"--junitxml={xml_out}"],
                           capture_output=True, text=True, timeout=part.ctx.get("gpu_tests_s", 150), env=part.env,
                           cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        part.check("interposer gpu tests finished in time", False, f"over {part.ctx.get('gpu_tests_s', 150)} s")
        return
    import xml.etree.ElementTree as ET

    try:
        cases = ET.parse(xml_out).getroot().iter("testcase")
    except (OSError, ET.ParseError):
        part.check("interposer gpu tests ran", False, (r.stdout + r.stderr)[-600:])
        return
    outcomes = {}
    for c in cases:
        name = c.get("name", "?")
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        if c.find("skipped") is not None:
            part.skipped.append(f"interposer gpu test {name}: {c.find('skipped').get('message', '')[:200]}")
            outcomes[name] = "skipped"
        else:
            part.check(f"interposer gpu test {name}", bad is None, "" if bad is None else (bad.get("message") or "")[:600])
            outcomes[name] = "failed" if bad is not None else "passed"
    part.results["interposer_gpu_tests"] = outcomes


# --- part 2: interposer cost --------------------------------------------------------------------

COST_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int CUresult; typedef void *CUcontext; typedef unsigned long long CUdeviceptr;
static CUresult (*Init)(unsigned); static CUresult (*Retain)(CUcontext *, int);
static CUresult (*SetCur)(CUcontext); static CUresult (*Alloc)(CUdeviceptr *, size_t);
static CUresult (*Free)(CUdeviceptr);
static int pairs, fails; static size_t bytes; static pthread_barrier_t bar; static double ns[64];
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static void *loop(void *arg) {
    long id = (long)arg; CUcontext c; CUdeviceptr p;
    if (Retain(&c, 0) || SetCur(c)) { __sync_fetch_and_add(&fails, 1); }
    for (int i = 0; i < 200; i++) { if (!Alloc(&p, bytes)) Free(p); }  /* warm up */
    pthread_barrier_wait(&bar);
    double t0 = now();
    for (int i = 0; i < pairs; i++) {
        if (Alloc(&p, bytes)) { __sync_fetch_and_add(&fails, 1); continue; }
        if (Free(p)) __sync_fetch_and_add(&fails, 1);
    }
    ns[id] = (now() - t0) / pairs;
    return NULL;
}
static void *need(void *h, const char *n) {
    void *f = dlsym(h, n);
    if (!f) { fprintf(stderr, "libcuda.so.1 has no %s\n", n); exit(2); }
    return f;
}
int main(int argc, char **argv) {
    if (argc < 4) return 2;
    int threads = atoi(argv[1]); pairs = atoi(argv[2]); bytes = strtoull(argv[3], NULL, 10);
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) { fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror()); return 2; }
    *(void **)&Init = need(h, "cuInit"); *(void **)&Retain = need(h, "cuDevicePrimaryCtxRetain");
    *(void **)&SetCur = need(h, "cuCtxSetCurrent"); *(void **)&Alloc = need(h, "cuMemAlloc_v2");
    *(void **)&Free = need(h, "cuMemFree_v2");
    CUresult r = Init(0);
    if (r) { fprintf(stderr, "cuInit: %d\n", r); return 1; }
    pthread_t th[64]; pthread_barrier_init(&bar, NULL, threads);
    for (long t = 0; t < threads; t++) pthread_create(&th[t], NULL, loop, (void *)t);
    double sum = 0;
    for (int t = 0; t < threads; t++) { pthread_join(th[t], NULL); sum += ns[t]; }
    if (fails) { fprintf(stderr, "%d calls failed\n", fails); return 3; }
    printf("%.2f\n", sum / threads);
    return 0;
}
"""

CHURN = """
import random, time, torch
torch.empty(1, device="cuda"); torch.cuda.synchronize()
rng = random.Random(8); sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
live = []
t0 = time.perf_counter()
for i in range(10000):
    live.append(torch.empty(rng.choice(sizes), dtype=torch.uint8, device="cuda"))
    if len(live) > 64:
        live.pop(rng.randrange(len(live)))
torch.cuda.synchronize()
say(event="churn", seconds=time.perf_counter() - t0, tensors=10000)
"""


def part_cost(part: Part) -> None:
    from colo.node import interposer

    cc = shutil.which("cc") or shutil.which("gcc")
    if not part.check("a C compiler", cc is not None, "cc/gcc not on PATH"):
        return
    src, exe = part.tmp / "cost.c", part.tmp / "cost"
    src.write_text(COST_C)
    r = subprocess.run([cc, "-O2", "-o", str(exe), str(src), "-ldl", "-lpthread"], capture_output=True, text=True)
    if not part.check("cost program compiles", r.returncode == 0, r.stderr[-500:]):
        return
    pairs, repeat, size = part.ctx["pairs"], part.ctx["repeat"], 1 << 20
    budget = 8 * GiB
    inter_env, ledger = budget_env(part, budget, "cost")
    rows = []
    for threads in (1, 8):
        direct, inter, errors = [], [], []
        for _ in range(repeat):  # alternate, so drift in the machine's load hits both alike
            for env, out in ((part.env, direct), (inter_env, inter)):
                r = subprocess.run([str(exe), str(threads), str(pairs), str(size)], env=env, capture_output=True,
                                   text=True, timeout=120)
                if r.returncode == 0:
                    out.append(float(r.stdout))
                else:
                    errors.append(f"{'interposed' if env is inter_env else 'native'}: exit {r.returncode}: "
                                  f"{r.stderr.strip()[-300:]}")
        part.check(f"{repeat}x {pairs} alloc/free pairs per thread, {threads} thread(s), native and interposed, "
                   "every call succeeded", not errors, errors[:2])
        if direct and inter:
            dm, im = statistics.median(direct), statistics.median(inter)
            rows.append({"threads": threads, "pairs": pairs, "bytes": size, "native_ns": dm, "interposed_ns": im,
                         "added_ns": im - dm, "ratio": im / dm})
    led = interposer.read_ledger(ledger)
    part.check("the ledger is back to 0 after the cost runs, nothing refused",
               led.total_used == 0 and led.refused == 0, f"used {led.total_used}, refused {led.refused}")
    part.results["pairs"] = rows
    if part.simulated:
        part.skipped.append("PyTorch allocator churn: needs a real driver")
        return
    if importlib.util.find_spec("torch") is None:
        part.skipped.append("PyTorch allocator churn: torch is not installed")
        return
    churn = []
    for caching in ("1", "0"):  # caching allocator on (default) / off (every tensor reaches the driver)
        times: dict[str, list[float]] = {"native": [], "interposed": []}
        for _ in range(2):
            for kind, env in (("native", part.env), ("interposed", budget_env(part, budget, "churn")[0])):
                env = {**env, "COLO_GPU_BUDGET": env.get("COLO_GPU_BUDGET", str(budget))}
                if caching == "0":
                    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
                p = Proc([sys.executable, "-c", PRELUDE + textwrap.dedent(CHURN)], env)
                out = p.finish(120)
                ev = out["events"].get("churn")
                if part.check(f"PyTorch churn, caching {'on' if caching == '1' else 'off'}, {kind}",
                              out["rc"] == 0 and ev is not None, out["stderr"][-300:]):
                    times[kind].append(ev["seconds"])
        if times["native"] and times["interposed"]:
            n, i = statistics.median(times["native"]), statistics.median(times["interposed"])
            churn.append({"caching": caching == "1", "native_s": n, "interposed_s": i, "ratio": i / n})
    part.results["churn"] = churn


# --- part 3: MPS --------------------------------------------------------------------------------

def part_mps(part: Part) -> None:
    from colo.node import mps

    ctl = shutil.which("nvidia-cuda-mps-control", path=part.env.get("PATH"))
    part.results["control"] = ctl
    if not part.check("nvidia-cuda-mps-control is installed", ctl is not None, "not on PATH"):
        return
    card = gpu0(part.ctx)
    m = mps.MpsManager(part.tmp / "mps", ctl, env=part.env)
    clients: list[Proc] = []
    try:
        d = m.ensure(card["uuid"], 0)
        part.results["daemon"] = {"pid": d.pid, "pipe_dir": str(d.pipe_dir), "health": d.health()}
        part.check("colo starts its control daemon with a private pipe folder", d.pid is not None,
                   part.results["daemon"])
        replies = {}
        for cmd, call in (("set_default_active_thread_percentage 50", lambda: d.set_default_thread_pct(50)),
                          ("set_default_device_pinned_mem_limit 0 2G",
                           lambda: d.set_default_pinned_mem_limit(0, 2 * GiB))):
            try:
                call()
                replies[cmd] = "accepted"
            except mps.MpsError as e:
                replies[cmd] = f"refused: {e}"
        for cmd in ("get_default_active_thread_percentage", "get_default_device_pinned_mem_limit 0"):
            try:
                replies[cmd] = d.command(cmd)
            except mps.MpsError as e:
                replies[cmd] = f"error: {e}"
        part.results["control_replies"] = replies
        part.check("the daemon accepts colo's default limits", all(v == "accepted" for k, v in replies.items()
                                                                   if k.startswith("set_")), replies)
        # two clients: different thread % and pinned limits (the client env colo gives an MPS job)
        specs = [("A", 1 * GiB, 25, 512 * MiB), ("B", 2 * GiB, 50, 1 * GiB)]
        for name, limit, pct, mem in specs:
            env = {**part.env, **d.client_env(limit, pct)}
            clients.append(Proc([sys.executable, str(PROBE), "--mem", str(mem), "--over", str(limit),
                                 "--busy", "3", "--hold", "--after"], env))
        started = [c.wait_event("busy", 90) is not None or c.wait_event("mem", 1) is not None for c in clients]
        part.check("both clients attach and allocate", all(c.event("mem").get("rc") == 0 for c in clients),
                   [c.events[:3] or c.finish(1)["stderr"] for c in clients] if not all(started) else "")
        for c, (name, limit, pct, mem) in zip(clients, specs):
            over = c.event("over")
            part.results[f"client_{name}"] = {"limit": limit, "thread_pct": pct, "init": c.event("init"),
                                              "over": over}
            part.check(f"client {name}: the pinned limit {mps.mps_size(limit)} refuses {mps.mps_size(mem + limit)}",
                       over.get("refused") is True, over)
        # while they are busy: what the control daemon and NVML say
        servers = d.server_list()
        listed = {s: d.client_list(s) for s in servers}
        part.results["servers"] = listed
        pids = {c.p.pid for c in clients}
        part.check("get_server_list names a server whose clients are our two",
                   any(pids <= set(v) for v in listed.values()), {"servers": listed, "clients": sorted(pids)})
        try:
            from colo.node.gpu import Nvml

            nv = Nvml(Path(part.ctx["fake_state"]) if part.simulated else None)
            dev = nv.devices()[0]
            util = nv.process_utilization(0)
            server_pids = set(servers)
            part.results["nvml"] = {
                "processes": [{"pid": p.pid, "used": p.used, "mps_list": p.mps,
                               "role": "client" if p.pid in pids else "server" if p.pid in server_pids else "other"}
                              for p in dev.processes],
                "utilization": {str(pid): {"sm": u[0], "mem": u[1],
                                           "role": "client" if pid in pids else "server" if pid in server_pids
                                           else "other"} for pid, u in util.items()},
                "device_sm_util": dev.sm_util}
            part.check("NVML lists the MPS clients", pids <= {p.pid for p in dev.processes},
                       part.results["nvml"]["processes"])
        except Exception as e:  # noqa: BLE001 - recorded
            part.check("NVML answers for MPS processes", False, f"{type(e).__name__}: {e}")
        for c in clients:
            c.wait_event("hold", 30)
        # terminate_client for A; B must not notice
        a, b = clients
        owner = next((s for s, v in listed.items() if a.p.pid in v), None)
        try:
            d.terminate_client(owner, a.p.pid)
            part.results["terminate_client"] = "sent"
        except (mps.MpsError, TypeError) as e:
            part.results["terminate_client"] = f"failed: {e}"
        a.send()
        ra = a.finish(30)
        b.send()
        rb = b.finish(30)
        part.results["after_terminate"] = {"A": ra["events"].get("after"), "A_rc": ra["rc"],
                                           "B": rb["events"].get("after"), "B_rc": rb["rc"]}
        part.check("terminate_client ends A's use of the GPU (810 or A gone)",
                   (ra["events"].get("after") or {}).get("rc") not in (0, None) or ra["rc"] != 0,
                   part.results["after_terminate"])
        part.check("B goes on after A was terminated", rb["rc"] == 0, rb["stderr"][-300:])
        clients.clear()
        # a fault in one client: what a neighbour and colo see
        fault_part(part, m, d)
    finally:
        for c in clients:
            c.send()
            c.finish(10)
        try:
            m.stop_all()
        except Exception as e:  # noqa: BLE001
            part.results["stop_all"] = str(e)


def fault_part(part: Part, m, d) -> None:
    env = {**part.env, **d.client_env(1 * GiB, None)}
    victim = Proc([sys.executable, str(PROBE), "--mem", str(64 * MiB), "--hold", "--after"], env)
    culprit = Proc([sys.executable, str(PROBE), "--mem", str(64 * MiB), "--hold"]
                   + ([] if part.simulated else ["--fault"]), env)
    ok = victim.wait_event("hold", 60) and culprit.wait_event("hold", 60)
    if not part.check("two clients for the fault attach", bool(ok), [victim.events, culprit.events]):
        for p in (victim, culprit):
            p.send()
            p.finish(10)
        return
    if part.simulated:  # the simulated driver faults a server on request (fake_fault)
        server = next((s for s in d.server_list() if culprit.p.pid in d.client_list(s)), None)
        d.command(f"fake_fault {server}")
    culprit.send()
    rc = culprit.finish(30)
    seen = m.check()
    victim.send()
    rv = victim.finish(30)
    part.results["fault"] = {"culprit": rc["events"].get("fault"), "culprit_rc": rc["rc"],
                             "victim_after": rv["events"].get("after"), "victim_rc": rv["rc"],
                             "colo_faults": {u: p for u, p in seen.faults.items()},
                             "colo_events": [msg for _, msg in seen.events], "health_after": d.health()}
    if not part.simulated:
        part.check("the faulting kernel gave CUDA_ERROR_ILLEGAL_ADDRESS",
                   (rc["events"].get("fault") or {}).get("illegal_address") is True, rc["events"].get("fault"))
    part.check("colo's MPS check reports the fault", bool(seen.faults) or any("fault" in m_.lower() for _, m_ in
                                                                              seen.events), part.results["fault"])


# --- part 4: a real daemon with real jobs -------------------------------------------------------

LIGHT_TORCH = """
import torch
m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x = torch.randn(64, 256, device="cuda"); y = torch.randint(0, 10, (64,), device="cuda")
for _ in range(int(sys.argv[1])):
    opt.zero_grad(); torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step()
torch.cuda.synchronize()
say(event="done", rc=0)
"""

HEAVY_TORCH = """
import torch
a = torch.randn(4096, 4096, device="cuda")
for _ in range(int(sys.argv[1])):
    b = a @ a
torch.cuda.synchronize()
say(event="done", rc=0)
"""


def job_argv(part: Part, kind: str) -> list[str]:
    """A fixed amount of work: light (a small training loop) or heavy (big matmuls) on a real GPU;
    on the simulated driver, synchronised memsets (they take no time there)."""
    if part.simulated or importlib.util.find_spec("torch") is None:
        return [sys.executable, str(PROBE), "--mem", str(64 * MiB), "--work", "50" if kind == "light" else "200"]
    script = part.tmp / f"{kind}.py"
    script.write_text(PRELUDE.replace('B = int(os.environ["COLO_GPU_BUDGET"])', "") + textwrap.dedent(
        LIGHT_TORCH if kind == "light" else HEAVY_TORCH))
    os.chmod(script, 0o644)
    return [sys.executable, str(script), str(part.ctx["light_steps"] if kind == "light" else part.ctx["heavy_iters"])]


def run_together(argvs: list[list[str]], envs: list[dict], timeout: float) -> tuple[float, list[int], list[str]]:
    t0 = time.perf_counter()
    ps = [subprocess.Popen(a, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
          for a, e in zip(argvs, envs)]
    errs = []
    for p in ps:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        errs.append(err[-300:])
    return time.perf_counter() - t0, [p.returncode for p in ps], errs


def part_daemon(part: Part) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from daemon_util import DaemonProc, wait_for

    from colo.node import mps, native

    burn = str(native.path("colo-burn"))
    light = job_argv(part, "light")
    heavy = job_argv(part, "heavy")
    part.results["jobs"] = {"light": light, "heavy": heavy}
    n = 8
    # exclusive: one at a time, no colo
    t0 = time.perf_counter()
    rcs = []
    for _ in range(n):
        rcs.append(subprocess.run(light, env=part.env, capture_output=True, timeout=120).returncode)
    excl = time.perf_counter() - t0
    part.check("8 light jobs, exclusive: all succeed", rcs == [0] * n, rcs)
    # all at once, time-sliced, no colo
    null = mps.timesliced_env(part.tmp / "ts")
    ts, rcs, errs = run_together([light] * n, [{**part.env, **null}] * n, 240)
    part.check("8 light jobs, all at once time-sliced: all succeed", rcs == [0] * n, [rcs, errs[:1]])
    root = part.tmp / "d"
    root.mkdir()
    fake = Path(part.ctx["fake_state"]) if part.simulated else None
    d = DaemonProc(root, fake, {"sample_interval": 0.5, "reserve": "256MiB"})
    try:
        d.start()
        os.chmod(d.socket.parent, 0o755)
        spec = {"gpus": 1, "gpu_mem": 1 * GiB, "workdir": str(part.tmp)}
        t0 = time.perf_counter()
        ids = [d.client.submit({**spec, "argv": light, "name": f"light{i}"})["id"] for i in range(n)]
        rows = wait_for(lambda: (js := [d.client.show(i) for i in ids]) and all(
            j["state"] in ("succeeded", "failed", "cancelled", "lost") for j in js) and js, 300, "light jobs")
        colo_wall = time.perf_counter() - t0
        part.results["light_under_colo"] = [{k: j.get(k) for k in ("id", "state", "mode", "gpus", "exit_code", "reason")}
                                            for j in rows]
        part.check("8 light jobs under colo: all succeed", all(j["state"] == "succeeded" for j in rows),
                   part.results["light_under_colo"])
        part.results["light"] = {"jobs": n, "exclusive_s": excl, "colo_s": colo_wall, "timesliced_s": ts,
                                 "colo_vs_exclusive": excl / colo_wall, "timesliced_vs_exclusive": excl / ts}
        # colo-burn and the light loop placed together, and a job over its budget failing alone
        nb = d.client.submit({**spec, "gpu_mem": 512 * MiB, "name": "burn",
                              "argv": [burn, "--mem", "128MiB", "--duty", "50", "--seconds", "3"]})["id"]
        nl = d.client.submit({**spec, "name": "loop", "argv": light})["id"]
        bad = d.client.submit({**spec, "gpu_mem": 512 * MiB, "name": "over-budget",
                               "argv": [burn, "--mem", "1GiB", "--seconds", "1"]})["id"]
        ends = {i: d.wait_state(i, "succeeded", "failed", "cancelled", "lost", timeout=180) for i in (nb, nl, bad)}
        part.results["budget_jobs"] = {ends[i]["name"] if "name" in ends[i] else str(i):
                                       {k: ends[i].get(k) for k in ("state", "exit_code", "reason", "mode")}
                                       for i in ends}
        part.check("colo-burn and the loop succeed beside a job over its budget",
                   ends[nb]["state"] == "succeeded" and ends[nl]["state"] == "succeeded", part.results["budget_jobs"])
        part.check("the job over its budget fails alone (colo-burn exit 3: allocation refused)",
                   ends[bad]["state"] == "failed" and ends[bad].get("exit_code") == 3, part.results["budget_jobs"])
    finally:
        try:
            d.stop()
        except Exception as e:  # noqa: BLE001
            part.results["daemon_stop"] = str(e)
        part.results["daemon_log_tail"] = d.log.read_text(errors="replace")[-1500:] if d.log.exists() else ""
    # a saturating pair: MPS vs time-sliced (and one at a time)
    t0 = time.perf_counter()
    rcs = [subprocess.run(heavy, env=part.env, capture_output=True, timeout=120).returncode for _ in range(2)]
    pair_excl = time.perf_counter() - t0
    pair_ts, rts, _ = run_together([heavy] * 2, [{**part.env, **null}] * 2, 240)
    m = mps.MpsManager(part.tmp / "mps", shutil.which("nvidia-cuda-mps-control", path=part.env.get("PATH")) or
                       "nvidia-cuda-mps-control", env=part.env)
    pair_mps, rmps = None, None
    if m.available():
        try:
            md = m.ensure(gpu0(part.ctx)["uuid"], 0)
            pair_mps, rmps, _ = run_together([heavy] * 2, [{**part.env, **md.client_env(4 * GiB, None)}] * 2, 240)
        finally:
            m.stop_all()
    part.check("saturating pair: every run succeeds", rcs == [0, 0] and rts == [0, 0] and rmps in (None, [0, 0]),
               {"exclusive": rcs, "timesliced": rts, "mps": rmps})
    part.results["pair"] = {"exclusive_s": pair_excl, "timesliced_s": pair_ts, "mps_s": pair_mps,
                            "mps_vs_timesliced": (pair_ts / pair_mps) if pair_mps else None}


# --- running parts, each in its own process -------------------------------------------------------

def run_part_here(name: str, ctx: dict) -> dict:
    part = Part(ctx)
    try:
        if ctx.get("fail_part") == name:
            raise RuntimeError(f"failure injected into part {name} (--fail-part)")
        {"frameworks": part_frameworks, "cost": part_cost, "mps": part_mps, "daemon": part_daemon}[name](part)
        out = part.done()
    except Exception as e:  # noqa: BLE001 - the report says what broke, the other parts still run
        out = part.done()
        out.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    finally:
        shutil.rmtree(part.tmp, ignore_errors=True)
    return out


def run_part(name: str, ctx: dict, out: Path, limit: float) -> dict:
    res_file = out / "parts" / f"{name}.json"
    ctx_file = out / "parts" / f"{name}.ctx.json"
    ctx_file.write_text(json.dumps(ctx))
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--run-part", name, str(ctx_file),
                          str(res_file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=part_env(ctx), start_new_session=True)
    try:
        log, _ = p.communicate(timeout=limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the part and everything it started
        log, _ = p.communicate()
        timed_out = True
    wall = time.monotonic() - t0
    (out / "parts" / f"{name}.log").write_text(log or "")
    try:
        res = json.loads(res_file.read_text())
    except (OSError, ValueError):
        res = {"status": "error", "checks": [], "results": {}, "skipped": []}
    if timed_out:
        res.update(status="timeout", error=f"killed after its time limit of {limit:.0f} s")
    elif p.returncode != 0 and res.get("status") != "error":
        res.update(status="error", error=f"part process exited {p.returncode}: {(log or '').strip()[-500:]}")
    res["seconds"] = round(wall, 1)
    return res


def sh(argv: list[str], timeout: float = 30, env=None) -> tuple[int, str]:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        return r.returncode, (r.stdout + r.stderr).strip()
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]}: timed out after {timeout}s"


def versions(ctx: dict) -> dict:
    """Driver, CUDA, tools and frameworks, each found in its own process (imports can hang)."""
    env = part_env(ctx)
    v: dict = {"python": platform.python_version(), "platform": platform.platform(), "host": platform.node()}
    code = ("import json, pynvml as n; n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0); "
            "m = n.nvmlDeviceGetMemoryInfo(h); s = lambda x: x.decode() if isinstance(x, bytes) else x; "
            "print(json.dumps({'driver': s(n.nvmlSystemGetDriverVersion()), "
            "'cuda_driver': n.nvmlSystemGetCudaDriverVersion(), 'gpus': n.nvmlDeviceGetCount(), "
            "'gpu0': s(n.nvmlDeviceGetName(h)), 'gpu0_memory': m.total}))")
    rc, text = sh([sys.executable, "-c", code], 60, env)
    try:
        v["nvml"] = json.loads(text.splitlines()[-1]) if rc == 0 else {"error": text[-500:]}
    except (ValueError, IndexError):
        v["nvml"] = {"error": text[-500:]}
    rc, text = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_mode,mig.mode.current",
                   "--format=csv,noheader"], 30, env)
    v["nvidia-smi"] = text[-500:]
    rc, text = sh(["nvcc", "--version"], 30, env)
    v["nvcc"] = text.splitlines()[-1] if rc == 0 and text else text[-200:]
    rc, text = sh([shutil.which("cc") or "cc", "--version"], 30, env)
    v["cc"] = text.splitlines()[0] if text else ""
    probes = {
        "torch": "import torch; print(torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())",
        "cupy": "import cupy; print(cupy.__version__)",
        "jax": "import jax; print(jax.__version__, jax.default_backend())",
        "tensorflow": "import tensorflow as tf; print(tf.__version__)",
        "nvidia-ml-py": "import pynvml; from importlib.metadata import version; print(version('nvidia-ml-py'))",
    }
    ps = {}
    for name, c in probes.items():
        if importlib.util.find_spec(name.split("-")[0] if name != "nvidia-ml-py" else "pynvml") is None:
            v[name] = "not installed"
            continue
        ps[name] = subprocess.Popen([sys.executable, "-c", c], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env={**env, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0"),
                                                    "TF_CPP_MIN_LOG_LEVEL": "3"})
    for name, p in ps.items():
        try:
            out, _ = p.communicate(timeout=90)
            v[name] = out.strip().splitlines()[-1] if p.returncode == 0 and out.strip() else f"error: {out.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            p.kill()
            v[name] = "error: import timed out after 90 s"
    v["mps_control"] = shutil.which("nvidia-cuda-mps-control", path=env.get("PATH")) or "not installed"
    return v


# --- the report ---------------------------------------------------------------------------------

def table(report: dict) -> list[str]:
    """The table of parts 2 and 4 (cost, daemon) for docs/gpu.md."""
    parts = report["parts"]
    rows = []
    for r in parts.get("cost", {}).get("results", {}).get("pairs", []):
        rows.append((f"cuMemAlloc+cuMemFree pair, 1 MiB, {r['threads']} thread(s)",
                     f"{r['interposed_ns']:.0f} ns interposed vs {r['native_ns']:.0f} ns native "
                     f"(+{r['added_ns']:.0f} ns, {r['ratio']:.2f}x)"))
    for r in parts.get("cost", {}).get("results", {}).get("churn", []):
        rows.append((f"PyTorch churn, 10,000 tensors, caching allocator {'on' if r['caching'] else 'off'}",
                     f"{r['interposed_s']:.2f} s interposed vs {r['native_s']:.2f} s native ({r['ratio']:.2f}x)"))
    res = parts.get("daemon", {}).get("results", {})
    if "light" in res:
        lt = res["light"]
        rows.append((f"{lt['jobs']} light jobs: throughput vs one at a time",
                     f"under colo {lt['colo_vs_exclusive']:.2f}x, all at once time-sliced without colo "
                     f"{lt['timesliced_vs_exclusive']:.2f}x (walls: {lt['exclusive_s']:.1f} s exclusive, "
                     f"{lt['colo_s']:.1f} s colo, {lt['timesliced_s']:.1f} s time-sliced)"))
    if "pair" in res:
        p = res["pair"]
        mps_s = f"{p['mps_s']:.1f} s" if p.get("mps_s") else "n/a"
        ratio = f" (MPS {p['mps_vs_timesliced']:.2f}x the throughput)" if p.get("mps_vs_timesliced") else ""
        rows.append(("saturating pair: MPS vs time-sliced", f"{mps_s} vs {p['timesliced_s']:.1f} s; "
                     f"one after the other {p['exclusive_s']:.1f} s{ratio}"))
    if "budget_jobs" in res:
        b = res["budget_jobs"]
        rows.append(("a job over its budget", "; ".join(f"{k}: {v['state']} (exit {v.get('exit_code')})"
                                                         for k, v in b.items())))
    out = ["| what | measured |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return out if rows else ["(no figures: parts cost and daemon did not run)"]


def markdown(report: dict) -> str:
    v = report["versions"]
    nv = v.get("nvml", {})
    lines = [f"# colo GPU check: {report['date']}", ""]
    if report["simulated"]:
        lines += ["**SIMULATED DRIVER (native/fakegpu): these figures check that the command works; they say "
                  "nothing about a GPU and never go into docs/gpu.md.**", ""]
    lines += [f"- machine: {v.get('host')} ({v.get('platform')}), Python {v.get('python')}",
              f"- GPU: {nv.get('gpu0', '?')}, {nv.get('gpu0_memory', 0) / GiB:.1f} GiB, driver {nv.get('driver', '?')}, "
              f"CUDA (driver) {nv.get('cuda_driver', '?')}; nvidia-smi: {v.get('nvidia-smi', '')[:200]}",
              f"- nvcc: {v.get('nvcc')}; cc: {v.get('cc')}; MPS control: {v.get('mps_control')}",
              "- frameworks: " + ", ".join(f"{k} {v.get(k)}" for k in ("torch", "cupy", "jax", "tensorflow",
                                                                       "nvidia-ml-py")),
              f"- build of native/: {report['build']['status']} ({report['build']['seconds']} s)"
              + (f": {report['build']['error']}" if report["build"].get("error") else ""),
              f"- command: `{report['command']}`, {report['seconds']:.0f} s in all", "", "## Parts", ""]
    for name, p in report["parts"].items():
        bad = [c for c in p.get("checks", []) if not c["ok"]]
        lines.append(f"### {name}: {p['status']} ({p.get('seconds', 0)} s, "
                     f"{len(p.get('checks', [])) - len(bad)}/{len(p.get('checks', []))} checks passed)")
        lines.append("")
        if p.get("error"):
            lines += [f"error: `{p['error']}`", ""]
        for c in p.get("checks", []):
            detail = "" if c["ok"] else f" — `{json.dumps(c['detail'], default=str)[:400]}`"
            lines.append(f"- [{'x' if c['ok'] else ' '}] {c['name']}{detail}")
        for s in p.get("skipped", []):
            lines.append(f"- skipped: {s}")
        lines.append("")
    fw = report["parts"].get("frameworks", {}).get("results", {}).get("frameworks", [])
    if fw:
        lines += ["## Frameworks under a budget", "",
                  "| framework | version | total it sees | its OOM at the budget | computes after | ledger | NVML, same process |",
                  "|---|---|---|---|---|---|---|"]
        for r in fw:
            h = r.get("at_hold") or {}
            nv = h.get("nvml") or {}
            mib = lambda x: f"{x / MiB:,.0f} MiB" if isinstance(x, (int, float)) else "?"  # noqa: E731
            lines.append(f"| {r['name']} | {r.get('version') or '-'} | {mib(r.get('total_seen'))} of "
                         f"{mib(r['card'])} | {'yes' if r.get('refused') else 'NO'}: {(r.get('oom_error') or '')[:80]} | "
                         f"{'yes' if r.get('after_rc') == 0 and r['rc'] == 0 else 'NO'} | "
                         f"{mib(h.get('ledger_process_used'))} | {mib(nv.get('used'))} |")
        lines.append("")
    lines += ["## Table for docs/gpu.md", ""] + table(report) + [""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, nargs="?", help="folder for gpu-report.json and gpu-report.md")
    ap.add_argument("--simulated", action="store_true", help="run on native/fakegpu (no GPU needed)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--budget", default="2GiB")
    ap.add_argument("--deadline", type=float, default=540, help="seconds for everything; parts share what is left")
    ap.add_argument("--fail-part", help=argparse.SUPPRESS)  # tests: make this part fail, the others must run
    ap.add_argument("--run-part", nargs=3, metavar=("NAME", "CTX", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--prepare-deps", action="store_true",
                    help=f"install colo's pure-Python dependencies into {DEPS_DIR.name}/ (needs a package index; "
                         "carry it to a GPU machine without network)")
    a = ap.parse_args()
    if a.run_part:
        name, ctx_file, res_file = a.run_part
        res = run_part_here(name, json.loads(Path(ctx_file).read_text()))
        Path(res_file).write_text(json.dumps(res, indent=1, default=str))
        return 0
    if a.prepare_deps:
        deps = ["typer>=0.12,<0.29", "nvidia-ml-py>=12.535", "psutil>=5.9", "docker>=7.0", "textual>=0.80",
                "tomli>=2.0", "pytest>=7"]  # pytest: the gpu-marked interposer tests
        return subprocess.call([sys.executable, "-m", "pip", "install", "-q", "--target", str(DEPS_DIR), *deps])
    if a.out is None:
        ap.error("give the folder for the report")
    from colo.units import parse_size

    t_start = time.monotonic()
    out = a.out.resolve()
    (out / "parts").mkdir(parents=True, exist_ok=True)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "simulated": a.simulated,
                    "command": " ".join(["python", "bench/gpu_check.py", *sys.argv[1:]]), "parts": {}}
    t0 = time.monotonic()
    rc, text = sh(["make", "-s", "-C", str(ROOT / "native")], 180)
    report["build"] = {"status": "ok" if rc == 0 else "failed", "seconds": round(time.monotonic() - t0, 1),
                       "error": None if rc == 0 else text[-1000:]}
    ctx = {"budget": parse_size(a.budget), "fail_part": a.fail_part, "fake_state": None,
           "pairs": 20000, "repeat": 3, "light_steps": 6000, "heavy_iters": 2000}
    fake_dir = None
    if a.simulated:
        from colo.node import fakegpu

        fake_dir = Path(tempfile.mkdtemp(prefix="cgc-fake-"))
        os.chmod(fake_dir, 0o755)
        state = fake_dir / "gpus"
        fakegpu.create(state, count=1, mem=80 * GiB, name="Colo Simulated GPU (80 GiB)")
        os.chmod(state, 0o666)
        ctx.update(fake_state=str(state), pairs=5000, repeat=2)
    try:
        report["versions"] = versions(ctx)
        for name in [p for p in a.parts.split(",") if p]:
            if name not in PARTS:
                report["parts"][name] = {"status": "error", "error": f"no part {name!r}; parts: {', '.join(PARTS)}",
                                         "checks": []}
                continue
            left = a.deadline - (time.monotonic() - t_start)
            limit = max(5.0, min(LIMITS[name] * (0.5 if a.simulated else 1), left))
            print(f"gpu_check: part {name} (limit {limit:.0f} s) ...", flush=True)
            report["parts"][name] = res = run_part(name, ctx, out, limit)
            print(f"gpu_check: part {name}: {res['status']} in {res['seconds']} s", flush=True)
    finally:
        if fake_dir:
            shutil.rmtree(fake_dir, ignore_errors=True)
    report["seconds"] = time.monotonic() - t_start
    (out / "gpu-report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu-report.md").write_text(markdown(report))
    print(f"gpu_check: wrote {out / 'gpu-report.json'} and {out / 'gpu-report.md'}")
    ok = report["build"]["status"] == "ok" and all(p["status"] in ("ok", "skipped") for p in report["parts"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
