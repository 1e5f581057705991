"""Gated GPUs on the simulated driver (docs/gating.md): it honours its device files as the real
driver honours /dev/nvidia*, so file modes and a job's device rules (cgroup v1 `devices`, or a
device program on cgroup v2) are tested here as real Unix users, with real open() calls."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from colo.node import cgroup, devices, fakegpu
from colo.node.cgroup import Cgroups, CgroupError
from colo.node.mps import MpsDaemon


pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users and gate files"),
              pytest.mark.users(1, prefix="cologate", root=False),
              # two simulated GPUs in a folder every user reaches: (root, state file, FakeNode)
              pytest.mark.node("colo-gate-", count=2, then=lambda n: (n.root, n.state, fakegpu.FakeNode(n.state)))]

GROUP = "cologpu-test"

# What a process sees of the simulated GPUs, through the driver API and NVML, by ctypes (no pynvml:
# it calls only the _v2 functions, and the old ones answer differently on a gated node).
PROBE = textwrap.dedent("""
    import ctypes, json, os, sys
    lib = sys.argv[1]
    cu = ctypes.CDLL(lib + "/libcuda.so.1")
    out = {"cuInit": cu.cuInit(0)}
    n = ctypes.c_int(-1)
    if out["cuInit"] == 0:
        cu.cuDeviceGetCount(ctypes.byref(n))
        out["cuda_count"] = n.value
        uuids = []
        for i in range(n.value):
            u = (ctypes.c_char * 16)()
            cu.cuDeviceGetUuid(u, i)
            uuids.append(bytes(u).hex()[:8])
        out["cuda_uuids"] = uuids
        ctx, ptr = ctypes.c_void_p(), ctypes.c_ulonglong()
        if n.value:
            cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
            cu.cuCtxSetCurrent(ctx)
            out["alloc"] = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))
    ml = ctypes.CDLL(lib + "/libnvidia-ml.so.1")
    out["nvmlInit"] = ml.nvmlInit_v2()
    if out["nvmlInit"] == 0:
        c2, c1 = ctypes.c_uint(), ctypes.c_uint()
        ml.nvmlDeviceGetCount_v2(ctypes.byref(c2))
        ml.nvmlDeviceGetCount(ctypes.byref(c1))
        h = ctypes.c_void_p()
        out["nvml_count_v2"], out["nvml_count_v1"] = c2.value, c1.value
        out["nvml_handles"] = [ml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) for i in range(c2.value)]
    print(json.dumps(out))
