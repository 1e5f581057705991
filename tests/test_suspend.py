"""colo suspend / resume (issue 40): a running job's GPU memory moved to host memory through the
driver's checkpoint API (native/fakegpu/checkpoint.c simulates it) and back, through real
processes of real users: the driver's calls from outside, the daemon's commands, a restart."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


from colo.client import Client
from harness.daemon import DaemonProc, as_user, gpu_node, invoke_as, wait_for
from harness.node import SimNode

GiB = 1024**3
MiB = 1024**2
HOLDER = Path(__file__).with_name("suspend_holder.py")


def _holder(folder: Path, mib: int, env: dict) -> subprocess.Popen:
    folder.mkdir(mode=0o777, exist_ok=True)
    os.chmod(folder, 0o777)
    p = subprocess.Popen([sys.executable, str(HOLDER), str(mib), str(folder)], env=env)
    wait_for(lambda: (folder / "ready").exists() or p.poll() is not None, 60, "the holder to allocate")
    assert p.poll() is None
    return p


def _ckpt(native_dir: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(native_dir / "colo-ckpt"), *args], capture_output=True, text=True, env=env, timeout=120)


def _device(fakegpu) -> dict:
    return fakegpu.read()["devices"][0]


def test_the_simulated_driver_locks_checkpoints_restores_and_unlocks_a_process_from_outside(tmp_path, fakegpu,
                                                                                           native_dir):
    env = {**os.environ, **fakegpu.env}
    p = _holder(tmp_path / "a", 8192, env)
    try:
        pid = str(p.pid)
        assert _ckpt(native_dir, env, "state", pid).stdout.split() == [pid, "running"]
        r = _ckpt(native_dir, env, "suspend", pid)
        assert r.returncode == 0 and r.stdout.split() == [pid, "checkpointed"], r
        dev = _device(fakegpu)
        assert dev["used"] == 0 and dev["processes"] == []  # NVML: nothing held, the process not listed
        (tmp_path / "a" / "poke-1").touch()  # its next CUDA call blocks until it is unlocked
        # another process takes the memory: the restore is refused, the process stays checkpointed
        q = _holder(tmp_path / "b", 12288, env)
        r = _ckpt(native_dir, env, "resume", pid)
        assert r.returncode == 1 and "restore 2 CUDA_ERROR_OUT_OF_MEMORY" in r.stdout, r
        assert _ckpt(native_dir, env, "state", pid).stdout.split() == [pid, "checkpointed"]
        assert not (tmp_path / "a" / "done-1").exists()
        q.kill()
        q.wait()
        r = _ckpt(native_dir, env, "resume", pid)
        assert r.returncode == 0 and r.stdout.split() == [pid, "running"], r
        done = wait_for(lambda: (tmp_path / "a" / "done-1").exists() and (tmp_path / "a" / "done-1").read_text(),
                        60, "the blocked call to return")
        assert done.split()[0] == "0" and int(done.split()[1]) == 8 * GiB  # its 8 GiB are its own again
        assert _device(fakegpu)["used"] == 8 * GiB
        # steps out of order are the driver's ILLEGAL_STATE; a pid with no CUDA is no CUDA process
        r = _ckpt(native_dir, env, "unlock", pid)
        assert r.returncode == 1 and "CUDA_ERROR_ILLEGAL_STATE" in r.stdout
        assert _ckpt(native_dir, env, "state", str(os.getpid())).stdout.split() == [str(os.getpid()), "none"]
    finally:
        p.kill()
        p.wait()


def test_a_lock_times_out_while_a_kernel_runs_and_leaves_the_process_running(fakegpu, native_dir):
    env = {**os.environ, **fakegpu.env}
    code = ("import ctypes,sys; cu=ctypes.CDLL('libcuda.so.1'); assert cu.cuInit(0)==0; "
            "assert cu.fakegpuKernel(600000)==0; print('k', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "k\n"
        r = _ckpt(native_dir, env, "-t", "200", "suspend", str(p.pid))
        assert r.returncode == 1 and "lock 909 CUDA_ERROR_TIMEOUT" in r.stdout, r
        assert _ckpt(native_dir, env, "state", str(p.pid)).stdout.split() == [str(p.pid), "running"]
    finally:
        p.kill()
        p.wait()


def test_another_user_cannot_checkpoint_a_process_that_is_not_theirs(native_dir, other_user):
    from colo.node.fakegpu import FakeNode

    root, state, _ = gpu_node("colo-ckpt-")  # a state other users reach
    env = {**os.environ, **FakeNode(state).env}
    p = _holder(root / "a", 64, env)  # root's
    try:
        r = subprocess.run([str(native_dir / "colo-ckpt"), "suspend", str(p.pid)], capture_output=True, text=True,
                           env=env, timeout=120, user=other_user.pw_uid, group=other_user.pw_gid)
        assert r.returncode == 1 and "CUDA_ERROR_NOT_PERMITTED" in r.stdout, r
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(root, ignore_errors=True)


def _scrape(port: int) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def _metered(n: SimNode) -> DaemonProc:
    """The node's daemon, its metrics on a port of its own (d.metrics_port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the share of MemAvailable at 1: what a busy CI machine has free must not refuse a test's suspend
    d = n.daemon({"suspend_host_max": "2560MiB", "suspend_host_share": 1.0,
                  "metrics_listen": f"127.0.0.1:{port}"}, home=None)
    d.metrics_port = port
    return d


