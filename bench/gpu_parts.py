"""The GPU parts of bench/gpu_check.py (part `machine` is in gpu_facts.py). Each runs in its own
process under a time limit; docs/gpu.md says what each checks.

  frameworks   each framework under the interposer with a budget, all at once: sees the budget as the
               card's size, gets its own out-of-memory error at the budget, goes on computing while
               the others were refused too; the ledger beside NVML; the gpu-marked interposer tests
  mps          colo's MPS control daemon: two clients with thread % and pinned-memory limits, what
               NVML says per process of clients and server, a second Unix user through the pipe folder
  colocation   the same real PyTorch jobs one after another, all at once time-sliced, under colo
               cold (no profile) and under colo seeded with the jobs' profile; a job over its
               budget beside others; a saturating pair time-sliced and (if MPS works here) under MPS
  cost         cuMemAlloc/cuMemFree pairs natively and under the interposer; PyTorch allocator churn
  mps_faults   terminate_client, and a fault in one client: what the others and colo see
  groups       n like jobs at once (2-16 light, 2-4 medium, a compute-bound and a bandwidth-bound
               heavy pair), time-sliced and under MPS, against one alone: what fit_truth.py reads
"""
from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from gpu_partlib import GiB, MiB, PROBE, ROOT, TAIL, Part, Proc, budget_env, gpu0, nvml, nvml_processes

# NVML's per-process memory against the ledger (docs/interposer.md): above it by the context,
# modules and rounding, below it only by what NVML has not caught up with.
NVML_ABOVE, NVML_BELOW = 1 * GiB, 64 * MiB
# cuInit/cuCtxCreate errors that mean MPS itself is refused here (no connection to its server,
# RPC failure, server not ready), not a fault of colo's: the MPS checks are then "skipped"
MPS_REFUSED = {805: "CUDA_ERROR_MPS_CONNECTION_FAILED", 806: "CUDA_ERROR_MPS_RPC_FAILURE",
               807: "CUDA_ERROR_MPS_SERVER_NOT_READY", 999: "CUDA_ERROR_UNKNOWN"}


# --- frameworks under a budget ------------------------------------------------------------------

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
    """Every framework at once, each a job of its own with its own ledger: all are refused past their
    budgets and held there together, then all compute, so a refusal is seen to stay in its process."""
    from colo.node import interposer

    budget = part.ctx["budget"]
    card = gpu0(part.ctx)
    part.put("gpu", card)
    running = []
    for i, (name, module, code, extra, judge) in enumerate(FRAMEWORKS):
        if module and part.simulated:
            part.skip(f"{name}: needs a real driver (frameworks' cudart does not run on the simulated one)")
            continue
        if module and importlib.util.find_spec(module) is None:
            part.skip(f"{name}: {module} is not installed")
            continue
        env, ledger = budget_env(part, budget, f"fw{i}")
        env.update(extra)
        if code is None:
            argv = [sys.executable, str(PROBE), "--mem", str(int(0.75 * budget)), "--over", str(int(0.5 * budget)),
                    "--hold", "--after"]
        else:
            argv = [sys.executable, "-c", PRELUDE + textwrap.dedent(code)]
        running.append((name, judge, ledger, Proc(argv, env)))
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + min(150.0, part.left(40))  # the gpu tests need the rest
    for name, _, ledger, p in running:
        if p.wait_event("hold", max(1.0, deadline - time.monotonic())):
            pid = p.event("hold")["pid"]
            led = interposer.read_ledger(ledger)
            mine = [x for x in led.processes if x["pid"] == pid or x["host_pid"] == pid]
            try:
                nv = nvml_processes(part.ctx).get(pid)
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                nv = {"error": str(e)}
            seen[name] = {"ledger_used": led.total_used, "ledger_process_used": sum(x["used"] for x in mine),
                          "ledger_refused": led.refused, "nvml": nv}
    held = [name for name, *_ in running if name in seen]
    for *_, p in running:
        p.send()
    rows = []
    for name, judge, _, p in running:
        out = p.finish(60)
        init, over, after = (out["events"].get(k, {}) for k in ("init", "over", "after"))
        total = init.get("total")
        at_hold = seen.get(name, {})
        rows.append({"name": name, "rc": out["rc"], "total_seen": total, "card": card["total"], "budget": budget,
                     "refused": over.get("refused"), "oom_error": over.get("error"), "after_rc": after.get("rc"),
                     "version": init.get("version"), "at_hold": at_hold,
                     "stderr": out["stderr"][-600:] if out["rc"] else ""})
        part.results["frameworks"] = rows
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
        if not at_hold:
            part.check(f"{name}: reached the point of holding its memory", False, out["stderr"][-300:])
            continue
        part.check(f"{name}: ledger within the budget", at_hold["ledger_used"] <= budget, str(at_hold))
        nv = (at_hold.get("nvml") or {}).get("used")
        if isinstance(nv, int):  # docs/interposer.md, "What a budget includes": the stated margin
            diff = nv - at_hold["ledger_process_used"]
            part.check(f"{name}: NVML's memory for the process within {NVML_BELOW // MiB} MiB below and "
                       f"{NVML_ABOVE // MiB} MiB above its ledger", -NVML_BELOW <= diff <= NVML_ABOVE,
                       f"NVML {nv}, ledger {at_hold['ledger_process_used']}, difference {diff}")
    if len(held) > 1:
        part.check(f"each refusal stayed in its process: all {len(held)} held their memory past their refusals "
                   "at once, then computed", all(r["after_rc"] == 0 and r["rc"] == 0 for r in rows if r["name"] in held),
                   [(r["name"], r["rc"]) for r in rows if r["rc"]])
    interposer_gpu_tests(part)