""")
NO_DEVICE, UNKNOWN, NO_PERMISSION = 100, 999, 4
PY = shutil.which("python3", path="/usr/bin:/bin") or sys.executable  # one every user may run (a venv's may sit in root's home)


@pytest.fixture(scope="module")
def group():
    try:
        return devices.group_id(GROUP)
    except LookupError:
        subprocess.run(["groupadd", GROUP], check=True, capture_output=True)
        return devices.group_id(GROUP)


def as_user(pw, groups=(), dirs=()):
    """A preexec_fn: join the cgroup folders `dirs` (as root), then become `pw` with `groups`."""
    def pre():
        for d in dirs:
            with open(Path(d) / "cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
        os.setgroups(list(groups))
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
    return pre


def probe(state: Path, pw, groups=(), dirs=(), env: dict | None = None) -> dict:
    """PROBE as the user `pw` with these supplementary groups, in the cgroup folders `dirs`."""
    r = subprocess.run([PY, "-c", PROBE, str(fakegpu.lib_dir())], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "COLO_FAKEGPU_STATE": str(state), **(env or {})},
                       preexec_fn=as_user(pw, groups, dirs))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_new_simulated_node_has_device_files_open_to_all_like_the_driver_default(node, users):
    _, state, fn = node
    names = sorted(os.listdir(fn.node_dir))
    assert names == ["nvidia-uvm", "nvidia0", "nvidia1", "nvidiactl"]
    assert all(os.stat(fn.node_dir / n).st_mode & 0o777 == 0o666 for n in names)
    st = devices.gate_status(devices.GpuNodes.of(state))
    assert not st.gated and st.ok and "not gated" in st.detail
    got = probe(state, users[0])
    assert got["cuda_count"] == 2 and got["alloc"] == 0 and got["nvml_handles"] == [0, 0]


def test_a_user_outside_the_gpu_group_gets_no_gpu_from_a_gated_node(node, users, group):
    """As a node gated with NVreg_DeviceFileGID=<group> NVreg_DeviceFileMode=0660: a process of a
    user outside the group cannot open nvidiactl, so CUDA finds no device and NVML refuses; with
    the group (what colo gives its jobs) it allocates."""
    _, state, fn = node
    fn.make_nodes(gid=group, mode=0o660)
    outside = probe(state, users[0])
    assert outside == {"cuInit": NO_DEVICE, "nvmlInit": NO_PERMISSION}
    inside = probe(state, users[0], groups=[group])
    assert inside["cuInit"] == 0 and inside["cuda_count"] == 2 and inside["alloc"] == 0
    st = devices.gate_status(devices.GpuNodes.of(state), GROUP)
    assert st.gated and st.ok and f"root:{GROUP}" in st.detail
    assert not devices.gate_status(devices.GpuNodes.of(state), "other").ok
    assert not devices.gate_status(devices.GpuNodes.of(state)).ok  # gated, but colo grants no group


def test_a_gpu_whose_file_does_not_open_is_hidden_from_cuda_and_refused_by_nvml(node, users):
    _, state, fn = node
    os.chmod(fn.node_dir / "nvidia0", 0o600)
    got = probe(state, users[0])
    uuids = fn.uuids()
    assert got["cuda_count"] == 1 and got["cuda_uuids"] == [uuids[1][4:12]]  # GPU1 is CUDA's device 0
    assert got["alloc"] == 0
    # NVML's _v2 count is every device, a handle of the one it may not open NO_PERMISSION; the old
    # count leaves it out (the real NVML's documented behaviour)
    assert got["nvml_count_v2"] == 2 and got["nvml_count_v1"] == 1 and got["nvml_handles"] == [NO_PERMISSION, 0]
    # indices in CUDA_VISIBLE_DEVICES count the devices it may open; a UUID of the other is no device
    assert probe(state, users[0], env={"CUDA_VISIBLE_DEVICES": uuids[0]})["cuda_count"] == 0
    assert probe(state, users[0], env={"CUDA_VISIBLE_DEVICES": "0"})["cuda_uuids"] == [uuids[1][4:12]]


def test_without_nvidia_uvm_cuda_fails_as_with_the_module_missing(node, users):
    _, state, fn = node
    os.chmod(fn.node_dir / "nvidia-uvm", 0o600)
    got = probe(state, users[0])
    assert got["cuInit"] == UNKNOWN and got["nvmlInit"] == 0  # NVML does not need uvm


def test_a_symlink_to_the_state_does_not_bring_its_own_device_files(node, users, group):
    """The driver finds its files from the state file it opened, so a user cannot point
    COLO_FAKEGPU_STATE at a link beside open files of their own."""
    root, state, fn = node
    fn.make_nodes(gid=group, mode=0o660)
    mine = root / "mine"
    mine.mkdir(mode=0o777)
    os.chmod(mine, 0o777)
    link = mine / "state"
    link.symlink_to(state)
    (mine / "state.dev").mkdir()  # the link's own device files, open to all
    for n in ("nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"):
        (mine / "state.dev" / n).touch(mode=0o666)
    assert probe(link, users[0]) == {"cuInit": NO_DEVICE, "nvmlInit": NO_PERMISSION}


def test_a_hard_link_to_the_state_does_not_bring_its_own_device_files(node, users, group):
    """Issue 52: the state file is 0666, so a user may hard-link it into a folder of their own, and
    the link's path is the one the process opened: beside it, a folder of open files of theirs, or
    none (the "made before nodes existed" case, where every node opened). Either is refused; the
    state itself still serves the group colo grants its jobs."""
    root, state, fn = node
    fn.make_nodes(gid=group, mode=0o660)
    assert os.stat(state).st_mode & 0o777 == 0o666
    mine = root / "mine"
    mine.mkdir(mode=0o777)
    os.chmod(mine, 0o777)
    pw = users[0]
    sh = "ln {s} {d}/bare && ln {s} {d}/state && mkdir {d}/state.dev && cd {d}/state.dev && " \
         "touch nvidiactl nvidia-uvm nvidia0 nvidia1 && chmod 0666 *"
    subprocess.run(["sh", "-c", sh.format(s=state, d=mine)], check=True, preexec_fn=as_user(pw))
    assert os.stat(mine / "state.dev" / "nvidiactl").st_uid == pw.pw_uid and os.stat(state).st_nlink == 3
    for link in (mine / "state", mine / "bare"):
        assert probe(link, pw) == {"cuInit": NO_DEVICE, "nvmlInit": NO_PERMISSION}, link
    assert probe(state, pw, groups=[group])["cuda_count"] == 2


def _free_majors() -> bool:
    text = Path("/proc/devices").read_text().split("Block devices")[0]
    used = {int(line.split()[0]) for line in text.splitlines()[1:] if line.strip()}
    return not used & {fakegpu.NVIDIA_MAJOR, fakegpu.UVM_MAJOR}


needs_free_majors = pytest.mark.skipif(not _free_majors(), reason="a driver here serves major 195 or 120")


@pytest.fixture
def char_node(node, group):
    """The simulated files as character devices of the driver's numbers, 0660 root:GROUP."""
    root, state, fn = node
    fn.make_nodes(char=True, gid=group, mode=0o660)
    return root, state, fn


