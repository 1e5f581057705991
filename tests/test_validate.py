"""colo/daemon/validate.py, called directly: what a submitter may ask for.

Every limit is tried at the limit (accepted) and one past it (refused, Invalid or Forbidden as the
daemon answers them: invalid / forbidden), every type where another is sent (a string for a
number, a number for a bool), control characters in names, and every forbidden mount source with
its subpaths. Pure: no daemon (the daemon's own refusals are in test_hostile*.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from colo.daemon.validate import (Caller, Forbidden, Invalid, check_mount, check_spec, forbidden_source, is_admin,
                                  parse_array, parse_time)
from colo.jobs import Mount

USER = Caller(pid=1, uid=4321, gid=4321)  # no such user: a plain submitter
ROOT = Caller(pid=1, uid=0, gid=0)
GiB = 1024**3


def spec(caller: Caller = USER, protected: list[Path] | None = None, **fields):
    """check_spec of a valid process job with no GPU, `fields` changed (None: removed)."""
    raw = {"argv": ["true"], "gpus": 0, **fields}
    return check_spec({k: v for k, v in raw.items() if v is not None}, caller, protected or [])


def refused(exc: type[Exception] = Invalid, caller: Caller = USER, protected: list[Path] | None = None,
            **fields) -> str:
    with pytest.raises(exc) as e:
        spec(caller, protected, **fields)
    assert type(e.value) is exc  # Invalid and Forbidden are answered differently
    return str(e.value)


def test_a_full_spec_keeps_every_field():
    s = check_spec({"argv": ["python", "train.py"], "image": "pytorch/pytorch:2.3", "name": "train-1",
                    "gpu_mem": "4GiB", "gpus": 2, "env": {"SEED": "1"}, "mounts": ["/data:/data:ro"],
                    "workdir": "/work", "after": [1], "after_any": [2], "after_fail": [3], "priority": 5,
                    "profile": "resnet", "retries": 2, "grow": True, "cpus": 8, "mem": "16GiB", "time": "2h",
                    "gpu_ids": [3, 1], "gpu_type": "A100", "array": "0-3"}, USER, [])
    assert (s.argv, s.image, s.name, s.gpu_mem, s.gpus) == (["python", "train.py"], "pytorch/pytorch:2.3", "train-1",
                                                            4 * GiB, 2)
    assert s.env == {"SEED": "1"} and s.mounts == [Mount("/data", "/data", True)] and s.workdir == "/work"
    assert (s.after, s.after_any, s.after_fail, s.priority, s.profile) == ([1], [2], [3], 5, "resnet")
    assert (s.retries, s.grow, s.mem, s.time, s.gpu_ids, s.gpu_type) == (2, True, 16 * GiB, 7200, [1, 3], "A100")
    assert s.cpus == 8.0 and type(s.cpus) is float


def test_defaults_of_a_bare_spec():
    s = check_spec({"argv": ["true"], "gpu_mem": 1}, USER, [])
    assert (s.gpus, s.gpu_mem, s.image, s.name, s.env, s.mounts, s.workdir) == (1, 1, None, None, {}, [], None)
    assert (s.after, s.after_any, s.after_fail, s.priority, s.retries, s.grow) == ([], [], [], 0, 0, False)
    assert (s.cpus, s.mem, s.time, s.gpu_ids, s.gpu_type) == (None, None, None, [], None)


@pytest.mark.parametrize("field", ["privileged", "cap_add", "devices", "network_mode", "asked_mem", "slurm_job"])
def test_fields_outside_the_spec_are_forbidden(field):
    assert field in refused(Forbidden, **{field: True})


def test_a_spec_must_be_an_object():
    for raw in (None, [], "argv", 1):
        with pytest.raises(Invalid, match="spec must be an object"):
            check_spec(raw, USER, [])


# ---- the command -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [None, [], "true", [""], ["true", 1], [b"true"], ("true",)])
def test_a_command_is_a_nonempty_list_of_strings(argv):
    with pytest.raises(Invalid, match="missing command"):
        check_spec({"argv": argv, "gpus": 0}, USER, [])


def test_empty_arguments_after_the_program_are_kept():
    assert spec(argv=["printf", "%s\\n", ""]).argv == ["printf", "%s\\n", ""]


def test_argument_count_limit():
    assert len(spec(argv=["true"] + ["x"] * 4095).argv) == 4096
    assert "4097 arguments; at most 4096" in refused(argv=["true"] + ["x"] * 4096)


def test_command_bytes_limit_counts_utf8_and_one_per_argument():
    # each argument costs its UTF-8 bytes and one (its NUL): "true" 5, the rest len + 1
    assert spec(argv=["true", "a" * (65536 - 5 - 1)])
    assert "longer than 64 KiB" in refused(argv=["true", "a" * (65536 - 5)])
    assert spec(argv=["true", "é" * ((65536 - 5 - 1) // 2)])  # 2 bytes each
    assert "longer than 64 KiB" in refused(argv=["true", "é" * ((65536 - 5) // 2 + 1)])
    # the one per argument counts: 30,000 arguments of one byte would fit without it
    assert "longer than 64 KiB" in refused(argv=["true"] + ["a" * 30] * 2115)  # 5 + 2115 * 31 = 65570
    assert spec(argv=["true"] + ["a" * 30] * 2113)  # 5 + 2113 * 31 = 65508


def test_program_name_limit():
    assert spec(argv=["/" + "a" * 4095])
    assert "program name is longer than 4096 bytes" in refused(argv=["/" + "a" * 4096])


def test_nul_and_lone_surrogates_are_refused_everywhere():
    assert "NUL" in refused(argv=["true", "a\0b"])
    assert "NUL" in refused(env={"A": "x\0"})
    assert "NUL" in refused(workdir="/tmp\0/x")
    assert "not UTF-8" in refused(argv=["true", "bad \udcff"])
    assert "not UTF-8" in refused(env={"A": "\udcff"})
    assert "not UTF-8" in refused(workdir="/tmp/\udcff")


# ---- image, GPUs, GPU memory --------------------------------------------------------------------

def test_image_names():
    assert spec(image="registry.example.com:5000/org/img@sha256:abc").image == "registry.example.com:5000/org/img@sha256:abc"
    assert spec(image="a" * 255).image == "a" * 255
    assert "malformed image" in refused(image="a" * 256)
    for bad in ("", "  ", 5, True, ["ubuntu"]):
        assert "image must be a non-empty name" in refused(image=bad)
    for bad in ("ubuntu\n", "-ubuntu", "ubu ntu", "ubuntu;rm", "/ubuntu", "ubuntu\x1b"):
        assert "malformed image" in refused(image=bad)


@pytest.mark.parametrize("gpus", [-1, 65, True, "1", 1.0, None])
def test_gpus_is_a_whole_number_from_0_to_64(gpus):
    raw = {"argv": ["true"], "gpu_mem": GiB, "gpus": gpus}
    with pytest.raises(Invalid, match="--gpus must be a whole number from 0 to 64"):
        check_spec(raw, USER, [])


def test_gpus_bounds_accepted():
    assert spec(gpus=0).gpus == 0
    assert spec(gpus=64, gpu_mem=GiB).gpus == 64


def test_gpu_mem_limits_and_types():
    assert spec(gpus=1, gpu_mem=1).gpu_mem == 1
    assert spec(gpus=1, gpu_mem=1 << 50).gpu_mem == 1 << 50
    assert spec(gpus=1, gpu_mem="1024TiB").gpu_mem == 1 << 50
    assert "from 1 byte to 1PiB" in refused(gpus=1, gpu_mem=(1 << 50) + 1)
    assert "from 1 byte to 1PiB" in refused(gpus=1, gpu_mem="1025TiB")
    assert "from 1 byte to 1PiB" in refused(gpus=1, gpu_mem=-1)
    for bad in (True, 1.5, [1], {"a": 1}, False):
        assert "whole number of bytes" in refused(gpus=1, gpu_mem=bad)
    assert "malformed size" in refused(gpus=1, gpu_mem="4 PiB")
    assert "greater than zero" in refused(gpus=1, gpu_mem="0GiB")
    # sizes as text are read up to 32 characters; longer text is not parsed at all
    assert spec(gpus=1, gpu_mem="0" * 28 + "4GiB").gpu_mem == 4 * GiB
    assert "whole number of bytes" in refused(gpus=1, gpu_mem="0" * 29 + "4GiB")


def test_gpu_mem_is_required_for_a_gpu_job_and_dropped_for_a_cpu_one():
    assert "--gpu-mem is required" in refused(gpus=1)
    assert "--gpu-mem is required" in refused(gpus=1, gpu_mem=0)
    assert spec(gpus=0, gpu_mem=0).gpu_mem == 0
    assert spec(gpus=0, gpu_mem="4GiB").gpu_mem == 0
    assert "whole number of bytes" in refused(gpus=0, gpu_mem=True)


# ---- environment --------------------------------------------------------------------------------

def test_env_types():
    assert spec(env=None).env == {}
    assert spec(env={}).env == {}
    for bad in ([["A", "1"]], "A=1", {"A": 1}, {1: "a"}, {"A": None}):
        assert "env must map names to strings" in refused(env=bad)


def test_env_count_limit():
    assert len(spec(env={f"V{i}": "" for i in range(256)}).env) == 256
    assert "257 variables; at most 256" in refused(env={f"V{i}": "" for i in range(257)})


def test_env_name_limit_and_form():
    assert spec(env={"A" * 128: "1"})
    assert "longer than 128 bytes" in refused(env={"A" * 129: "1"})
    assert spec(env={"_a1": "1", "Z": "", "lower_case": "x"})
    for bad in ("1A", "A-B", "A B", "A\n", "", "A=B", "É"):
        assert "malformed environment variable name" in refused(env={bad: "1"})


def test_env_bytes_limit_counts_names_values_and_two_each():
    # each variable costs its name, its value and two (the '=' and the NUL)
    assert spec(env={"A": "x" * (65536 - 3)})
    assert "at most 64 KiB in all" in refused(env={"A": "x" * (65536 - 2)})
    assert spec(env={"A": "é" * ((65536 - 3) // 2)})
    assert "at most 64 KiB in all" in refused(env={"A": "é" * ((65536 - 3) // 2 + 1)})
    many = {f"V{i:03d}": "x" * 250 for i in range(256)}  # 256 * (4 + 250 + 2) = 65536
    assert spec(env=many)
    assert "at most 64 KiB in all" in refused(env={**many, "V000": "x" * 251})


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "COLO_BUDGET", "COLO_", "CUDA_MPS_PIPE_DIRECTORY",
                                  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
                                  "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES",
                                  "NVIDIA_IMEX_CHANNELS", "NVIDIA_GDS", "NVIDIA_MOFED", "NVIDIA_NVSWITCH",
                                  "NVIDIA_GDRCOPY", "GPU_DEVICE_ORDINAL"])
def test_colos_own_variables_are_forbidden(name):
    assert f"{name} is set by colo itself" in refused(Forbidden, env={name: "x"})


def test_variables_like_colos_own_are_the_jobs():
    names = ["NVIDIA_TF32_OVERRIDE", "LD_PRELOADX", "MY_LD_PRELOAD", "CUDA_VISIBLE_DEVICES_X", "XCOLO_A",
             "CUDA_LAUNCH_BLOCKING", "NVIDIA_GDS_X"]
    assert set(spec(env={n: "1" for n in names}).env) == set(names)


# ---- mounts ---------------------------------------------------------------------------------------

def mounts(*ms, caller: Caller = USER, protected: list[Path] | None = None):
    return spec(caller, protected, image="ubuntu", mounts=list(ms)).mounts


def test_mounts_are_for_container_jobs_only():
    assert "--mount is for container jobs" in refused(mounts=["/data:/data"])
    assert spec(mounts=[]).mounts == []


def test_mount_forms_and_types():
    assert mounts("/data:/in", "/data:/ro:ro", "/data:/rw:rw") == [
        Mount("/data", "/in", False), Mount("/data", "/ro", True), Mount("/data", "/rw", False)]
    assert mounts({"source": "/data", "target": "/in", "read_only": True}) == [Mount("/data", "/in", True)]
    assert mounts({"source": "/data", "target": "/in"}) == [Mount("/data", "/in", False)]
    assert "mounts must be a list" in refused(image="ubuntu", mounts="/data:/data")
    for bad in ("/data", "/data:/in:rx", ":/in", "/data:", "/a:/b:ro:x", {"src": "/data", "target": "/in"}):
        assert "malformed mount" in refused(image="ubuntu", mounts=[bad])
    for bad in ({"source": "/data", "target": "/in", "read_only": "yes"},
                {"source": "/data", "target": "/in", "read_only": 1},
                {"source": "/data", "target": "/in", "read_only": None},
                {"source": 5, "target": "/in"}, {"source": "/data", "target": ["/in"]}):
        assert "read_only true or false" in refused(image="ubuntu", mounts=[bad])
    for bad in (5, None, ["/data", "/in"]):
        with pytest.raises(Invalid):
            mounts(bad)
    assert "must be an absolute path" in refused(image="ubuntu", mounts=["data:/in"])
    assert "must be an absolute path" in refused(image="ubuntu", mounts=["/data:in"])


def test_mount_count_limit():
    assert len(mounts(*[f"/data:/in{i}" for i in range(16)])) == 16
    assert "17 mounts; at most 16" in refused(image="ubuntu", mounts=[f"/data:/in{i}" for i in range(17)])


def test_mount_path_and_text_limits():
    src, dst = "/" + "a" * 1023, "/" + "b" * 1023  # 1024 bytes each: the most a path may have
    assert mounts(f"{src}:{dst}") == [Mount(src, dst, False)]
    assert "mount source is longer than 1024 bytes" in refused(image="ubuntu", mounts=[f"{src}a:/in"])
    assert "mount target is longer than 1024 bytes" in refused(image="ubuntu", mounts=[f"/in:{dst}b"])
    # the whole SRC:DST[:ro] text is refused before it is parsed past 2 * 1024 + 4 bytes
    assert mounts(f"{src}:{dst}:ro") == [Mount(src, dst, True)]  # 2,052 bytes
    assert "mount is longer than 2052 bytes" in refused(image="ubuntu", mounts=[f"{src}:{dst}bbbbb"])


def test_a_read_only_mount_of_two_longest_paths_is_accepted():
    src, dst = "/" + "a" * 1023, "/" + "b" * 1023
    assert mounts(f"{src}:{dst}:ro") == [Mount(src, dst, True)]


@pytest.mark.parametrize("source", [
    "/dev", "/dev/nvidia0", "/dev/shm", "/dev//shm", "/./dev", "/dev/", "/proc", "/proc/1/root", "/proc/self",
    "/sys", "/sys/fs/cgroup", "/var/run/docker.sock", "/run/docker.sock", "/run/containerd",
    "/run/containerd/containerd.sock"])
def test_forbidden_mount_sources_and_what_is_under_them(source):
    msg = refused(Forbidden, image="ubuntu", mounts=[f"{source}:/in"])
    assert "is not allowed (it holds" in msg
    assert refused(Forbidden, caller=ROOT, image="ubuntu", mounts=[f"{source}:/in"])  # root too


@pytest.mark.parametrize("source", ["/", "/run", "/var", "/var/run"])
def test_a_folder_holding_a_forbidden_source_is_forbidden_to_users_not_root(source):
    refused(Forbidden, image="ubuntu", mounts=[f"{source}:/in"])
    assert mounts(f"{source}:/in", caller=ROOT)[0].source == source


@pytest.mark.parametrize("source", ["/devices", "/device", "/proc2", "/system", "/run/user/1000", "/var/lib/docker2",
                                    "/home/dev", "/data/proc", "/tmp/sys"])
def test_names_that_only_look_like_forbidden_sources_are_allowed(source):
    assert mounts(f"{source}:/in")[0].source == source


def test_protected_paths_and_their_parents():
    prot = [Path("/var/lib/colo")]
    for source in ("/var/lib/colo", "/var/lib/colo/state.db", "/var/lib", "/var"):
        refused(Forbidden, protected=prot, image="ubuntu", mounts=[f"{source}:/in"])
    assert mounts("/var/lib/colony:/in", protected=prot)[0].source == "/var/lib/colony"
    assert mounts("/var/lib:/in", caller=ROOT, protected=prot)[0].source == "/var/lib"
    refused(Forbidden, caller=ROOT, protected=prot, image="ubuntu", mounts=["/var/lib/colo/x:/in"])


def test_forbidden_source_names_what_it_holds():
    assert forbidden_source("/dev/nvidia0", USER, []) == "/dev"
    assert forbidden_source("/sys/fs", ROOT, []) == "/sys"
    assert forbidden_source("/run", USER, []) == "/run/docker.sock"  # the first one under it
    assert forbidden_source("/run", ROOT, []) is None
    assert forbidden_source("/opt/colo-state/db", USER, [Path("/opt/colo-state")]) == "/opt/colo-state"
    assert forbidden_source("/opt/data", USER, [Path("/opt/colo-state")]) is None


def test_dot_dot_and_targets():
    assert "'..' is not allowed" in refused(image="ubuntu", mounts=["/data/../dev:/in"])
    assert "not allowed" in refused(Forbidden, image="ubuntu", mounts=["/data:/in/../etc"])
    for target in ("/", "//", "/.", "/opt/colo", "/opt//colo", "/opt/./colo", "/opt/colo/", "/opt/colo/lib"):
        assert "mount target" in refused(Forbidden, image="ubuntu", mounts=[f"/data:{target}"])
    assert mounts("/data:/opt/colony", "/data:/opt/col")[1].target == "/opt/col"


def test_mount_names_are_cleaned_as_docker_reads_them():
    assert mounts("/data//x/./y/:/a//b/./c") == [Mount("/data/x/y", "/a/b/c", False)]
    assert check_mount(Mount("/data/./x", "/in//y", True), USER, []) == Mount("/data/x", "/in/y", True)


# ---- workdir, dependencies, priority, names ---------------------------------------------------------

def test_workdir():
    assert spec(workdir="/" + "a" * 1023).workdir == "/" + "a" * 1023
    assert "--workdir is longer than 1024 bytes" in refused(workdir="/" + "a" * 1024)
    assert "--workdir is longer than 1024 bytes" in refused(workdir="/" + "é" * 512)  # 1,025 bytes, 513 characters
    for bad in ("tmp", "", 5, ["/tmp"], "./tmp"):
        assert "--workdir must be an absolute path" in refused(workdir=bad)


@pytest.mark.parametrize("key", ["after", "after_any", "after_fail"])
def test_dependencies(key):
    """Job ids, as colo/daemon/deps.py made them of what a submitter wrote (up to 64 references: an
    array's id or a name may stand for many jobs, up to 1,000 in all)."""
    from colo.daemon import deps
    from colo.daemon.validate import MAX_AFTER

    flag = "--" + key.replace("_", "-")
    assert getattr(spec(**{key: list(range(1, MAX_AFTER + 1))}), key) == list(range(1, MAX_AFTER + 1))
    assert getattr(spec(**{key: [(1 << 63) - 1]}), key) == [(1 << 63) - 1]
    assert f"{flag} names {MAX_AFTER + 1:,} jobs; at most {MAX_AFTER:,}" in refused(
        **{key: list(range(1, MAX_AFTER + 2))})
    for bad in ([0], [-1], [1 << 63], [True], ["1"], [1.0], 5, "1", {"1": 1}):
        assert f"{flag} takes job ids, ARRAY_INDEX (12_3) or names" in refused(**{key: bad})
    with pytest.raises(Invalid, match=f"{flag} takes up to 64 references"):  # before they are resolved
        deps.resolved(None, {key: list(range(1, 66))}, "alice")


def test_priority():
    assert spec(priority=1000).priority == 1000 and spec(priority=-1000).priority == -1000
    for bad in (1001, -1001, True, "1", 1.0):
        assert "--priority must be a whole number from -1000 to 1000" in refused(priority=bad)


@pytest.mark.parametrize("key", ["name", "profile"])
def test_names_and_profiles(key):
    assert getattr(spec(**{key: "a" * 64}), key) == "a" * 64
    assert getattr(spec(**{key: "A1._-z"}), key) == "A1._-z"
    for bad in ("a" * 65, "", "-a", ".a", "_a", "a b", "a\n", "a\nb", "a/b", "a\x1b", "é", 5, True):
        assert f"--{key} must be 1-64 letters" in refused(**{key: bad})


def test_grow_and_retries():
    assert spec(grow=True).grow is True and spec(grow=False).grow is False
    for bad in (1, "true", 0):
        assert "grow must be true or false" in refused(grow=bad)
    assert spec(retries=10).retries == 10 and spec(retries=0).retries == 0
    for bad in (11, -1, True, "1", 1.0):
        assert "retries must be 0 to 10" in refused(retries=bad)


def test_cpus():
    assert spec(cpus=0.01).cpus == 0.01 and spec(cpus=4096).cpus == 4096.0 and spec(cpus=1.5).cpus == 1.5
    for bad in (0.0099, 0, -1, 4096.01, 4097, "8", True, False, [8], float("nan")):
        assert "--cpus must be a number of cores from 0.01 to 4096" in refused(cpus=bad)


def test_mem():
    assert spec(mem="4MiB").mem == 4 << 20 and spec(mem=4 << 20).mem == 4 << 20 and spec(mem="1GB").mem == 10**9
    assert "--mem must be at least 4MiB" in refused(mem=(4 << 20) - 1)
    assert "--mem must be at least 4MiB" in refused(mem="4MB")
    assert "--mem: malformed size" in refused(mem="lots")
    assert "--mem: size 0 must be greater than zero" in refused(mem=0)


# ---- GPU choice -------------------------------------------------------------------------------------

def test_gpu_ids():
    assert spec(gpus=2, gpu_mem=GiB, gpu_ids=[5, 0, 63]).gpu_ids == [0, 5, 63]  # sorted
    assert spec(gpus=64, gpu_mem=GiB, gpu_ids=list(range(64))).gpu_ids == list(range(64))
    assert spec(gpus=1, gpu_mem=GiB, gpu_ids=None).gpu_ids == []
    for bad in ([64], [-1], [True], ["1"], [1.0], 3, list(range(64)) + [0]):
        assert "--gpu-id takes up to 64 GPU indices from 0 to 63" in refused(gpus=1, gpu_mem=GiB, gpu_ids=bad)
    assert "--gpu-id names a GPU twice" in refused(gpus=1, gpu_mem=GiB, gpu_ids=[1, 1])
    assert "--gpus 3 but --gpu-id allows only 2 GPU(s)" in refused(gpus=3, gpu_mem=GiB, gpu_ids=[0, 1])
    assert "do not apply to a job with --gpus 0" in refused(gpus=0, gpu_ids=[0])


def test_gpu_type():
    for kind in ("A100", "RTX 4090", "a" * 64, "H100 80GB HBM3", "A100-SXM4+x_y.z", "7"):
        assert spec(gpus=1, gpu_mem=GiB, gpu_type=kind).gpu_type == kind
    for bad in ("a" * 65, "", " A100", "-A100", "A100\n", "A100\nB", "A\x1b", "A100;", "é", 5, True, ["A100"]):
        assert "--gpu-type must be 1-64 letters" in refused(gpus=1, gpu_mem=GiB, gpu_type=bad)
    assert "do not apply to a job with --gpus 0" in refused(gpus=0, gpu_type="A100")


# ---- --array and --time, read as Slurm reads them --------------------------------------------------

@pytest.mark.parametrize("text,indices,limit", [
    ("0-9", list(range(10)), None), ("0-9:2", [0, 2, 4, 6, 8], None), ("1,3,5", [1, 3, 5], None),
    ("0-3,8", [0, 1, 2, 3, 8], None), ("0-15%4", list(range(16)), 4), (" 5 ", [5], None), ("0-3, 8", [0, 1, 2, 3, 8], None),
    ("3,1,3", [1, 3], None), ("5-9", [5, 6, 7, 8, 9], None), ("7-7", [7], None), ("1-10:3", [1, 4, 7, 10], None),
    ("0-1%1", [0, 1], 1), ("0%999999999", [0], 999999999), ("1000000", [1000000], None),
])
def test_parse_array(text, indices, limit):
    assert parse_array(text) == (indices, limit)


def test_parse_array_limits():
    assert len(parse_array("0-999")[0]) == 1000
    assert "makes more than 1000 tasks" in _array_error("0-1000")
    assert len(parse_array("0-1998:2")[0]) == 1000
    assert "makes more than 1000 tasks" in _array_error("0-2000:2")
    assert len(parse_array("0-499,500-999")[0]) == 1000  # counted over all the ranges
    assert "makes more than 1000 tasks" in _array_error("0-499,500-1000")
    assert "index 1000001 is above 1000000" in _array_error("1000001")
    assert "index 999999999 is above" in _array_error("0-999999999")
    long = "1," * 127 + "10"
    assert len(long) == 256 and parse_array(long)[0][-1] == 10
    assert "longer than 256 characters" in _array_error(long + "0")
    assert "%N needs a whole number" in _array_error("0-3%1000000000")


@pytest.mark.parametrize("bad", ["", "  ", None, 5, ["0-3"], "9-0", "0-9:0", "a", "0-", "-3", "0--3", "0-3%", "0-3%0",
                                 "0-3%-1", "0-3%x", "1.5", "0-3:2:1", "1,,2", "1234567890"])
def test_parse_array_refuses(bad):
    with pytest.raises(Invalid):
        parse_array(bad)


def _array_error(text: str) -> str:
    with pytest.raises(Invalid) as e:
        parse_array(text)
    return str(e.value)


@pytest.mark.parametrize("raw,secs", [
    (1, 1), (366 * 86400, 366 * 86400), ("90s", 90), ("10m", 600), ("2h", 7200), ("1d", 86400), ("366d", 366 * 86400),
    (" 10m ", 600), ("5", 300), ("5:30", 330), ("1:02:03", 3723), ("1-2", 86400 + 7200), ("1-2:3", 86400 + 7200 + 180),
    ("1-2:3:4", 86400 + 7200 + 180 + 4), ("0:1", 1), ("0-0:0:1", 1),
])
def test_parse_time(raw, secs):
    assert parse_time(raw) == secs


@pytest.mark.parametrize("raw", [0, -1, 366 * 86400 + 1, "0", "0s", "367d", "366-0:0:1", "8785h"])
def test_parse_time_bounds(raw):
    with pytest.raises(Invalid, match="from 1 second to 366 days"):
        parse_time(raw)


@pytest.mark.parametrize("raw", [True, 1.5, None, "", "abc", "1:2:3:4", "10x", "1-", "-1", "1h30m", [60]])
def test_parse_time_refuses(raw):
    with pytest.raises(Invalid, match="malformed --time"):
        parse_time(raw)


def test_time_through_the_spec():
    assert spec(time="1:00").time == 60
    assert "malformed --time" in refused(time="soon")


# ---- who is an admin --------------------------------------------------------------------------------

def test_callers_and_admins():
    import grp
    import pwd

    nobody = pwd.getpwnam("nobody")
    assert ROOT.user == "root" and USER.user == "4321"
    assert len({USER, Caller(1, 4321, 4321)}) == 1  # a value: hashable, equal by its fields
    with pytest.raises(AttributeError):
        USER.uid = 0
    assert Caller(1, 4321, 4321).groups() == {4321}  # no such user: its own group alone
    assert is_admin(ROOT, None) and is_admin(ROOT, "no-such-group")
    assert not is_admin(USER, None) and not is_admin(USER, "") and not is_admin(USER, "no-such-group")
    other = next(g for g in grp.getgrall() if g.gr_gid != nobody.pw_gid and nobody.pw_name not in g.gr_mem)
    member = Caller(1, nobody.pw_uid, other.gr_gid)  # its primary group is the admin group
    assert is_admin(member, other.gr_name)
    assert not is_admin(Caller(1, nobody.pw_uid, nobody.pw_gid), other.gr_name)