def interposer_gpu_tests(part: Part) -> None:
    """tests/test_interposer_gpu.py (pytest mark gpu): pools with a release threshold (PyTorch's
    cudaMallocAsync backend, CuPy's MemoryAsyncPool), graph memory, the NVML margin. The machine's
    own pytest runs them (several at once where pytest-xdist is there)."""
    if importlib.util.find_spec("pytest") is None:
        part.skip("interposer gpu tests: pytest is not installed here")
        return
    xml_out = part.tmp / "interposer-gpu.xml"
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") and not part.simulated else []
    limit = part.left(3)
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *workers,
                            str(ROOT / "tests" / "test_interposer_gpu.py"), f"--junitxml={xml_out}"],
                           capture_output=True, text=True, timeout=limit, env=part.env, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        part.check("interposer gpu tests finished in the part's time", False, f"over {limit:.0f} s")
        return
    import xml.etree.ElementTree as ET

    try:
        cases = list(ET.parse(xml_out).getroot().iter("testcase"))
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
    part.put("interposer_gpu_tests", outcomes)


# --- MPS ----------------------------------------------------------------------------------------

def mps_manager(part: Part):
    """colo's MPS manager for this part, or None with the part marked skipped and why."""
    from colo.node import mps

    ctl = shutil.which("nvidia-cuda-mps-control", path=part.env.get("PATH"))
    part.results["control"] = ctl
    if ctl is None:
        part.skip_part(f"nvidia-cuda-mps-control is not installed here (not on PATH: {part.env.get('PATH')})")
        return None
    m = mps.MpsManager(part.tmp / "mps", ctl, env=part.env)
    if not m.available():
        part.skip_part(m.unavailable_reason)
        return None
    return m


def start_daemon(part: Part, m):
    from colo.node import mps

    try:
        return m.ensure(gpu0(part.ctx)["uuid"], 0)
    except mps.MpsError as e:
        part.skip_part(f"MPS refused here: colo's control daemon did not start: {e}")
        return None


def refused_attach(part: Part, d, procs: list[Proc]) -> bool:
    """When no client could attach with an error that means MPS itself is refused (a sandbox), the
    part is skipped with that error and the control daemon's log; True then."""
    inits = [p.event("init") for p in procs]
    if any(e.get("rc") == 0 for e in inits):
        return False
    codes = {e.get("rc") for e in inits}
    if not (codes & set(MPS_REFUSED) or codes == {None}):
        return False
    try:
        log = (d.log_dir / "control.log").read_text(errors="replace")[-600:]
    except OSError:
        log = ""
    why = ", ".join(f"{c} ({MPS_REFUSED.get(c, 'no answer')})" for c in codes)
    part.skip_part(f"MPS refused here: no client could attach: {why}; control.log: {log.strip()[-300:]}")
    return True