@pytest.fixture
def cgroups():
    cg = Cgroups.setup(f"gatetest{uuid.uuid4().hex[:6]}")
    yield cg
    cg.close()


@needs_free_majors
def test_character_device_files_gate_as_the_plain_ones(char_node, users, group):
    _, state, fn = char_node
    nums = {n.name: n.char for n in devices.GpuNodes.of(state).nodes()}
    assert nums == {"nvidia0": (195, 0), "nvidia1": (195, 1), "nvidiactl": (195, 255), "nvidia-uvm": (120, 0)}
    assert probe(state, users[0]) == {"cuInit": NO_DEVICE, "nvmlInit": NO_PERMISSION}
    assert probe(state, users[0], groups=[group])["cuda_count"] == 2


def _held_job(cg: Cgroups, job_id: int, state: Path, uuids: list[str]) -> Path:
    cg.create(job_id)
    cg.restrict_devices(job_id, devices.GpuNodes.of(state).deny_rules(uuids))
    return cg.dirs(job_id)


@needs_free_majors
def test_device_rules_hold_a_job_to_its_gpu_even_without_cuda_visible_devices(char_node, users, group, cgroups):
    """The job of GPU1, in the group, with CUDA_VISIBLE_DEVICES unset: the driver finds only GPU1;
    a job of no GPU finds none (as Slurm's ConstrainDevices)."""
    if cgroups.contain is None or "devices" in cgroups.missing:
        pytest.skip(f"no device rules here: {cgroups.missing.get('devices') or cgroups.missing.get('contain')}")
    _, state, fn = char_node
    uuids = fn.uuids()
    job = _held_job(cgroups, 1, state, [uuids[1]])
    try:
        got = probe(state, users[0], [group], job)
        assert got["cuda_count"] == 1 and got["cuda_uuids"] == [uuids[1][4:12]] and got["alloc"] == 0
        assert got["nvml_handles"] == [NO_PERMISSION, 0]
        r = subprocess.run(["sh", "-c", f"exec 3<>{fn.node_dir}/nvidia0"], capture_output=True, text=True,
                           preexec_fn=as_user(users[0], [group], job))
        assert r.returncode != 0 and "Operation not permitted" in r.stderr  # the cgroup, not the mode
    finally:
        cgroups.kill(1)
        cgroups.remove(1)
    cpu_only = _held_job(cgroups, 2, state, [])
    try:
        assert probe(state, users[0], [group], cpu_only) == {"cuInit": NO_DEVICE, "nvmlInit": NO_PERMISSION}
    finally:
        cgroups.kill(2)
        cgroups.remove(2)


@needs_free_majors
def test_the_v2_device_program_holds_a_cgroup_to_its_gpu(char_node, users, group, native_dir):
    """colo-devcg (raw bpf(), no libbpf) on a cgroup2 leaf, as on a pure v2 server: here the
    hybrid layout's unified tree, whose programs the kernel runs for every open."""
    unified = next((Path(p.split()[4]) for p in Path("/proc/self/mountinfo").read_text().splitlines()
                    if p.split(" - ")[1].startswith("cgroup2 ")), None)
    tool = native_dir / "colo-devcg"
    if unified is None:
        pytest.skip("no cgroup2 mounted")
    check = subprocess.run([str(tool), "--check"], capture_output=True, text=True)
    if check.returncode != 0:
        pytest.skip(f"this kernel loads no device program: {check.stderr.strip()}")
    _, state, fn = char_node
    uuids = fn.uuids()
    leaf = unified / f"colo-gatetest-{uuid.uuid4().hex[:6]}"
    leaf.mkdir()
    try:
        cg = Cgroups("bpf", contain=leaf, v2=True, device_bpf=True)  # jobs' leaves under it, as colo-<instance>
        cg.create(9)
        cg.restrict_devices(9, devices.GpuNodes.of(state).deny_rules([uuids[0]]))
        got = probe(state, users[0], [group], cg.dirs(9))
        assert got["cuda_count"] == 1 and got["cuda_uuids"] == [uuids[0][4:12]]
        assert got["nvml_handles"] == [0, NO_PERMISSION]
        cg.kill(9)
        cg.remove(9)
    finally:
        leaf.rmdir()


