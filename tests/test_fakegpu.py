"""The simulated NVIDIA driver (native/fakegpu) and colo-burn, driven by real processes: a C
caller (tests/native_helpers/cudacall.c), ctypes, the real pynvml module, the fake MPS daemon."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from colo.node import fakegpu as fg
from colo.node import native
from harness.daemon import wait_for

GiB = 1024**3
HELPER_SRC = Path(__file__).parent / "native_helpers" / "cudacall.c"
NOBODY = 65534


@pytest.fixture(scope="session")
def public_dir():
    """A directory every uid can traverse (pytest's tmp dirs are 0700), for setuid tests."""
    d = Path(tempfile.mkdtemp(prefix="colo-fakegpu-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def caller_bin(public_dir):
    out = public_dir / "cudacall"
    subprocess.run(["cc", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-o", str(out), str(HELPER_SRC),
                    "-ldl", "-lpthread"], check=True, timeout=120)
    return out


class Caller:
    """One cudacall process: send a command line, get its one-line answer."""

    def __init__(self, binary, env, user=None, argv_prefix=()):
        def drop():
            os.setgid(user)
            os.setuid(user)

        self.p = subprocess.Popen([*argv_prefix, str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env, preexec_fn=drop if user is not None else None)
        self.pid = self.p.pid

    def send(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def recv(self):
        out = self.p.stdout.readline().strip()
        assert out, f"cudacall exited (rc={self.p.poll()})"
        return out

    def __call__(self, line):
        self.send(line)
        return self.recv()

    def close(self):
        if self.p.poll() is None:
            try:
                self.send("exit")
            except BrokenPipeError:
                pass
            self.p.wait(timeout=10)

    def kill(self):
        self.p.kill()
        self.p.wait(timeout=10)


@pytest.fixture
def callers(caller_bin):
    made = []

    def make(env, user=None, argv_prefix=()):
        c = Caller(caller_bin, env, user, argv_prefix)
        made.append(c)
        return c

    yield make
    for c in made:
        if c.p.poll() is None:
            c.kill()


def base_env(node, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "COLO_FAKEGPU"))}
    env.update(node.env)
    env["CUDA_MPS_PIPE_DIRECTORY"] = "/nonexistent/colo-test-no-mps"  # never the host's default
    env.update({k: str(v) for k, v in extra.items()})
    return env


def ready(c, dev=0):
    assert c("init") == "ok"
    assert c(f"ctx {dev}") == "ok"
    return c


def procs(node, dev=0):
    return {p["pid"]: p for p in node.read()["devices"][dev]["processes"]}


NVML_SCRIPT = textwrap.dedent("""
    import json, pynvml as n
    n.nvmlInit()
    out = {"count": n.nvmlDeviceGetCount(), "driver": n.nvmlSystemGetDriverVersion(), "devices": []}
    for i in range(out["count"]):
        h = n.nvmlDeviceGetHandleByIndex(i)
        m = n.nvmlDeviceGetMemoryInfo(h)
        m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
        u = n.nvmlDeviceGetUtilizationRates(h)
        try:
            samples = {s.pid: s.smUtil for s in n.nvmlDeviceGetProcessUtilization(h, 0)}
        except n.NVMLError_NotFound:
            samples = {}
        uuid = n.nvmlDeviceGetUUID(h)
        out["devices"].append({
            "name": n.nvmlDeviceGetName(h), "uuid": uuid,
            "by_uuid": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(uuid)),
            "total": m.total, "used": m.used, "free": m.free, "used2": m2.used,
            "cc": list(n.nvmlDeviceGetCudaComputeCapability(h)), "mig": n.nvmlDeviceGetMigMode(h),
            "mode": n.nvmlDeviceGetComputeMode(h), "gpu": u.gpu, "mem": u.memory, "samples": samples,
            "procs": {p.pid: p.usedGpuMemory for p in n.nvmlDeviceGetComputeRunningProcesses(h)},
            "mps": {p.pid: p.usedGpuMemory for p in n.nvmlDeviceGetMPSComputeRunningProcesses(h)},
        })
    try:
        n.nvmlDeviceGetBAR1MemoryInfo(n.nvmlDeviceGetHandleByIndex(0))
    except n.NVMLError_FunctionNotFound:
        out["missing_is_function_not_found"] = True
    n.nvmlShutdown()
    print(json.dumps(out))
""")


def nvml(node, env=None):
    """What the real pynvml reports in a fresh process pointed at node."""
    r = subprocess.run([sys.executable, "-c", NVML_SCRIPT], capture_output=True, text=True, timeout=30,
                       env=env or base_env(node))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for d in out["devices"]:
        d["procs"] = {int(k): v for k, v in d["procs"].items()}
        d["mps"] = {int(k): v for k, v in d["mps"].items()}
        d["samples"] = {int(k): v for k, v in d["samples"].items()}
    return out


# ---- build ---------------------------------------------------------------------------------------

def test_build_outputs_and_linkage(native_dir):
    for rel in ("fakegpu/libcuda.so.1", "fakegpu/libnvidia-ml.so.1", "fakegpu/nvidia-cuda-mps-control",
                "colo-fakegpu", "colo-burn"):
        assert (native_dir / rel).exists(), rel
    for lib, soname in (("libcuda.so.1", "libcuda.so.1"), ("libnvidia-ml.so.1", "libnvidia-ml.so.1")):
        dyn = subprocess.run(["readelf", "-d", str(native_dir / "fakegpu" / lib)], capture_output=True,
                             text=True, check=True).stdout
        assert f"Library soname: [{soname}]" in dyn
        assert "SYMBOLIC" in dyn  # internal calls never reach an interposer
    syms = subprocess.run(["nm", "-D", "--defined-only", str(native_dir / "fakegpu/libcuda.so.1")],
                          capture_output=True, text=True, check=True).stdout.split()
    assert "fakegpuSetActivity" in syms and "cuMemAlloc_v2" in syms
    assert not [s for s in syms if s.startswith("fg_")]  # internals stay hidden


# ---- memory ----------------------------------------------------------------------------------------

def test_c_caller_fills_device_until_oom_and_nvml_sees_it(fakegpu, callers):
    c = ready(callers(base_env(fakegpu)))
    assert c("fill 1073741824") == "n 16 err 2"  # 16 GiB device, 1 GiB chunks: then OUT_OF_MEMORY
    assert c("info") == f"ok 0 {16 * GiB}"
    dev = fakegpu.read()["devices"][0]
    assert dev["used"] == 16 * GiB and dev["free"] == 0
    assert procs(fakegpu)[c.pid]["used"] == 16 * GiB
    assert c("freeall") == "ok"
    assert fakegpu.read()["devices"][0]["used"] == 0


CTYPES_SCRIPT = textwrap.dedent("""
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 1) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    ptrs, p = [], ctypes.c_ulonglong()
    while True:
        r = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(3 << 30))
        if r:
            break
        ptrs.append(p.value)
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    name = ctypes.c_char_p()
    cu.cuGetErrorName(r, ctypes.byref(name))
    print(len(ptrs), r, name.value.decode(), free.value, total.value)
""")


def test_ctypes_caller_gets_oom_on_a_full_device(fakegpu):
    r = subprocess.run([sys.executable, "-c", CTYPES_SCRIPT], capture_output=True, text=True, timeout=30,
                       env=base_env(fakegpu))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["5", "2", "CUDA_ERROR_OUT_OF_MEMORY", str(1 * GiB), str(16 * GiB)]
    assert fakegpu.read()["devices"][1]["used"] == 0  # returned when the process exited


def test_two_processes_see_each_other_through_pynvml(fakegpu, callers):
    a = ready(callers(base_env(fakegpu)))
    b = ready(callers(base_env(fakegpu, CUDA_VISIBLE_DEVICES="1,0")), dev=1)  # ordinal 1 = device 0
    assert a("alloc 3221225472").startswith("ok")
    assert b("alloc 5368709120").startswith("ok")
    out = nvml(fakegpu)
    assert out["count"] == 2 and out["driver"] == "550.54.15"
    assert out.get("missing_is_function_not_found")
    d0, d1 = out["devices"]
    assert d0["name"] == "Colo Simulated GPU" and [d0["uuid"], d1["uuid"]] == fakegpu.uuids()
    assert d1["by_uuid"] == 1 and d0["cc"] == [8, 0] and d0["mig"] == [0, 0]
    assert (d0["total"], d0["used"], d0["free"], d0["used2"]) == (16 * GiB, 8 * GiB, 8 * GiB, 8 * GiB)
    assert d0["procs"] == {a.pid: 3 * GiB, b.pid: 5 * GiB}
    assert d0["mps"] == {} and d1["procs"] == {} and d1["used"] == 0
    # each process's own view counts the other's memory too
    assert a("info") == f"ok {8 * GiB} {16 * GiB}"


def test_sigkilled_process_memory_returns(fakegpu, callers):
    c = ready(callers(base_env(fakegpu)))
    assert c("alloc 4294967296").startswith("ok")
    assert fakegpu.read()["devices"][0]["used"] == 4 * GiB
    c.kill()
    dev = fakegpu.read()["devices"][0]
    assert dev["used"] == 0 and dev["processes"] == []
    # and a survivor can take the whole device again
    d = ready(callers(base_env(fakegpu)))
    assert d("fill 1073741824") == "n 16 err 2"


def test_cuda_visible_devices_by_index_and_uuid(fakegpu, callers):
    u1 = fakegpu.uuids()[1]
    for vis in ("1", u1, u1[:12]):
        c = ready(callers(base_env(fakegpu, CUDA_VISIBLE_DEVICES=vis)))
        assert c("alloc 1048576").startswith("ok")
        assert c.pid in procs(fakegpu, 1) and c.pid not in procs(fakegpu, 0)
        assert c("ctx 1") == "err 101"  # only one device is visible
        c.close()
    c = callers(base_env(fakegpu, CUDA_VISIBLE_DEVICES="7"))  # invalid entry: no device at all
    assert c("init") == "ok" and c("ctx 0") == "err 101"


def test_invalid_context_without_a_current_context(fakegpu, callers):
    c = callers(base_env(fakegpu))
    assert c("alloc 1024") == "err 3"  # before cuInit: CUDA_ERROR_NOT_INITIALIZED
    assert c("init") == "ok"
    assert c("alloc 1024") == "err 201"
    assert c("info") == "err 201"
    assert c("ctx 0") == "ok"
    ptr = int(c("alloc 4096").split()[1])
    assert c(f"memset {ptr} 4096") == "ok"
    assert c(f"memset {ptr} 4097") == "err 1"  # past the end of the allocation
    assert c("threadalloc 1024") == "err 201"  # a new thread has no current context
    assert c("pop") == "ok" and c("alloc 1024") == "err 201"


def test_get_proc_address_answers_by_version(fakegpu, callers):
    c = callers(base_env(fakegpu))

    def pa(name, ver):
        return c(f"procaddr {name} {ver}").split()

    def sym(name):
        return c(f"dlsym {name}").split()[1]

    cases = [("cuMemAlloc", 12000, "cuMemAlloc_v2"), ("cuMemAlloc", 3020, "cuMemAlloc_v2"),
             ("cuMemAlloc", 3010, "cuMemAlloc"), ("cuMemGetInfo", 11000, "cuMemGetInfo_v2"),
             ("cuMemFree", 12000, "cuMemFree_v2"), ("cuCtxCreate", 11040, "cuCtxCreate_v3"),
             ("cuCtxCreate", 12050, "cuCtxCreate_v4"), ("cuCtxCreate", 4000, "cuCtxCreate_v2"),
             ("cuDevicePrimaryCtxRelease", 11000, "cuDevicePrimaryCtxRelease_v2"),
             ("cuDevicePrimaryCtxRelease", 10020, "cuDevicePrimaryCtxRelease"),
             ("cuGetProcAddress", 12000, "cuGetProcAddress_v2"), ("cuMemCreate", 12000, "cuMemCreate"),
             ("cuDeviceTotalMem", 12000, "cuDeviceTotalMem_v2"), ("cuMemAllocAsync", 11020, "cuMemAllocAsync")]
    for name, ver, expect in cases:
        r = pa(name, ver)
        assert r[:2] == ["ok", "0"] and r[3] == "0", (name, ver, r)
        assert r[2] == sym(expect), (name, ver, expect)
    assert sym("cuMemAlloc") != sym("cuMemAlloc_v2")
    assert pa("cuMemAllocAsync", 11000) == ["err", "500", "(nil)", "2"]  # VERSION_NOT_SUFFICIENT
    assert pa("cuNoSuchThing", 12000) == ["err", "500", "(nil)", "1"]  # SYMBOL_NOT_FOUND


def test_concurrent_processes_keep_consistent_totals(fakegpu, callers):
    cs = [ready(callers(base_env(fakegpu))) for _ in range(4)]
    for i, c in enumerate(cs):
        c.send(f"stress 200000 {i + 1}")  # each may hold up to 32 GiB of the 16
    snapshots = 0
    while not all(select_ready(c) for c in cs):
        dev = fakegpu.read()["devices"][0]
        assert 0 <= dev["used"] <= dev["total"]
        assert sum(p["used"] for p in dev["processes"]) == dev["used"]
        snapshots += 1
    results = [c.recv().split() for c in cs]
    assert all(r[0] == "ok" and r[3] == "0" for r in results), results
    assert all(int(r[1]) > 0 and int(r[2]) > 0 for r in results)  # allocations and refusals
    assert snapshots > 0
    dev = fakegpu.read()["devices"][0]
    assert dev["used"] == 0 and all(p["used"] == 0 for p in dev["processes"])


def select_ready(c):
    r, _, _ = select.select([c.p.stdout], [], [], 0)
    return bool(r)


def test_pid_namespace_processes_are_reported_with_host_pids(fakegpu, callers):
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("cannot create a pid namespace here")
    c = ready(callers(base_env(fakegpu), argv_prefix=("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")))
    assert c("alloc 1073741824").startswith("ok")
    (child,) = procs(fakegpu)
    assert Path(f"/proc/{child}/comm").read_text().strip() == "cudacall"
    nspid = Path(f"/proc/{child}/status").read_text().split("NSpid:")[1].split("\n")[0].split()
    assert len(nspid) == 2 and nspid[0] == str(child) != nspid[1]  # it knows itself by another pid
    assert procs(fakegpu)[child]["used"] == GiB  # reported by its host pid
    assert nvml(fakegpu)["devices"][0]["procs"] == {child: GiB}
    os.kill(child, signal.SIGKILL)  # liveness is the slot lock, whatever the namespace
    assert wait_for(lambda: fakegpu.read()["devices"][0]["used"] == 0, what="namespaced memory freed")


# ---- utilisation and compute modes -------------------------------------------------------------------

def test_utilisation_time_sliced_contexts_share(fakegpu, callers):
    a = ready(callers(base_env(fakegpu, COLO_FAKEGPU_SM=60)))
    out = nvml(fakegpu)["devices"][0]
    assert (out["gpu"], out["samples"]) == (60, {a.pid: 60})
    b = ready(callers(base_env(fakegpu, COLO_FAKEGPU_SM=60)))
    out = nvml(fakegpu)["devices"][0]
    assert out["gpu"] == 100 and out["samples"] == {a.pid: 50, b.pid: 50}


def test_exclusive_process_mode_refuses_a_second_context(fakegpu, callers):
    fakegpu.set_compute_mode(0, "exclusive_process")
    assert fakegpu.read()["devices"][0]["compute_mode"] == "exclusive_process"
    a = ready(callers(base_env(fakegpu)))
    b = callers(base_env(fakegpu))
    assert b("init") == "ok"
    assert b("ctx 0") == "err 46"  # CUDA_ERROR_DEVICE_UNAVAILABLE
    assert b("ctx 1") == "ok"  # device 1 is still in DEFAULT mode
    a.close()
    assert b("ctx 0") == "ok"
    fakegpu.set_compute_mode(0, "prohibited")
    p = callers(base_env(fakegpu))
    assert p("init") == "ok" and p("ctx 0") == "err 46"


def test_pynvml_set_compute_mode_in_process(fakegpu):
    script = textwrap.dedent(f"""
        from colo.node import fakegpu
        fakegpu.use_fake_nvml({str(fakegpu.state)!r})
        import pynvml as n
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(1)
        n.nvmlDeviceSetComputeMode(h, n.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        print(n.nvmlDeviceGetCount(), n.nvmlDeviceGetComputeMode(h))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "COLO_FAKEGPU_STATE")}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "3"]
    assert fakegpu.read()["devices"][1]["compute_mode"] == "exclusive_process"


# ---- MPS -----------------------------------------------------------------------------------------------

class Mps:
    def __init__(self, node, root: Path, **env):
        self.node, self.pipe = node, root / "pipe"
        self.env = base_env(node, CUDA_MPS_PIPE_DIRECTORY=self.pipe, CUDA_MPS_LOG_DIRECTORY=root / "log", **env)
        r = subprocess.run([str(node.mps_control), "-d"], env=self.env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        self.daemon_pid = int((self.pipe / "nvidia-cuda-mps-control.pid").read_text())

    def __call__(self, *cmds):
        r = subprocess.run([str(self.node.mps_control)], input="".join(c + "\n" for c in cmds), env=self.env,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def server(self):
        out = self("get_server_list").split()
        return int(out[0]) if out else None

    def quit(self):
        if (self.pipe / "control").exists():
            self("quit")
        wait_for(lambda: not Path(f"/proc/{self.daemon_pid}").exists() or
                     Path(f"/proc/{self.daemon_pid}/stat").read_text().split()[2] == "Z", what="daemon exit")


@pytest.fixture
def mps_factory(fakegpu, public_dir):
    made = []

    def make(node=None, **env):
        root = Path(tempfile.mkdtemp(dir=public_dir))
        root.chmod(0o755)
        m = Mps(node or fakegpu, root, **env)
        made.append(m)
        return m

    yield make
    for m in made:
        m.quit()


@pytest.fixture
def shared_node(public_dir):
    """A state file that processes of another uid can open (the default fixture's dir is 0700)."""
    d = Path(tempfile.mkdtemp(dir=public_dir))
    d.chmod(0o755)
    fg.create(d / "state", count=2, mem=16 * GiB)
    assert stat.S_IMODE((d / "state").stat().st_mode) == 0o666
    return fg.FakeNode(d / "state")


def test_mps_daemon_answers_each_command(fakegpu, mps_factory, callers):
    m = mps_factory()
    assert (m.pipe / "control").exists()
    assert m("get_server_list") == ""
    assert m("get_default_active_thread_percentage") == "100.0\n"
    assert m("set_default_active_thread_percentage 40") == "40.0\n"
    assert m("set_default_device_pinned_mem_limit 0 4G", "get_default_device_pinned_mem_limit 0") == "4G\n"
    assert m("start_server -uid 0") == ""
    srv = m.server()
    assert srv and m(f"get_server_status {srv}") == "ACTIVE\n"
    assert m(f"get_active_thread_percentage {srv}") == "40.0\n"
    assert m(f"set_active_thread_percentage {srv} 30") == "30.0\n"
    assert m(f"get_device_pinned_mem_limit {srv} 0") == "4G\n"
    c = ready(callers(m.env))
    assert m(f"get_client_list {srv}") == f"{c.pid}\n"
    assert "Invalid command" in m("no_such_command")
    # NVML: the client in the MPS list, the server among the compute processes (as real NVML)
    out = nvml(fakegpu)["devices"][0]
    assert out["mps"] == {c.pid: 0} and out["procs"] == {srv: 0}
    assert procs(fakegpu)[c.pid]["kind"] == "mps_client"
    # a process whose pipe directory leads nowhere stays an ordinary context
    o = ready(callers(base_env(fakegpu)))
    assert procs(fakegpu)[o.pid]["kind"] == "process"
    m.quit()
    assert not (m.pipe / "control").exists()


def test_mps_pinned_memory_limit_and_thread_percentage(fakegpu, mps_factory, callers):
    m = mps_factory()
    m("set_default_device_pinned_mem_limit 0 2G", "set_default_active_thread_percentage 50")
    c = ready(callers(m.env | {"COLO_FAKEGPU_SM": "80"}))
    assert c("info") == f"ok {2 * GiB} {2 * GiB}"  # the limit is the client's device
    assert c("alloc 1073741824").startswith("ok")
    assert c("alloc 2147483648") == "err 2"
    assert c("alloc 1073741824").startswith("ok")
    assert c("alloc 1") == "err 2"
    assert nvml(fakegpu)["devices"][0]["gpu"] == 50  # 80 % asked, capped by the thread percentage
    # a client may lower the limit through its environment, not raise it
    low = ready(callers(m.env | {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=512M"}))
    assert low("alloc 1073741824") == "err 2" and low("alloc 536870912").startswith("ok")
    high = ready(callers(m.env | {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G"}))
    assert high("alloc 3221225472") == "err 2"


def test_mps_fault_refuses_new_clients_until_all_exit(fakegpu, mps_factory, callers):
    m = mps_factory()
    a, b = ready(callers(m.env)), ready(callers(m.env))
    srv = m.server()
    assert m(f"fake_fault {srv}") == ""
    assert m(f"get_server_status {srv}") == "FAULT\n"
    assert a("alloc 1024") == "err 700" and b("info") == "err 700"  # the sticky fault
    assert callers(m.env)("init") == "err 807"  # CUDA_ERROR_MPS_SERVER_NOT_READY
    a.close()
    assert callers(m.env)("init") == "err 807"
    b.close()
    wait_for(lambda: m(f"get_server_status {srv}") == "ACTIVE\n", what="server leaves FAULT")
    assert ready(callers(m.env))("alloc 1024").startswith("ok")


def test_mps_terminate_client_releases_its_memory(fakegpu, mps_factory, callers):
    m = mps_factory()
    c = ready(callers(m.env))
    assert c("alloc 2147483648").startswith("ok")
    srv = m.server()
    assert m(f"terminate_client {srv} {c.pid}") == ""
    assert c("alloc 1024") == "err 810"  # CUDA_ERROR_MPS_CLIENT_TERMINATED
    assert fakegpu.read()["devices"][0]["used"] == 0
    assert "not found" in m(f"terminate_client {srv} 999999")


def test_mps_client_cap(fakegpu, mps_factory, callers):
    m = mps_factory(COLO_FAKEGPU_MPS_MAX_CLIENTS=2)  # 48 on the real (and default fake) daemon
    ready(callers(m.env)), ready(callers(m.env))
    assert callers(m.env)("init") == "err 808"  # CUDA_ERROR_MPS_MAX_CLIENTS_REACHED


def test_mps_serialises_two_uids(shared_node, mps_factory, callers, caller_bin):
    m = mps_factory(shared_node)
    root = ready(callers(m.env))
    first = m.server()
    # nobody's client waits while root's server has clients
    assert callers(m.env | {"COLO_FAKEGPU_MPS_WAIT_S": "0.3"}, user=NOBODY)("init") == "err 805"
    waiting = callers(m.env, user=NOBODY)
    waiting.send("init")
    assert m("get_server_list") == f"{first}\n"
    root.close()
    assert waiting.recv() == "ok"  # root's last client left: a server for nobody replaced it
    second = m.server()
    assert second != first
    assert Path(f"/proc/{second}/status").read_text().split("Uid:")[1].split()[0] == str(NOBODY)
    assert waiting("ctx 0") == "ok" and waiting("alloc 1048576").startswith("ok")
    assert nvml(shared_node, m.env)["devices"][0]["mps"] == {waiting.pid: 1048576}


def test_mps_multiuser_server_takes_both_uids(shared_node, mps_factory, callers):
    m = mps_factory(shared_node, COLO_FAKEGPU_MPS_MULTIUSER=1)
    a = ready(callers(m.env))
    b = ready(callers(m.env | {"COLO_FAKEGPU_MPS_WAIT_S": "5"}, user=NOBODY))
    assert sorted(m(f"get_client_list {m.server()}").split()) == sorted([str(a.pid), str(b.pid)])


# ---- colo-burn ---------------------------------------------------------------------------------------

def burn(node, *args, env=None):
    return subprocess.run([str(native.path(native.BURN)), *args], capture_output=True, text=True, timeout=60,
                          env=env or base_env(node))


def test_colo_burn_exit_codes(fakegpu):
    r = burn(fakegpu, "--mem", "1GiB", "--step", "512MiB", "--interval", "0.01", "--over", "32GiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["allocated 512MiB (holding 512MiB)", "allocated 512MiB (holding 1GiB)",
                                     "allocation of 32GiB refused: CUDA_ERROR_OUT_OF_MEMORY", "freed 1GiB"]
    assert burn(fakegpu, "--mem", "17G").returncode == 3
    r = burn(fakegpu, "--mem", "1G", "--over", str(GiB))
    assert r.returncode == 4 and "beyond --mem" in r.stdout
    assert burn(fakegpu, "--mem", "lots").returncode == 2
    assert burn(fakegpu, "--device", "5", "--quiet").returncode == 1
    assert fakegpu.read()["devices"][0]["used"] == 0


def test_colo_burn_duty_shows_in_nvml_and_stops_on_sigterm(fakegpu):
    p = subprocess.Popen([str(native.path(native.BURN)), "--device", "1", "--mem", "2GiB", "--duty", "70",
                          "--seconds", "30"], stdout=subprocess.PIPE, text=True, env=base_env(fakegpu))
    try:
        assert p.stdout.readline().startswith("allocated 2GiB")
        assert p.stdout.readline().startswith("busy at 70%")
        dev = wait_for(lambda: (d := fakegpu.read()["devices"][1])["sm_util"] == 70 and d, what="duty in NVML")
        assert dev["used"] == 2 * GiB and dev["processes"][0]["sm"] == 70
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 128 + signal.SIGTERM
        assert "freed 2GiB" in p.stdout.read()
    finally:
        p.kill()
    dev = fakegpu.read()["devices"][1]
    assert dev["used"] == 0 and dev["sm_util"] == 0


# ---- memory errors ------------------------------------------------------------------------------------

def test_fakes_have_no_memory_errors_under_valgrind(fakegpu, caller_bin):
    if not shutil.which("valgrind"):
        pytest.skip("valgrind is not installed")
    script = "alloc 1\ninit\nalloc 1\nctx 0\nctx 1\nfill 4294967296\ninfo\nmemset 0 4\nthreadalloc 8\n" \
             "procaddr cuMemAlloc 12000\nprocaddr nothing 12000\nfreeall\nstress 200 7\nexit\n"
    r = subprocess.run(["valgrind", "--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=definite",
                        "--quiet", str(caller_bin)], input=script, capture_output=True, text=True, timeout=120,
                       env=base_env(fakegpu))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "n 4 err 2" in r.stdout


def test_mps_daemon_and_state_reader_have_no_memory_errors_under_valgrind(fakegpu, callers, public_dir):
    if not shutil.which("valgrind"):
        pytest.skip("valgrind is not installed")
    vg = ["valgrind", "--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=definite", "--quiet"]
    root = Path(tempfile.mkdtemp(dir=public_dir))
    env = base_env(fakegpu, CUDA_MPS_PIPE_DIRECTORY=root / "pipe", CUDA_MPS_LOG_DIRECTORY=root / "log")
    d = subprocess.Popen([*vg, str(fakegpu.mps_control), "-f"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (root / "pipe" / "control").exists(), timeout=60, what="daemon under valgrind")
        c = ready(callers(env))
        assert c("alloc 1048576").startswith("ok")
        r = subprocess.run([*vg, str(native.path(native.FAKEGPU_CTL)), "show", str(fakegpu.state)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        # the client's own entry, by pid: a process another test left may still be listed (seen first once,
        # as "process", in a stressed CI run)
        shown = {q["pid"]: q for q in json.loads(r.stdout)["devices"][0]["processes"]}
        assert shown[c.pid]["kind"] == "mps_client", shown
        c.close()
        ctl = subprocess.run([str(fakegpu.mps_control)], input="get_server_list\nquit\n", env=env,
                             capture_output=True, text=True, timeout=60)
        assert ctl.stdout.strip().isdigit()
        assert d.wait(timeout=60) == 0, d.stderr.read()[-3000:]
    finally:
        d.kill()