def part_mps(part: Part) -> None:
    from colo.node import mps

    m = mps_manager(part)
    if m is None:
        return
    clients: list[Proc] = []
    try:
        d = start_daemon(part, m)
        if d is None:
            return
        part.put("daemon", {"pid": d.pid, "pipe_dir": str(d.pipe_dir), "health": d.health(),
                            "pipe_mode": oct(d.pipe_dir.stat().st_mode & 0o7777)})
        part.check("colo starts its control daemon with a private pipe folder",
                   d.pid is not None and d.pipe_dir.stat().st_mode & 0o077 == 0, part.results["daemon"])
        replies = {}
        for cmd, call in (("set_default_active_thread_percentage 50", lambda: d.set_default_thread_pct(50)),
                          ("set_default_device_pinned_mem_limit 0 4G",  # above both clients' own limits
                           lambda: d.set_default_pinned_mem_limit(0, 4 * GiB))):
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
        part.put("control_replies", replies)
        part.check("the daemon accepts colo's default limits",
                   all(v == "accepted" for k, v in replies.items() if k.startswith("set_")), replies)
        # two clients: different thread % and budgets (the client env colo gives an MPS job: its
        # pinned limit is the budget and what MPS keeps of it); each then finds the most it can have
        specs = [("A", 1 * GiB, 25, 512 * MiB), ("B", 2 * GiB, 50, 1 * GiB)]
        for name, limit, pct, mem in specs:
            env = {**part.env, **d.client_env(limit, pct)}
            clients.append(Proc([sys.executable, str(PROBE), "--mem", str(mem), "--over", str(limit),
                                 "--most", str(limit), "--busy", "3", "--hold", "--after"], env))
        attach_by = time.monotonic() + min(30.0, part.left(12))
        for c in clients:
            c.wait_event("most", max(0.1, attach_by - time.monotonic()))  # (after "over")
        if refused_attach(part, d, clients):
            return
        part.check("both clients attach and allocate", all(c.event("mem").get("rc") == 0 for c in clients),
                   [c.events[:3] for c in clients])
        for c, (name, limit, pct, mem) in zip(clients, specs):
            over, most = c.event("over"), c.event("most")
            part.results[f"client_{name}"] = {"limit": limit, "pinned": mps.pinned_limit(limit), "thread_pct": pct,
                                              "init": c.event("init"), "over": over, "most": most}
            part.check(f"client {name}: its pinned limit refuses {mps.mps_size(mem + limit)} (budget "
                       f"{mps.mps_size(limit)})", over.get("refused") is True, over)
            # what MPS keeps of the limit for the client itself is within colo's allowance (4 MiB: the
            # bisection's step and the driver's 2 MiB granularity)
            part.check(f"client {name}: it can allocate its whole budget ({mps.mps_size(limit)}) under MPS",
                       mem + (most.get("bytes") or 0) + 4 * MiB >= limit, {"init": c.event("init"), "most": most})
        time.sleep(1.5)  # into the clients' busy loops, so NVML has utilisation samples of them
        servers = d.server_list()
        listed = {s: d.client_list(s) for s in servers}
        pids = {c.p.pid for c in clients}
        part.put("servers", listed)
        part.check("get_server_list names a server whose clients are our two",
                   any(pids <= set(v) for v in listed.values()), {"servers": listed, "clients": sorted(pids)})
        roles = {**{p: "client" for p in pids}, **{s: "server" for s in servers}, d.pid: "control daemon"}
        view = nvml_view(part.ctx, roles)
        part.put("nvml", view)
        seen = {x["pid"] for k in ("compute", "mps") if isinstance(view[k], list) for x in view[k]}
        part.check("NVML lists the MPS clients (in its compute or MPS process list)", pids <= seen, view)
        for c in clients:
            c.wait_event("hold", min(30.0, part.left()))
            c.send()
        ends = [c.finish(30) for c in clients]
        part.check("both clients compute after holding and end cleanly", all(e["rc"] == 0 for e in ends),
                   [(e["rc"], e["stderr"][-200:]) for e in ends])
        clients.clear()
        second_user(part, m, d)
    finally:
        for c in clients:
            c.send()
            c.finish(3)
        m.stop_all()


def nvml_view(ctx: dict, roles: dict[int, str]) -> dict:
    """NVML's own answers per process (not colo's reading of them): the compute and MPS process
    lists with each process's memory, and per-process utilisation; each pid named by its role."""
    import pynvml  # noqa: TID251 - this check records NVML's raw answers, beside colo's view of them

    nvml(ctx).init()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    out: dict = {}
    for key, fn in (("compute", pynvml.nvmlDeviceGetComputeRunningProcesses),
                    ("mps", pynvml.nvmlDeviceGetMPSComputeRunningProcesses)):
        try:
            out[key] = [{"pid": p.pid, "used": p.usedGpuMemory, "role": roles.get(p.pid, "other")} for p in fn(h)]
        except pynvml.NVMLError as e:
            out[key] = f"error: {e}"
    try:
        out["utilization"] = [{"pid": s.pid, "sm": s.smUtil, "mem": s.memUtil, "role": roles.get(s.pid, "other")}
                              for s in pynvml.nvmlDeviceGetProcessUtilization(h, 0)]
    except pynvml.NVMLError as e:
        out["utilization"] = f"error: {e}"
    return out