pytestmark = pytest.mark.node("colo-suspend-", count=1, mem=4 * GiB, then=_metered, per="module")



def _submit(pw, d: DaemonProc, name: str, gpu_mem: int, argv: list[str]) -> int:
    spec = {"argv": argv, "gpus": 1, "gpu_mem": gpu_mem, "name": name, "workdir": "/tmp"}
    kind, out = as_user(pw, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", out
    return out


def _ls(pw, d: DaemonProc) -> dict:
    code, out = invoke_as(pw, d, "ls", "--json")
    assert code == 0, out
    return {r["id"]: r for r in json.loads(out)}


def test_suspend_gives_a_jobs_memory_to_the_queue_and_resume_restores_it_when_it_fits(node, users):
    d = node
    alice, bob = users[0], users[1]
    work = d.root / "work"
    work.mkdir(mode=0o777, exist_ok=True)
    os.chmod(work, 0o777)
    go = work / "go"
    prog = shutil.copy(HOLDER, d.root / HOLDER.name)  # where the job's user can read it
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin")  # one a job's user may run
    holder = _submit(alice, d, "holder", 3 * GiB, [python, str(prog), "2048", str(work)])
    wait_for(lambda: (work / "ready").exists() or d.job(holder)["state"] not in ("queued", "starting", "running"),
             60, "the holder to allocate")
    assert (work / "ready").exists(), d.cli("logs", str(holder)).stdout
    waiter = _submit(bob, d, "waiter", 3 * GiB, ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done"])
    wait_for(lambda: "GPU" in d.job(waiter)["reason"], 60, "the waiter to wait for memory")
    # bob may not suspend alice's job; a job that is not running cannot be suspended
    code, out = invoke_as(bob, d, "suspend", str(holder))
    assert code != 0 and "belongs to" in out, out
    code, out = invoke_as(bob, d, "suspend", str(waiter))
    assert code != 0 and "only a running job can be suspended" in out, out
    wait_for(lambda: (d.job(holder).get("used") or 0) >= 2 * GiB, 30, "the sampler to see what it holds")
    code, out = invoke_as(alice, d, "suspend", str(holder))
    assert code == 0 and "suspended by colotest1" in out and "in host memory" in out, out
    row = _ls(alice, d)[holder]
    assert row["state"] == "running" and "suspended by colotest1" in row["suspended"], row
    code, out = invoke_as(alice, d, "ls")
    assert any(line.split()[:1] == [str(holder)] and "suspended" in line.split() for line in out.splitlines()), out
    d.wait_state(waiter, "running", timeout=60)  # its budget went to the queue
    figures = wait_for(lambda: (m := _scrape(d.metrics_port)).get("colo_gpu_suspended_bytes") and m, 30,
                       "the metrics to count the suspend")
    assert figures["colo_gpu_suspended_bytes"] >= 2 * GiB and figures["colo_suspends_total"] == 1
    # its next CUDA call waits at the interposer's gate and asks for the resume itself; its GPU is full
    (work / "poke-1").touch()
    explained = wait_for(lambda: "resume asked" in (e := json.loads(invoke_as(alice, d, "explain", str(holder), "--json")[1]))
                         ["reason"] and e, 60, "the holder's call to ask for its resume")
    assert explained["state"] == "suspended" and "waits for GPU 0" in explained["reason"], explained
    assert not (work / "done-1").exists()
    go.touch()  # the waiter ends: the holder fits again and is restored
    wait_for(lambda: (work / "done-1").exists(), 60, "the holder's call to return after its resume")
    assert (work / "done-1").read_text().split()[0] == "0"
    wait_for(lambda: _ls(alice, d)[holder]["suspended"] is None, 30, "the holder to show running")
    events = [e["reason"] for e in d.job(holder)["events"]]
    assert any(e.startswith("suspended by") for e in events) and any(e.startswith("resumed") for e in events)
    # suspended again, then the daemon killed -9 and started: the job is still suspended, and resumable
    assert invoke_as(alice, d, "suspend", str(holder))[0] == 0
    d.kill9()
    d.start()
    assert _ls(alice, d)[holder]["suspended"].startswith("suspended by colotest1")
    code, out = invoke_as(alice, d, "resume", str(holder))  # asked by its owner: its GPU has room
    assert code == 0 and "resume asked" in out, out
    wait_for(lambda: _ls(alice, d)[holder]["suspended"] is None, 60, "the holder to be restored")
    (work / "poke-2").touch()
    wait_for(lambda: (work / "done-2").exists(), 60, "the holder's call to return after the restart's resume")
    assert invoke_as(alice, d, "cancel", str(holder))[0] == 0
    d.wait_state(holder, "cancelled", "failed", "succeeded", timeout=60)
    # more than the node lets suspended jobs hold in host memory (suspend_host_max 2.5GiB): refused,
    # with the reason, and nothing of the job changed
    big_work = d.root / "big"
    big_work.mkdir(mode=0o777)
    os.chmod(big_work, 0o777)
    big = _submit(alice, d, "big", 3584 * MiB, [python, str(prog), "3072", str(big_work)])
    wait_for(lambda: (big_work / "ready").exists(), 60, "the big one to allocate")
    wait_for(lambda: (d.job(big).get("nvml_used") or 0) >= 3 * GiB, 30, "the sampler to see its memory")
    code, out = invoke_as(alice, d, "suspend", str(big))
    assert code != 0 and "passes suspend_host_max (2.5GiB)" in out, out
    j = d.job(big)
    assert j["state"] == "running" and j["suspended"] is None
    from colo.node.fakegpu import FakeNode

    assert FakeNode(d.fake_state).read()["devices"][0]["used"] >= 3 * GiB  # still on the GPU
    assert invoke_as(alice, d, "cancel", str(big))[0] == 0


def _user_gpu_seconds(port: int, user: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "colo_user_gpu_seconds_total" and s.labels.get("user") == user)


def test_suspended_time_is_no_gpu_use_in_show_history_report_and_the_metrics(node, users):
    d = node
    alice = users[0]
    work = d.root / "offgpu"
    work.mkdir(mode=0o777)
    os.chmod(work, 0o777)
    prog = shutil.copy(HOLDER, d.root / HOLDER.name)
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    job = _submit(alice, d, "offgpu", GiB, [python, str(prog), "512", str(work)])
    wait_for(lambda: (work / "ready").exists() or d.job(job)["state"] not in ("queued", "starting", "running"),
             60, "the holder to allocate")
    assert (work / "ready").exists(), d.cli("logs", str(job)).stdout
    assert invoke_as(alice, d, "suspend", str(job))[0] == 0

    def off() -> float:
        code, out = invoke_as(alice, d, "show", str(job), "--json")
        assert code == 0, out
        return json.loads(out).get("off_gpu") or 0.0

    wait_for(lambda: off() >= 2.0, 60, "two seconds suspended")
    code, out = invoke_as(alice, d, "show", str(job))
    assert code == 0 and "not counted as GPU use" in out, out
    counted = wait_for(lambda: _user_gpu_seconds(d.metrics_port, alice.pw_name) or None, 60, "the metrics to count it")
    wait_for(lambda: off() >= 4.0, 60, "two seconds more suspended")
    assert _user_gpu_seconds(d.metrics_port, alice.pw_name) == counted  # nothing counted while suspended
    assert invoke_as(alice, d, "cancel", str(job))[0] == 0  # it ends suspended
    d.wait_state(job, "cancelled", "failed", "succeeded", timeout=60)
    suspended_at = next(e["at"] for e in d.job(job)["events"] if e["reason"].startswith("suspended by"))
    code, out = invoke_as(alice, d, "history", "--json")
    assert code == 0, out
    rows = json.loads(out)
    row = next(r for r in rows if r["id"] == job)
    # GPU-hours: only the time before its suspend (the event is stored right after the checkpoint)
    assert row["ran"] - row["gpu_hours"] * 3600 >= 4.0, row
    assert row["gpu_hours"] * 3600 == pytest.approx(suspended_at - row["started_at"], abs=1.0), row
    code, out = invoke_as(alice, d, "report", "--json")
    assert code == 0, out
    mine = next(u for u in json.loads(out)["users"] if u["user"] == alice.pw_name)
    assert mine["gpu_hours"] == pytest.approx(sum(r["gpu_hours"] for r in rows if r["user"] == alice.pw_name))


def test_hostile_suspends_and_resumes_are_refused_and_a_process_that_ended_suspended_never_blocks_a_resume(node,
                                                                                                         users):
    d = node
    alice, bob = users[0], users[1]
    prog = shutil.copy(HOLDER, d.root / HOLDER.name)
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin")
    works = [d.root / "two" / name for name in ("a", "b")]
    for w in works:
        w.mkdir(mode=0o777, parents=True)
        os.chmod(w.parent, 0o777)
        os.chmod(w, 0o777)
    # one job, two CUDA processes
    script = " & ".join(f"{python} {prog} 256 {w}" for w in works) + "; wait"
    job = _submit(alice, d, "two", GiB, ["sh", "-c", script])
    wait_for(lambda: all((w / "ready").exists() for w in works), 60, "both processes to allocate")
    for args in (["suspend", "nosuchjob"], ["suspend", "999999"], ["resume", "999999"]):
        code, out = invoke_as(bob, d, *args)
        assert code != 0 and len(out.strip().splitlines()) == 1, (args, out)
    code, out = invoke_as(bob, d, "resume", str(job))  # not his, not suspended
    assert code != 0 and "belongs to" in out, out
    code, out = invoke_as(alice, d, "resume", str(job))
    assert code != 0 and "not paused" in out, out
    assert invoke_as(alice, d, "suspend", str(job))[0] == 0
    code, out = invoke_as(alice, d, "suspend", str(job))  # again: it is suspended already, nothing moves
    assert code == 0 and "suspended by colotest1" in out, out
    code, out = invoke_as(bob, d, "resume", str(job))  # another user's suspended job
    assert code != 0 and "belongs to" in out, out
    events = [e["reason"] for e in d.job(job)["events"]]
    assert sum(e.startswith("suspended by") for e in events) == 1, events
    assert _ls(alice, d)[job]["suspended"].startswith("suspended by colotest1")
    # one of its processes ends while suspended: the resume restores the other and is not refused
    gone = int((works[1] / "ready").read_text().split()[0])
    os.kill(gone, 9)
    wait_for(lambda: not os.path.exists(f"/proc/{gone}") or open(f"/proc/{gone}/stat").read().split()[2] == "Z",
             60, "the process to end")
    code, out = invoke_as(alice, d, "resume", str(job))
    assert code == 0, out
    wait_for(lambda: _ls(alice, d)[job]["suspended"] is None, 60, "the job to be restored")
    poke = works[0] / "poke-1"
    poke.touch()
    wait_for(lambda: (works[0] / "done-1").exists(), 60, "its live process's call to return")
    assert (works[0] / "done-1").read_text().split()[0] == "0"
    assert invoke_as(alice, d, "cancel", str(job))[0] == 0
    d.wait_state(job, "cancelled", "failed", "succeeded", timeout=60)


def test_suspend_victims_are_the_fewest_longest_idle_then_lowest_priority_holders_of_one_gpu():
    from colo.sched.policy import Holder, suspend_victims

    hs = [Holder(1, "g0", 4 * GiB, idle_since=100.0, idle_policy=True),
          Holder(2, "g0", 4 * GiB, idle_since=50.0, idle_policy=True),
          Holder(3, "g1", 12 * GiB, priority=-5, preemptible=True),
          Holder(4, "g1", 2 * GiB, idle_since=10.0, idle_policy=False)]  # idle, but its policy is off
    free = {"g0": 2 * GiB, "g1": 2 * GiB}
    assert suspend_victims(6 * GiB, 0, hs, free) == ("g0", [2])  # the longest idle on g0 is enough
    assert suspend_victims(10 * GiB, 0, hs, free) == ("g0", [2, 1])  # two idle ones before one busy job preempted
    g1 = [h for h in hs if h.gpu == "g1"]
    assert suspend_victims(10 * GiB, 0, g1, free) == ("g1", [3])  # preempted: a lower priority
    assert suspend_victims(10 * GiB, -5, g1, free) == (None, [])  # never one of its own priority
    assert suspend_victims(2 * GiB, 0, hs, free) == ("g0", [])  # it fits: nothing suspended
    assert suspend_victims(40 * GiB, 0, hs, free) == (None, [])  # no set suffices: nothing suspended


def test_the_suspend_keys_are_checked_at_load(tmp_path):
    from colo.config import Config, ConfigError

    for text, msg in (('idle_jobs = "end"', "idle_jobs: 'end' is not one of off, suspend"),
                      ('preempt = "kill"', "preempt: 'kill' is not one of off, suspend"),
                      ("suspend_host_share = 2", "suspend_host_share: 2 is not a share from 0 to 1")):
        (tmp_path / "c.toml").write_text(text + "\n")
        with pytest.raises(ConfigError, match=msg):
            Config.load(tmp_path / "c.toml")


def test_an_idle_job_is_suspended_for_a_waiting_one_and_a_no_suspend_job_never(users):
    root, state, _ = gpu_node("colo-idle-suspend-", count=2, mem=4 * GiB)
    d = DaemonProc(root, state, {"idle_jobs": "suspend", "idle_after": 1.0, "suspend_host_share": 1.0}).start()
    os.chmod(d.socket.parent, 0o755)
    try:
        alice, bob = users
        prog = shutil.copy(HOLDER, root / HOLDER.name)
        python = shutil.which("python3", path="/usr/local/bin:/usr/bin")
        ids = {}
        for name in ("keep", "idle"):
            work = root / name
            work.mkdir(mode=0o777)
            os.chmod(work, 0o777)
            spec = {"argv": [python, str(prog), "2048", str(work)], "gpus": 1, "gpu_mem": 3 * GiB, "name": name,
                    "workdir": "/tmp", **({"no_suspend": True} if name == "keep" else {})}
            kind, ids[name] = as_user(alice, lambda spec=spec: Client(d.socket).submit(spec)["id"])
            assert kind == "ok", ids[name]
            wait_for(lambda work=work: (work / "ready").exists(), 60, f"{name} to allocate")
        wait_for(lambda: all("idle" in d.job(i)["reason"] for i in ids.values()), 60, "both to be marked idle")
        waiter = _submit(bob, d, "waiter", 3 * GiB, ["sleep", "600"])
        d.wait_state(waiter, "running", timeout=60)  # it took the idle job's memory
        idle, keep = d.job(ids["idle"]), d.job(ids["keep"])
        assert idle["suspended"] and f"suspended by colo (job {waiter} waits for its memory)" in idle["suspended"], idle
        assert keep["suspended"] is None and keep["state"] == "running"
        assert d.job(waiter)["gpus"] == idle["gpus"]
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_the_driver_refuses_to_checkpoint_an_mps_client(fakegpu, native_dir):
    from colo.node.mps import MpsManager

    root = Path(tempfile.mkdtemp(prefix="cs", dir="/tmp"))  # short: the MPS pipe's socket path must fit
    root.chmod(0o755)
    env = {**os.environ, **fakegpu.env}
    mgr = MpsManager(root / "mps", fakegpu.mps_control, env, idle_stop_s=10)
    try:
        u0 = fakegpu.uuids()[0]
        d = mgr.ensure(u0, 0)
        client = {**env, "CUDA_VISIBLE_DEVICES": u0, "COLO_FAKEGPU_MPS_WAIT_S": "3", **d.client_env(4 * GiB, None)}
        p = _holder(root / "a", 512, client)
        try:
            r = _ckpt(native_dir, env, "suspend", str(p.pid))
            assert r.returncode == 1 and "state 801 CUDA_ERROR_NOT_SUPPORTED" in r.stdout, r
            assert fakegpu.read()["devices"][0]["used"] == 512 * MiB  # nothing moved
        finally:
            p.kill()
            p.wait()
    finally:
        mgr.stop_all()
        shutil.rmtree(root, ignore_errors=True)


def test_a_suspended_notebook_kernel_answers_and_its_next_cuda_call_resumes_it(node, tmp_path, monkeypatch):
    """A real ipykernel started through jupyter_client with colo's provisioner (as in test_jupyter.py;
    as root: this interpreter is under /root)."""
    pytest.importorskip("jupyter_client")
    pytest.importorskip("ipykernel")
    from jupyter_client import KernelManager

    d = node
    prefix = tmp_path / "prefix"
    r = d.cli("kernelspec", "install", "--gpu-mem", "256MiB", "--name", "colo-susp", "--python", sys.executable,
              "--prefix", str(prefix), "--socket", str(d.socket))
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    km = KernelManager(kernel_name="colo-susp")
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()

    def cell(code: str) -> str:
        out: list[str] = []
        reply = kc.execute_interactive(code, timeout=120, output_hook=lambda m: out.append(
            m["content"]["text"]) if m["msg_type"] == "stream" else None)
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out)

    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        job = km.provisioner.job_id
        assert cell("import ctypes\ncu = ctypes.CDLL('libcuda.so.1')\nctx, p = ctypes.c_void_p(), ctypes.c_uint64()\n"
                    "assert cu.cuInit(0) == 0 and cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0\n"
                    "print(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(128 << 20)))").strip() == "0"
        wait_for(lambda: (d.job(job).get("used") or 0) >= 128 * MiB, 30, "the kernel's memory to be seen")
        d.cli("suspend", str(job), check=True)
        assert cell("print(6 * 7)").strip() == "42"  # its CPU side answers while suspended
        assert d.job(job)["suspended"].startswith("suspended by root")
        # an entry point the interposer does not count (it comes through the gate's trampolines)
        out = cell("n = ctypes.c_int()\nprint(cu.cuDeviceGetCount(ctypes.byref(n)), n.value)")
        assert out.split() == ["0", "1"]  # it waited at the gate, was restored, and answered
        assert d.job(job)["suspended"] is None
        assert any(e["reason"].startswith("resumed") for e in d.job(job)["events"])
    finally:
        kc.stop_channels()
        km.shutdown_kernel()


def test_a_higher_priority_job_preempts_a_busy_lower_priority_one_but_never_a_no_suspend_one():
    root, state, _ = gpu_node("colo-preempt-", count=2, mem=4 * GiB)
    d = DaemonProc(root, state, {"preempt": "suspend", "suspend_host_share": 1.0}).start()
    try:
        ids = {}
        for gpu, name in ((0, "low"), (1, "keep")):
            work = root / name
            work.mkdir(mode=0o777)
            spec = {"argv": [sys.executable, str(HOLDER), "2048", str(work), "60"], "gpus": 1, "gpu_mem": 3 * GiB,
                    "name": name, "workdir": "/tmp", "priority": -5, "gpu_ids": [gpu],
                    **({"no_suspend": True} if name == "keep" else {})}
            ids[name] = d.client.submit(spec)["id"]
            wait_for(lambda work=work: (work / "ready").exists(), 60, f"{name} to allocate")
        wait_for(lambda: all((d.job(i).get("sm_util") or 0) > 0 for i in ids.values()), 60, "both to be busy")
        same = d.client.submit({"argv": ["sleep", "600"], "gpus": 1, "gpu_mem": 3 * GiB, "name": "same",
                                "workdir": "/tmp", "priority": -5})["id"]
        wait_for(lambda: "GPU" in d.job(same)["reason"], 60, "a job of the same priority to wait")
        urgent = d.client.submit({"argv": ["sleep", "600"], "gpus": 1, "gpu_mem": 3 * GiB, "name": "urgent",
                                  "workdir": "/tmp", "priority": 5})["id"]
        d.wait_state(urgent, "running", timeout=60)  # it took the low-priority job's memory
        low, keep = d.job(ids["low"]), d.job(ids["keep"])
        assert low["suspended"] and f"suspended by colo (job {urgent} waits for its memory)" in low["suspended"], low
        assert keep["suspended"] is None
        assert d.job(same)["state"] == "queued"  # nothing was preempted for a job of the same priority
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