def test_the_gate_keys_are_checked_at_load_and_the_patrol_default_follows_the_gate(tmp_path):
    from colo.config import Config, ConfigError

    for text in ('gpu_gate_at = "/"', 'gpu_gate_at = ["user.slice"]', 'gpu_gate_allow = ["/a/../b"]',
                 "gpu_gate_allow = [1]"):
        (tmp_path / "c.toml").write_text(text + "\n")
        key = text.split()[0]
        with pytest.raises(ConfigError, match=f"^{key}: .* is not a list of cgroup2 folders below its mount"):
            Config.load(tmp_path / "c.toml")
    assert not Config().kill_foreign and Config(gpu_group="g").kill_foreign
    assert not Config(gpu_group="g", patrol_kill_foreign=False).kill_foreign
    assert Config(patrol_kill_foreign=True).kill_foreign


def test_devcg_gate_refuses_malformed_arguments(native_dir):
    tool = str(native_dir / "colo-devcg")
    for bad in (["--gate", "/sys/fs/cgroup", "colo_gate", "1:1", "--"],  # no rule
                ["--gate", "/sys/fs/cgroup", "colo_gate", "1:0", "--", "c:195:*"],  # level 0: the root itself
                ["--gate", "/sys/fs/cgroup", "colo_gate", "x:1", "--", "c:195:*"],
                ["--gate", "/sys/fs/cgroup", "a_name_too_long_x", "1:1", "--", "c:195:*"],
                ["--gate", "/sys/fs/cgroup", "colo_gate", "1:1", "--", "c:195"]):
        r = subprocess.run([tool, *bad], capture_output=True, text=True)
        assert r.returncode == 2 and "usage" in r.stderr, bad


def test_devcg_refuses_malformed_rules(native_dir):
    tool = str(native_dir / "colo-devcg")
    for bad in (["/sys/fs/cgroup"], ["/sys/fs/cgroup", "x:1:2"], ["/sys/fs/cgroup", "c:195"],
                ["/sys/fs/cgroup", "c:195:1*"], ["/sys/fs/cgroup", "c:99999:1"]):
        r = subprocess.run([tool, *bad], capture_output=True, text=True)
        assert r.returncode == 2 and "usage" in r.stderr, bad


def test_no_device_rules_is_an_error_a_gated_start_can_refuse():
    cg = Cgroups("none")
    cg.missing["devices"] = "no devices controller and no cgroup v2 for colo here"
    cg.restrict_devices(1, [])  # nothing to refuse: nothing needed
    with pytest.raises(CgroupError, match="cannot hold the job to its GPUs: no devices controller"):
        cg.restrict_devices(1, ["c:195:1"])


# -- through colo: a real daemon, jobs of a real user outside the GPU group ------------------------
@pytest.fixture
def gate_root():
    """A cgroup2 folder standing for the node's root in miniature: the daemons here start in it
    (so their jobs' folders are beneath it) and gate it, never the machine's root, where the
    other tests' daemons and their jobs are (a gate outlives its daemon)."""
    mount = cgroup.v2_mount()
    if mount is None:
        pytest.skip("no cgroup2 mounted")
    d = mount / f"colo-gateroot-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    yield d
    from harness.daemon import wait_for

    def procs() -> list[int]:
        return [int(p) for f in d.rglob("cgroup.procs") for p in f.read_text().split()]

    for pid in procs():
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    wait_for(lambda: not procs(), 30, "the gate's folder to empty")
    for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        sub.rmdir()
    d.rmdir()


@pytest.fixture
def outside(gate_root):
    """Where the users' own processes live under the gate (user.slice on a systemd node)."""
    d = gate_root / "users"
    d.mkdir()
    return d


def start_in(d, folder: Path):
    """Start daemon `d` in cgroup2 `folder` (it makes its jobs' folder beneath its own): this
    process goes there for the fork, and back."""
    home = cgroup.v2_mount() / cgroup.places("self")[""].lstrip("/")
    (folder / "cgroup.procs").write_text(str(os.getpid()))
    try:
        return d.start()
    finally:
        (home / "cgroup.procs").write_text(str(os.getpid()))