def second_user(part: Part, m, d) -> None:
    """docs/mps.md "Who may reach the daemon": a user colo allows on the pipe folder (search only)
    becomes an MPS client; a user it does not allow cannot reach the control socket, nor the allowed
    one once colo revokes it. Real Unix users, created here."""
    import socket

    import checkout
    checkout.use_harness()
    from harness.daemon import as_user
    from harness.users import ensure_users

    if os.geteuid() != 0:
        part.skip("a second Unix user: needs root to create one")
        return
    try:
        alice, mallory = ensure_users(2, prefix="cologc")
    except (subprocess.CalledProcessError, OSError) as e:
        part.skip(f"a second Unix user: useradd failed: {e}")
        return
    uuid = d.uuid
    m.allow(uuid, 0, {alice.pw_uid})
    d = m.ensure(uuid, 0)
    from colo.node import native

    pub = native.publish(part.tmp)  # colo-burn (and the simulated driver) where every user can read them
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": uuid, **d.client_env(GiB, None)}
    if part.simulated:
        env.update(COLO_FAKEGPU_STATE=part.ctx["fake_state"], LD_LIBRARY_PATH=str(pub / native.FAKEGPU_DIR))
    burn = subprocess.Popen([str(pub / native.BURN), "--mem", "64MiB", "--seconds", "6", "--quiet"], env=env,
                            cwd=str(part.tmp), user=alice.pw_uid, group=alice.pw_gid, extra_groups=[],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    listed: dict = {}
    t_end = time.monotonic() + min(30.0, part.left())
    while burn.poll() is None and time.monotonic() < t_end:
        try:
            listed = {s: d.client_list(s) for s in d.server_list()}
        except Exception as e:  # noqa: BLE001 - recorded
            listed = {"error": str(e)}
        if any(burn.pid in v for v in listed.values() if isinstance(v, list)):
            break
        time.sleep(0.2)
    try:
        text, _ = burn.communicate(timeout=max(1.0, t_end - time.monotonic() + 10))
    except subprocess.TimeoutExpired:
        burn.kill()
        text, _ = burn.communicate()
    try:
        log = (d.log_dir / "control.log").read_text(errors="replace")
    except OSError:
        log = ""
    part.put("second_user", {"uid": alice.pw_uid, "pid": burn.pid, "servers": listed, "rc": burn.returncode,
                             "output": text[-400:], "control_log_mentions_uid": f"user {alice.pw_uid}" in log,
                             "control_log_tail": log[-600:]})
    part.check(f"a second Unix user (uid {alice.pw_uid}) colo allows on the pipe folder becomes an MPS client",
               burn.returncode == 0 and any(burn.pid in v for v in listed.values() if isinstance(v, list)),
               part.results["second_user"])

    control = str(d.pipe_dir / "control")

    def reach(pw) -> tuple:  # ("ok", 0) when pw connects to the control socket, else ("ok", errno)
        return as_user(pw, lambda: socket.socket(socket.AF_UNIX).connect_ex(control))

    got = reach(mallory)
    part.check(f"a user colo does not allow (uid {mallory.pw_uid}) cannot reach the control socket",
               got == ("ok", errno.EACCES), got)
    m.keep_only(uuid, set())
    got = reach(alice)
    part.check("once colo revokes the allowed user, it cannot reach the control socket either",
               got == ("ok", errno.EACCES), got)


def part_mps_faults(part: Part) -> None:
    """terminate_client for one client, then a kernel that faults in another: what colo and the
    neighbours see. Last: a fault may leave the GPU's MPS server unusable for a while."""
    from colo.node import mps

    if not part.ctx.get("mps_ok"):
        part.skip_part(f"MPS is not used here: {part.ctx.get('mps_why')}")
        return
    m = mps_manager(part)
    if m is None:
        return
    try:
        d = start_daemon(part, m)
        if d is None:
            return
        env = {**part.env, **d.client_env(1 * GiB, None)}
        a, b = (Proc([sys.executable, str(PROBE), "--mem", str(64 * MiB), "--hold", "--after"], env) for _ in "ab")
        attach_by = time.monotonic() + min(30.0, part.left(12))
        for c in (a, b):
            c.wait_event("hold", max(0.1, attach_by - time.monotonic()))
        listed = {s: d.client_list(s) for s in d.server_list()}
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
        part.put("after_terminate", {"A": ra["events"].get("after"), "A_rc": ra["rc"],
                                     "B": rb["events"].get("after"), "B_rc": rb["rc"], "servers": listed})
        part.check("terminate_client ends A's use of the GPU (810 or A gone)",
                   (ra["events"].get("after") or {}).get("rc") not in (0, None) or ra["rc"] != 0,
                   part.results["after_terminate"])
        part.check("B goes on after A was terminated", rb["rc"] == 0, rb["stderr"][-300:])
        fault(part, m, d)
    finally:
        m.stop_all()


def fault(part: Part, m, d) -> None:
    env = {**part.env, **d.client_env(1 * GiB, None)}
    victim = Proc([sys.executable, str(PROBE), "--mem", str(64 * MiB), "--hold", "--after"], env)
    culprit = Proc([sys.executable, str(PROBE), "--mem", str(64 * MiB), "--hold"]
                   + ([] if part.simulated else ["--fault"]), env)
    attach_by = time.monotonic() + min(30.0, part.left(12))
    ok = all(p.wait_event("hold", max(0.1, attach_by - time.monotonic())) for p in (victim, culprit))
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
    part.put("fault", {"culprit": rc["events"].get("fault"), "culprit_rc": rc["rc"],
                       "victim_after": rv["events"].get("after"), "victim_rc": rv["rc"],
                       "colo_faults": dict(seen.faults), "colo_events": [msg for _, msg in seen.events],
                       "health_after": d.health()})
    if not part.simulated:
        part.check("the faulting kernel gave CUDA_ERROR_ILLEGAL_ADDRESS",
                   (rc["events"].get("fault") or {}).get("illegal_address") is True, rc["events"].get("fault"))
    part.check("colo's MPS check reports the fault",
               bool(seen.faults) or any("fault" in msg.lower() for _, msg in seen.events), part.results["fault"])


# --- co-location: real jobs, one after another, all at once, under colo -------------------------

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
MEDIUM_TORCH = """
import torch
a = torch.randn(2048, 2048, device="cuda")
for _ in range(int(sys.argv[1])):
    b = a @ a
    torch.cuda.synchronize()  # a kernel, then the host: busy part of the time, as a medium job
say(event="done", rc=0)
"""
STREAM_TORCH = """
import torch
a = torch.ones(128 << 20, device="cuda")  # 512 MiB: every pass streams through memory, far past L2
for _ in range(int(sys.argv[1])):
    a.mul_(1.0000001)
torch.cuda.synchronize()
say(event="done", rc=0)
"""
HOLD_TORCH = """
import torch
held = torch.empty(int(sys.argv[2]), dtype=torch.uint8, device="cuda")  # out of memory: exit 1, a lost job
""" + LIGHT_TORCH
SCRIPTS = {"light": LIGHT_TORCH, "medium": MEDIUM_TORCH, "heavy": HEAVY_TORCH, "stream": STREAM_TORCH,
           "hold": HOLD_TORCH}
SIM_WORK = {"light": 50, "medium": 100, "heavy": 200, "stream": 200}  # memset passes on the simulated driver
SEEDED = "gpucheck-light"  # the profile the seeded run's jobs name
ENDED = ("succeeded", "failed", "cancelled", "lost")


def job_argv(part: Part, kind: str, steps: int | None = None, hold: int = 0) -> list[str]:
    """A fixed amount of work on a real GPU: light (a small training loop), medium (synchronised
    2048² matmuls), heavy (4096² matmuls), stream (a 512 MiB tensor scaled in place: bound by
    memory bandwidth, not compute), hold (a light loop holding `hold` bytes); `steps` of it (part
    colocation's counts if None). On the simulated driver, synchronised memsets (they take no time
    there); a hold job keeps its bytes for a second there, so that jobs started at once meet."""
    if part.simulated or importlib.util.find_spec("torch") is None:
        return [sys.executable, str(PROBE), "--mem", str(hold or 64 * MiB),
                *(["--busy", "1"] if kind == "hold" else ["--work", str(SIM_WORK[kind])])]
    script = part.tmp / f"{kind}.py"
    script.write_text(PRELUDE.replace('B = int(os.environ["COLO_GPU_BUDGET"])', "") + textwrap.dedent(SCRIPTS[kind]))
    os.chmod(script, 0o644)
    if steps is None:
        steps = part.ctx["heavy_iters"] if kind == "heavy" else part.ctx["light_steps"]
    return [sys.executable, str(script), str(steps), *([str(hold)] if kind == "hold" else [])]


def run_one(argv: list[str], env: dict, timeout: float) -> int:
    """A job's exit code; -9 when it ran past `timeout` and was killed."""
    try:
        return subprocess.run(argv, env=env, capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return -9


def run_together(argvs: list[list[str]], envs: list[dict], timeout: float) -> tuple[float, list[int], list[str]]:
    t0 = time.perf_counter()
    ps = [subprocess.Popen(a, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
          for a, e in zip(argvs, envs)]
    errs = []
    for p in ps:
        try:
            _, err = p.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        errs.append(err[-300:])
    return time.perf_counter() - t0, [p.returncode for p in ps], errs


class Sampler:
    """GPU 0 as NVML sees it every 0.25 s (SM %, bandwidth %, the processes' memory): what the jobs do
    when each runs alone, to seed their profile from."""

    def __init__(self, ctx: dict):
        self.n = nvml(ctx)
        self.samples: list[tuple[float, float, float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                d = self.n.devices()[0]
                used = max([p.used or 0 for p in d.processes] or [0])
                self.samples.append((time.monotonic(), (d.sm_util or 0) / 100, (d.mem_util or 0) / 100, used))
            except Exception:  # noqa: BLE001 - a missed sample
                pass
            self.stop.wait(0.25)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


def seed_profile(part: Part, samples: list, spans: list[tuple[float, float]], where: Path) -> dict:
    """The light jobs' profile from a run alone (the second, past cold caches), written as `colo demo`
    writes its profiles: as if learned from 3 runs."""
    from colo import profiles

    t0, t1 = spans[1] if len(spans) > 1 else spans[0]
    mine = [s for s in samples if t0 <= s[0] <= t1] or [(t0, 0.0, 0.0, 0)]
    p = profiles.from_samples(SEEDED, {"times": [s[0] - t0 for s in mine], "sm": [s[1] for s in mine],
                                       "membw": [s[2] for s in mine], "mem": [s[3] for s in mine]},
                              runtime=max(t1 - t0, 1e-3))
    p.runs = 3
    where.mkdir(parents=True, exist_ok=True)
    profiles.save(p, where / f"{SEEDED}.profile")
    return {"samples": len(mine), "runtime_s": round(p.runtime, 2), "peak_sm": round(float(p.peak_sm), 3),
            "mean_sm": round(float(p.sm.mean()), 3), "mean_membw": round(float(p.membw.mean()), 3),
            "peak_mem": int(p.peak_mem), "cache_bound": p.cache_bound}


def colo_run(part: Part, label: str, argv: list[str], n: int, use_mps: bool, profile_dir: Path | None = None,
             then=None, jobs: list[dict] | None = None) -> dict:
    """n jobs submitted at once to a fresh colo daemon (the real scheduling defaults; profile_dir:
    a profile of the jobs it may place them from), or `jobs` (each job's argv, gpu_mem and name);
    their wall time, and how colo ran each. then(d, out): more on the same daemon, before it stops."""
    import checkout
    checkout.use_harness()
    from harness.daemon import DaemonProc

    from colo import profiles

    root = part.tmp / label
    root.mkdir(mode=0o755)
    cfg = {"sample_interval": 0.5, "reserve": "256MiB", "unprofiled_share": False, "use_mps": use_mps,
           "mps_idle_stop": 600.0}
    if profile_dir:
        cfg["profile_dirs"] = [str(profile_dir)]
    d = DaemonProc(root, Path(part.ctx["fake_state"]) if part.simulated else None, cfg)
    out: dict = {"jobs": len(jobs) if jobs else n}
    try:
        d.start()
        os.chmod(d.socket.parent, 0o755)
        jobs = jobs or [{"argv": argv, "gpu_mem": 1 * GiB, "name": f"{label}{i}",
                         **({"profile": SEEDED} if profile_dir else {})} for i in range(n)]
        out.update(run_queue(part, d, jobs, label))
        learned = root / "state" / "profiles" / "users" / str(os.getuid()) / f"{profiles.key_for(None, argv)}.profile"
        if learned.exists():
            p = profiles.load(learned)
            out["learned"] = {"runs": p.runs, "runtime_s": round(p.runtime, 2), "peak_sm": round(float(p.peak_sm), 3)}
        if then:
            then(d, out)
    except Exception as e:  # noqa: BLE001 - a wait's timeout, a refused submit: what each job was doing then
        out["error"] = f"{type(e).__name__}: {e}"
        try:
            out.setdefault("rows", [{k: j.get(k) for k in ("id", "name", "state", "mode", "reason")}
                                    for j in d.client.ls(all=True)])
        except Exception as e2:  # noqa: BLE001 - the daemon is gone too
            out["error"] += f"; and the daemon does not answer: {e2}"
    finally:
        try:
            d.stop()
        except Exception as e:  # noqa: BLE001
            out["daemon_stop"] = str(e)
        end_mps(part, root / "state" / "mps")
        out["daemon_log_tail"] = d.log.read_text(errors="replace")[-TAIL:] if d.log.exists() else ""
    return out


def run_queue(part: Part, d, jobs: list[dict], label: str) -> dict:
    """`jobs` submitted at once to daemon d, waited on until every one ended: the wall time, each
    job's row, and how many colo ran in each mode."""
    from harness.daemon import wait_for

    t0 = time.perf_counter()
    ids = [d.client.submit({"gpus": 1, "workdir": str(part.tmp), **j})["id"] for j in jobs]
    rows = wait_for(lambda: (js := [d.client.show(i) for i in ids]) and all(j["state"] in ENDED for j in js)
                    and js, part.left(15), f"the {label} jobs")
    return {"wall_s": time.perf_counter() - t0,
            "rows": [{k: j.get(k) for k in ("id", "name", "state", "mode", "exit_code", "reason", "started_at",
                                            "ended_at")} for j in rows],
            "modes": {m: sum(1 for j in rows if j.get("mode") == m) for m in {j.get("mode") for j in rows}}}


def end_mps(part: Part, root: Path) -> None:
    """colo leaves an MPS control daemon with clients up when it stops (to adopt it at a restart):
    the check's daemons end with their run."""
    from colo.node import mps

    if not root.is_dir():
        return
    ctl = shutil.which("nvidia-cuda-mps-control", path=part.env.get("PATH"))
    if ctl is None:
        return
    m = mps.MpsManager(root, ctl, env=part.env)
    try:
        uuid = gpu0(part.ctx)["uuid"]
        if m.adopt(uuid, 0):
            m.stop_all()
    except Exception:  # noqa: BLE001 - the runner ends whatever is left
        pass


# kind, group sizes, steps of one job (from the check's context): light jobs at half part
# colocation's steps, medium ones 3,000 synchronised 2048² matmuls; the two heavy pairs, one bound
# by compute (4096² matmuls, half part colocation's) and one by memory bandwidth (a 512 MiB stream)
GROUPS = (("light", (2, 4, 8, 16), lambda c: c["light_steps"] // 2), ("medium", (2, 4), lambda c: 3000),
          ("heavy", (2,), lambda c: c["heavy_iters"] // 2), ("stream", (2,), lambda c: 6000))


def part_groups(part: Part) -> None:
    """What the h200 truth's fit needs (bench/fit_truth.py reads results["groups"]): n like jobs at
    once, time-sliced and under MPS (where part mps passed), against one of them alone times n
    (GROUPS). Each group is recorded as it ends: a cut part keeps them."""
    from colo.node import mps

    null = mps.timesliced_env(part.tmp / "ts")
    m = md = None
    if part.ctx.get("mps_ok"):
        m = mps.MpsManager(part.tmp / "mps", shutil.which("nvidia-cuda-mps-control", path=part.env.get("PATH")),
                           env=part.env)
    groups: list = part.results.setdefault("groups", [])
    try:
        if m is not None:
            md = m.ensure(gpu0(part.ctx)["uuid"], 0)
        for kind, sizes, steps in GROUPS:
            argv = job_argv(part, kind, steps(part.ctx))
            sampler = Sampler(part.ctx)
            t0 = time.monotonic()
            rc = run_one(argv, part.env, part.left())
            alone = time.monotonic() - t0
            sampler.close()
            seen = [x for x in sampler.samples if t0 <= x[0] <= t0 + alone] or [(t0, 0.0, 0.0, 0)]
            sm, bw = (round(sum(x[i] for x in seen) / len(seen), 4) for i in (1, 2))
            part.check(f"one {kind} job alone: succeeds", rc == 0, rc)
            modes = [("timesliced", {**part.env, **null})] + ([("mps", {**part.env, **md.client_env(2 * GiB, None)})]
                                                               if md is not None else [])
            for n in sizes:
                for mode, env in modes:
                    if part.left() < alone * 1.5 + 3:
                        part.put("cut", f"no time left for {n} {kind} {mode}")
                        return
                    sampler, t1 = Sampler(part.ctx), time.monotonic()
                    wall, rcs, errs = run_together([argv] * n, [env] * n, part.left())
                    sampler.close()
                    both = [x for x in sampler.samples if t1 <= x[0] <= t1 + wall] or [(t1, 0.0, 0.0, 0)]
                    # the device's SM activity while together: colo's live watch reads it as the sum of
                    # each job's SM alone times its rate (sm x throughput here); a GPU whose slowed
                    # kernels still count as busy would read higher, and the watch would not see it
                    groups.append({"kind": kind, "n": n, "mode": mode, "serial_s": round(alone * n, 3),
                                   "together_s": round(wall, 3), "alone_s": round(alone, 3),
                                   "mean_sm": sm, "mean_membw": bw, "throughput": round(alone * n / wall, 3),
                                   "together_sm": round(sum(x[1] for x in both) / len(both), 4),
                                   "together_membw": round(sum(x[2] for x in both) / len(both), 4)})
                    part.check(f"{n} {kind} jobs at once, {mode}: all succeed", rcs == [0] * n, [rcs, errs[:1]])
    finally:
        if m is not None:
            m.stop_all()


def part_colocation(part: Part) -> None:
    """The co-location gain with real PyTorch jobs, against the two ways to run them without colo."""
    from colo.node import mps, native

    n = part.ctx["light_jobs"]
    light, heavy = job_argv(part, "light"), job_argv(part, "heavy")
    use_mps = bool(part.ctx.get("mps_ok"))
    part.put("setup", {"light": light, "heavy": heavy, "jobs": n,
                       "mps": "colo may run jobs under MPS" if use_mps else f"MPS not used: {part.ctx.get('mps_why')}"})
    # 1. one after another, no colo; NVML sampled, to seed the profile from
    sampler = Sampler(part.ctx)
    spans, rcs = [], []
    for _ in range(n):
        t0 = time.monotonic()
        rcs.append(run_one(light, part.env, part.left()))
        spans.append((t0, time.monotonic()))
    sampler.close()
    excl = spans[-1][1] - spans[0][0]
    part.results["exclusive"] = {"wall_s": excl, "per_job_s": [round(b - a, 2) for a, b in spans]}
    part.check(f"{n} light jobs one after another: all succeed", rcs == [0] * n, rcs)
    # 2. all at once, time-sliced, no colo
    null = mps.timesliced_env(part.tmp / "ts")
    ts, rcs, errs = run_together([light] * n, [{**part.env, **null}] * n, part.left())
    part.results["timesliced"] = {"wall_s": ts}
    part.check(f"{n} light jobs all at once, time-sliced: all succeed", rcs == [0] * n, [rcs, errs[:1]])
    # 3. colo seeded with the jobs' profile first, as `colo demo` does; a job over its budget after
    # them. Before the cold run: the part's budget may cut what comes last
    part.results["seeded_profile"] = seed_profile(part, sampler.samples, spans, part.tmp / "profiles")
    burn = str(native.path(native.BURN))

    def over_budget(d, out: dict) -> None:
        spec = {"gpus": 1, "workdir": str(part.tmp)}
        nb = d.client.submit({**spec, "gpu_mem": 512 * MiB, "name": "burn",
                              "argv": [burn, "--mem", "128MiB", "--duty", "50", "--seconds", "3"]})["id"]
        nl = d.client.submit({**spec, "gpu_mem": 1 * GiB, "name": "loop", "argv": light, "profile": SEEDED})["id"]
        bad = d.client.submit({**spec, "gpu_mem": 512 * MiB, "name": "over-budget",
                               "argv": [burn, "--mem", "1GiB", "--seconds", "1"]})["id"]
        ends = {i: d.wait_state(i, *ENDED, timeout=part.left(10)) for i in (nb, nl, bad)}
        out["budget_jobs"] = {ends[i]["name"]: {k: ends[i].get(k) for k in ("state", "exit_code", "reason", "mode")}
                              for i in ends}
        part.results["budget_jobs"] = out["budget_jobs"]
        part.check("colo-burn and the loop succeed beside a job over its budget",
                   ends[nb]["state"] == "succeeded" and ends[nl]["state"] == "succeeded", out["budget_jobs"])
        part.check("the job over its budget fails alone (colo-burn exit 3: allocation refused)",
                   ends[bad]["state"] == "failed" and ends[bad].get("exit_code") == 3, out["budget_jobs"])

    def seeded_done(d, out: dict) -> None:
        part.results["colo_seeded"] = {k: v for k, v in out.items() if k != "daemon_log_tail"}
        part.check(f"{n} light jobs under colo, seeded: all succeed",
                   all(j["state"] == "succeeded" for j in out.get("rows", [])), out.get("rows"))
        part.put("light", gains(n, excl, ts, {"colo_seeded": out}))
        over_budget(d, out)

    seeded = colo_run(part, "seeded", light, n, use_mps, part.tmp / "profiles", then=seeded_done)
    part.results["colo_seeded"] = seeded
    if "wall_s" not in seeded:
        part.check(f"{n} light jobs under colo, seeded: all succeed", False, seeded.get("error"))
    part.flush()
    # 4. colo, knowing nothing of the jobs (it runs jobs it has no profile of alone, and learns)
    cold = colo_run(part, "cold", light, n, use_mps)
    part.results["colo_cold"] = cold
    part.check(f"{n} light jobs under colo, cold: all succeed",
               all(j["state"] == "succeeded" for j in cold.get("rows", [])) and "wall_s" in cold,
               cold.get("error") or cold.get("rows"))
    part.put("light", gains(n, excl, ts, {"colo_seeded": seeded, "colo_cold": cold}))
    # 5. a saturating pair: one after the other, time-sliced, and under MPS where MPS works here
    t0 = time.perf_counter()
    rcs = [run_one(heavy, part.env, part.left()) for _ in range(2)]
    pair_excl = time.perf_counter() - t0
    pair_ts, rts, _ = run_together([heavy] * 2, [{**part.env, **null}] * 2, part.left())
    pair_mps, rmps = None, None
    if use_mps:
        m = mps.MpsManager(part.tmp / "mps", shutil.which("nvidia-cuda-mps-control", path=part.env.get("PATH")),
                           env=part.env)
        try:
            md = m.ensure(gpu0(part.ctx)["uuid"], 0)
            pair_mps, rmps, _ = run_together([heavy] * 2, [{**part.env, **md.client_env(4 * GiB, None)}] * 2,
                                             part.left())
        finally:
            m.stop_all()
    part.results["pair"] = {"exclusive_s": pair_excl, "timesliced_s": pair_ts, "mps_s": pair_mps,
                            "mps_vs_timesliced": (pair_ts / pair_mps) if pair_mps else None}
    part.check("saturating pair: every run succeeds", rcs == [0, 0] and rts == [0, 0] and rmps in (None, [0, 0]),
               {"exclusive": rcs, "timesliced": rts, "mps": rmps})


def gains(n: int, excl: float, ts: float, runs: dict[str, dict]) -> dict:
    """Throughput of each way against one after another (its wall time over theirs)."""
    out = {"jobs": n, "exclusive_s": excl, "timesliced_s": ts, "timesliced_vs_exclusive": excl / ts}
    for k, r in runs.items():
        if r.get("wall_s"):
            out[f"{k}_s"] = r["wall_s"]
            out[f"{k}_vs_exclusive"] = excl / r["wall_s"]
            out[f"{k}_modes"] = r.get("modes")
    return out


# --- interposer cost ----------------------------------------------------------------------------

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
                                   text=True, timeout=part.left())
                if r.returncode == 0:
                    out.append(float(r.stdout))
                else:
                    errors.append(f"{'interposed' if env is inter_env else 'native'}: exit {r.returncode}: "
                                  f"{r.stderr.strip()[-300:]}")
        if direct and inter:
            dm, im = statistics.median(direct), statistics.median(inter)
            rows.append({"threads": threads, "pairs": pairs, "bytes": size, "native_ns": dm, "interposed_ns": im,
                         "added_ns": im - dm, "ratio": im / dm})
            part.results["pairs"] = rows
        part.check(f"{repeat}x {pairs} alloc/free pairs per thread, {threads} thread(s), native and interposed, "
                   "every call succeeded", not errors, errors[:2])
    led = interposer.read_ledger(ledger)
    part.check("the ledger is back to 0 after the cost runs, nothing refused",
               led.total_used == 0 and led.refused == 0, f"used {led.total_used}, refused {led.refused}")
    if part.simulated:
        part.skip("PyTorch allocator churn: needs a real driver")
        return
    if importlib.util.find_spec("torch") is None:
        part.skip("PyTorch allocator churn: torch is not installed")
        return
    churn = []
    for caching in ("1", "0"):  # caching allocator on (default) / off (every tensor reaches the driver)
        times: dict[str, float] = {}
        for kind, env in (("native", {**part.env, "COLO_GPU_BUDGET": str(budget)}),
                          ("interposed", budget_env(part, budget, f"churn{caching}")[0])):
            if caching == "0":
                env = {**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
            p = Proc([sys.executable, "-c", PRELUDE + textwrap.dedent(CHURN)], env)
            out = p.finish(part.left())
            ev = out["events"].get("churn")
            if part.check(f"PyTorch churn, caching {'on' if caching == '1' else 'off'}, {kind}",
                          out["rc"] == 0 and ev is not None, out["stderr"][-300:]):
                times[kind] = ev["seconds"]
        if len(times) == 2:
            churn.append({"caching": caching == "1", "native_s": times["native"],
                          "interposed_s": times["interposed"], "ratio": times["interposed"] / times["native"]})
            part.put("churn", churn)