@pytest.fixture
def gated_daemon(char_node, group, gate_root):
    """A daemon granting GROUP on a node whose simulated files are 0660 root:GROUP character
    devices, started in and gating `gate_root`; the probe written where jobs read it: (daemon,
    state, FakeNode, probe path)."""
    from harness.daemon import DaemonProc

    root, state, fn = char_node
    (root / "probe.py").write_text(PROBE)
    os.chmod(root / "probe.py", 0o644)
    (root / "d").mkdir(mode=0o755)
    d = start_in(DaemonProc(root / "d", state, {"gpu_group": GROUP, "gpu_gate_at": [f"/{gate_root.name}"]}),
                 gate_root)
    os.chmod(d.socket.parent, 0o755)
    yield d, state, fn, root / "probe.py"
    d.stop()


def submit_as(d, pw, argv: list[str], **spec) -> int:
    from colo.client import Client
    from harness.users import run_as

    s = {"argv": argv, "gpu_mem": 256 << 20, "workdir": "/tmp", **spec}
    return run_as(pw, lambda: Client(d.socket).submit(s)["id"])


def ended(d, job_id: int) -> tuple[dict, str]:
    job = d.wait_state(job_id, "succeeded", "failed", timeout=60)
    return job, d.cli("logs", str(job_id), check=True).stdout


@needs_free_majors
def test_a_colo_job_of_a_user_outside_the_group_uses_its_gpu_and_only_it(gated_daemon, users, group):
    d, state, fn, probe_py = gated_daemon
    assert probe(state, users[0]) == {"cuInit": NO_DEVICE, "nvmlInit": NO_PERMISSION}  # outside colo: nothing
    uuids = fn.uuids()
    lib = next(d.state_dir.glob("native-*")) / "fakegpu"
    # CUDA_VISIBLE_DEVICES taken away, as a job that wants more than it was given would
    j = submit_as(d, users[0], ["sh", "-c", f"id -G; unset CUDA_VISIBLE_DEVICES; {PY} {probe_py} {lib}; "
                                            f"exec 3<>{fn.node_dir}/nvidia1"], gpu_ids=[0])
    job, out = ended(d, j)
    groups, result, *rest = out.splitlines()
    assert str(group) in groups.split()
    got = json.loads(result)
    assert got["cuda_count"] == 1 and got["cuda_uuids"] == [uuids[0][4:12]] and got["alloc"] == 0
    assert got["nvml_handles"] == [0, NO_PERMISSION]
    assert job["state"] == "failed" and "nvidia1: Operation not permitted" in "\n".join(rest)


@needs_free_majors
def test_a_job_of_no_gpu_gets_none_even_pointing_at_the_driver_itself(gated_daemon, users):
    d, state, fn, probe_py = gated_daemon
    lib = next(d.state_dir.glob("native-*")) / "fakegpu"
    j = submit_as(d, users[0], ["sh", "-c", f"COLO_FAKEGPU_STATE={state} {PY} {probe_py} {lib}; id -G"],
                  gpus=0, gpu_mem=0)
    job, out = ended(d, j)
    result, groups = out.splitlines()
    assert json.loads(result) == {"cuInit": NO_DEVICE, "nvmlInit": NO_PERMISSION}
    assert str(devices.group_id(GROUP)) not in groups.split()  # the group is for GPU jobs only


def test_a_gpu_group_that_does_not_exist_stops_the_daemon_in_one_line(node):
    from harness.daemon import DaemonProc

    root, state, _ = node
    d = DaemonProc(root, state, {"gpu_group": "no-such-colo-group"})
    with pytest.raises(AssertionError, match="daemon exited with 1"):
        d.start()
    assert "gpu_group: no group 'no-such-colo-group' on this node (make it: groupadd" in d.log.read_text()


@needs_free_majors
@pytest.mark.docker
def test_a_container_job_gets_its_gpus_files_from_the_engine_and_no_other(gated_daemon, users, group, test_image):
    """The engine's device list hands the container its GPU's files (as CDI does real ones) and
    its device rules refuse the rest; the job's user gets the group through the engine."""
    d, state, fn, _ = gated_daemon
    files = f"/opt/colo/fakegpu/{state.name}.dev"
    # one stream: the engine copies a container's stdout and stderr apart, and under load the shell's
    # error was logged before the lines printed ahead of it
    j = submit_as(d, users[0], ["sh", "-c", f"exec 2>&1; id -G; /opt/colo/native/colo-burn --mem 64MiB; "
                                            f"exec 3<>{files}/nvidia1"], image=test_image, gpu_ids=[0])
    job, out = ended(d, j)
    assert str(group) in out.splitlines()[0].split()
    assert "allocated 64MiB" in out
    assert job["state"] == "failed" and "nvidia1: Operation not permitted" in out, out


def doctor_lines(tmp_path: Path, config: str) -> list[str]:
    """`colo doctor`'s lines about gating, with this config and no daemon."""
    cfg = tmp_path / "colo.toml"
    cfg.write_text(config)
    r = subprocess.run([sys.executable, "-m", "colo", "doctor"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLO_CONFIG": str(cfg), "COLO_SOCKET": str(tmp_path / "none.sock")})
    return [ln for ln in r.stdout.splitlines() if ln[6:].startswith(("gating", "devices", "gate", "patrol"))]


def test_doctor_says_whether_the_node_is_gated_for_the_group_colo_grants(node, group, tmp_path):
    root, state, fn = node

    def doctor(gpu_group: str | None) -> list[str]:
        return doctor_lines(tmp_path, f'fakegpu_state = "{state}"\n' + (f'gpu_group = "{gpu_group}"\n' if gpu_group
                                                                          else ""))

    assert doctor(None)[0].startswith("--    gating       not gated: nvidia-uvm, nvidia0, nvidia1, nvidiactl open to "
                                      "every user (0o666): a process outside colo can use the GPUs")
    assert doctor(GROUP)[0].startswith("FAIL  gating       not gated")  # meant to be (gpu_group), and is not
    fn.make_nodes(gid=group, mode=0o660)
    assert doctor(GROUP)[0] == (f"ok    gating       gated: 4 files in {fn.node_dir} 0o660 root:{GROUP}, none open "
                                f"to every user; colo's GPU jobs get the group {GROUP}")
    assert doctor("root")[0].startswith("FAIL  gating       gated") and "cannot open them" in doctor("root")[0]
    assert doctor(GROUP)[1].startswith("ok    devices      per job")
    # plain files: no device program applies; the patrol kills processes of no job by default
    assert doctor(GROUP)[2:] == ["--    gate         the GPUs' files in " f"{fn.node_dir} are not character devices: "
                                 "no device program applies",
                                 "ok    patrol       a process of no job holding GPU memory is killed, its uid logged "
                                 "(patrol_kill_foreign, on by default on a gated node)"]
    assert [ln[6:18] for ln in doctor(None)] == ["gating      ", "devices     "]  # no gpu_group: no gate asked of it



# -- the gate against the job's own user (docs/gating.md "The gate") ------------------------------
def _home(root: Path, pw) -> Path:
    h = root / f"home-{pw.pw_name}"
    h.mkdir(mode=0o755)
    os.chown(h, pw.pw_uid, pw.pw_gid)
    return h


@needs_free_majors
def test_a_setgid_copy_of_the_gpu_group_made_in_a_job_opens_no_gpu_outside_colo(gated_daemon, users, group,
                                                                                   gate_root, outside, tmp_path):
    """The job holds the GPU group, so its user can give it to a file of their own (chgrp, then
    chmod 2755): the copy carries the group out of colo for good. The gate refuses the devices by
    where the process is, not by its groups: outside a job the copy opens nothing."""
    d, state, fn, probe_py = gated_daemon
    assert "gate: the GPUs' devices (c:120:*, c:195:*) are refused beneath" in d.log.read_text()
    pw = users[0]
    home = _home(state.parent.parent, pw)
    gpy = home / "gpy"
    j = submit_as(d, pw, ["sh", "-c", f"cp {PY} {gpy} && chgrp {GROUP} {gpy} && chmod 2755 {gpy}"], gpu_ids=[0])
    job, out = ended(d, j)
    assert job["state"] == "succeeded", out
    st = os.stat(gpy)
    assert st.st_gid == group and st.st_mode & 0o7777 == 0o2755  # the group, carried out of the job
    lib = next(d.state_dir.glob("native-*")) / "fakegpu"
    env = {"PATH": "/usr/bin:/bin", "COLO_FAKEGPU_STATE": str(state)}
    opener = (f"import os\nprint(os.getegid())\nos.setregid({group}, {group})\n"
              f"try:\n os.open('{fn.node_dir}/nvidiactl', os.O_RDWR)\nexcept OSError as e:\n print(e.strerror)\n")
    r = subprocess.run([str(gpy), "-c", opener], capture_output=True, text=True, timeout=60, env=env,
                       preexec_fn=as_user(pw, (), [outside]))
    egid, err = r.stdout.split("\n")[:2]
    assert int(egid) == group, r.stderr  # it runs with the group (the mount honours setgid)...
    assert err == "Operation not permitted"  # ...and the gate refuses it: not the file's mode (EACCES)
    r = subprocess.run([str(gpy), str(probe_py), str(lib)], capture_output=True, text=True, timeout=60, env=env,
                       preexec_fn=as_user(pw, (), [outside]))
    assert json.loads(r.stdout) == {"cuInit": NO_DEVICE, "nvmlInit": NO_PERMISSION}, r.stderr
    # the same user's job opens its GPU as before (a job's folder is allowed beneath a gated root)
    j = submit_as(d, pw, [PY, str(probe_py), str(lib)], gpu_ids=[1])
    job, out = ended(d, j)
    assert json.loads(out.splitlines()[-1])["cuda_count"] == 1, out
    # MPS control daemons start beneath colo's folder, which the gate allows (the users' servers
    # they start open the GPUs)
    folder = gate_root / f"colo-{(d.state_dir / 'instance').read_text().strip()}" / "mps"
    short = Path(tempfile.mkdtemp(prefix="cg", dir="/tmp"))  # a Unix socket's path is short
    ctl = MpsDaemon(short, fn.uuids()[0], 0, fn.mps_control, {**os.environ, **fn.env}, cgroup=folder)
    try:
        ctl.start()
        assert cgroup.places(ctl.pid)[""].endswith(f"/{folder.parent.name}/mps")
    finally:
        ctl.stop()
        shutil.rmtree(short, ignore_errors=True)
    # a restarted daemon makes its jobs' folder anew (a new cgroup id) and replaces its program:
    # had the old one stayed, it would refuse the new folder's jobs
    before = (gate_root / f"colo-{(d.state_dir / 'instance').read_text().strip()}").stat().st_ino
    d.stop()
    start_in(d, gate_root)
    assert (gate_root / f"colo-{(d.state_dir / 'instance').read_text().strip()}").stat().st_ino != before
    j = submit_as(d, pw, [PY, str(probe_py), str(lib)], gpu_ids=[0])
    job, out = ended(d, j)
    assert json.loads(out.splitlines()[-1])["cuda_count"] == 1, out
    # colo doctor sees the gate (one program), and says when there is none or the patrol would
    # spare a holder
    base = f'fakegpu_state = "{state}"\ngpu_group = "{GROUP}"\n'
    lines = doctor_lines(tmp_path, base + f'gpu_gate_at = ["/{gate_root.name}"]\n')
    assert lines[2] == (f"ok    gate         the GPUs' devices are refused beneath {gate_root} but to colo's "
                        "jobs and root (colo_gate)"), lines
    assert lines[3].startswith("ok    patrol")
    lines = doctor_lines(tmp_path, base + 'gpu_gate_at = []\npatrol_kill_foreign = false\n')
    assert lines[2].startswith("FAIL  gate         gpu_gate_at = []: the group alone gates") and \
        lines[3].startswith("FAIL  patrol       patrol_kill_foreign = false on a gated node")


HOOK = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
/* The descriptor-passing attack's other half: the driver's files "opened" from descriptors a job
 * handed out (GPUFDS="nvidiactl=3,nvidia-uvm=4,nvidia0=5"), as a user would hook a real CUDA. */
static int passed(const char *path)
{
    const char *b = strrchr(path, '/'), *m = getenv("GPUFDS"), *p;
    char key[64];
    if (!b || !m || !strstr(path, ".dev/"))
        return -1;
    snprintf(key, sizeof key, "%s=", b + 1);
    for (p = strstr(m, key); p; p = strstr(p + 1, key))
        if (p == m || p[-1] == ',')
            return dup(atoi(p + strlen(key)));
    return -1;
}
int open(const char *path, int flags, ...)
{
    static int (*real)(const char *, int, ...);
    va_list ap;
    va_start(ap, flags);
    int mode = va_arg(ap, int);
    va_end(ap);
    int fd = passed(path);
    if (fd >= 0)
        return fd;
    if (!real)
        real = dlsym(RTLD_NEXT, "open");
    return real(path, flags, mode);
}
int open64(const char *path, int flags, ...) __attribute__((alias("open")));
/* the simulated driver opens its nodes relative to the ".dev" folder it found (openat) */
int openat(int dirfd, const char *path, int flags, ...)
{
    static int (*real)(int, const char *, int, ...);
    char link[64], dir[4096];
    va_list ap;
    va_start(ap, flags);
    int mode = va_arg(ap, int);
    va_end(ap);
    snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
    ssize_t n = dirfd >= 0 ? readlink(link, dir, sizeof dir - 1) : -1;
    if (n > 4) {
        dir[n] = 0;
        if (!strcmp(dir + n - 4, ".dev")) {
            char full[4200];
            snprintf(full, sizeof full, "%s/%s", dir, path);
            int fd = passed(full);
            if (fd >= 0)
                return fd;
        }
    }
    if (!real)
        real = dlsym(RTLD_NEXT, "openat");
    return real(dirfd, path, flags, mode);
}
int openat64(int dirfd, const char *path, int flags, ...) __attribute__((alias("openat")));
"""

RECEIVER = textwrap.dedent("""
    import os, signal, socket, sys
    sock_path, burn = sys.argv[1], sys.argv[2:]
    names = ["nvidiactl", "nvidia-uvm", "nvidia0"]
    for n in names:  # by path it opens nothing: not in the group
        try:
            os.open(os.environ["NODES"] + "/" + n, os.O_RDWR)
            sys.exit("opened " + n)
        except PermissionError:
            pass
    s = socket.socket(socket.AF_UNIX)
    s.bind(sock_path)
    s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept()
    _, fds, _, _ = socket.recv_fds(c, 16, 8)
    os.environ["GPUFDS"] = ",".join(f"{n}={fd}" for n, fd in zip(names, fds))
    for fd in fds:
        os.set_inheritable(fd, True)
    child = os.fork()
    if child == 0:
        os.execvp(burn[0], burn)
    print(child, flush=True)
    signal.pause()  # the holder: it uses no GPU itself, so NVML never lists it
""")

SENDER = textwrap.dedent("""
    import os, socket, sys
    fds = [os.open(sys.argv[2] + "/" + n, os.O_RDWR) for n in ("nvidiactl", "nvidia-uvm", "nvidia0")]
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    socket.send_fds(s, [b"gpu"], fds)
""")


def test_device_descriptors_a_job_hands_out_are_found_by_the_patrol_and_their_holders_killed(
        gated_daemon, users, group, outside, tmp_path):
    """The kernel checks a device at open only: a job that opens the files and passes the
    descriptors (SCM_RIGHTS) to its user's process outside colo gives it the GPU, gate or not.
    On a gated node the patrol kills a process of no job that holds GPU memory (by default,
    without waiting out a grace) and logs its owner; and with it every process outside colo's
    folders that holds the files open: the holder that got them and uses no GPU itself (it could
    hand them to one short-lived process after another, each gone before a second sample).
    (Plain files here: a character device of no driver opens nothing to pass.)"""
    d, state, fn, _ = gated_daemon
    fn.make_nodes(gid=group, mode=0o660)
    pw = users[0]
    home = _home(state.parent.parent, pw)
    hook = home / "hook.so"
    (tmp_path / "hook.c").write_text(HOOK)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(hook), str(tmp_path / "hook.c"), "-ldl"], check=True)
    os.chmod(hook, 0o755)
    for name, text in (("recv.py", RECEIVER), ("send.py", SENDER)):
        (home / name).write_text(text)
        os.chmod(home / name, 0o644)
    lib = next(d.state_dir.glob("native-*"))
    sock = home / "gpu.sock"
    env = {"PATH": "/usr/bin:/bin", "COLO_FAKEGPU_STATE": str(state), "NODES": str(fn.node_dir),
           "LD_LIBRARY_PATH": str(lib / "fakegpu"), "LD_PRELOAD": str(hook)}
    p = subprocess.Popen([PY, str(home / "recv.py"), str(sock), str(lib / "colo-burn"), "--mem", "1GiB",
                          "--duty", "0", "--seconds", "600"], env=env, stdout=subprocess.PIPE, text=True,
                         preexec_fn=as_user(pw, (), [outside]))
    try:
        assert p.stdout.readline() == "listening\n"
        j = submit_as(d, pw, [PY, str(home / "send.py"), str(sock), str(fn.node_dir)], gpu_ids=[0])
        job, out = ended(d, j)
        assert job["state"] == "succeeded", out
        burner = int(p.stdout.readline())
        assert p.wait(90) == -9  # SIGKILL, by the patrol
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = d.log.read_text()
    assert text.count(f"process {burner} (uid {pw.pw_uid}), in no job, holds") == 1  # told once, with its owner
    assert "it will be killed (patrol_kill_foreign)" in text
    held = "in no job, held the GPUs' device files open on a gated node (a descriptor from a job: the gate checks " \
           "at open only): killed (patrol_kill_foreign)"
    assert f"process {p.pid} (uid {pw.pw_uid}), {held}" in text, text[-3000:]  # the holder, never on a GPU
    assert f"process {burner} (uid {pw.pw_uid}), {held}" in text or \
        f"process {burner} (uid {pw.pw_uid}), in no job, held 1.0GiB" in text
