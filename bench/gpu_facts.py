"""Part `machine` of bench/gpu_check.py: whether what was carried works here (native/build, the
packages of .gpu-deps), then the facts later issues need from a real machine: driver, CUDA and
framework versions, nvidia-smi -q, compute and MIG mode, the kernel (a sandbox shows there), glibc,
who may open /dev/nvidia* and what the driver's module parameters say of it, the cgroup layout, and
what cuGetProcAddress answers for the entry points the interposer counts, at CUDA 12.0 to 13.3."""
from __future__ import annotations

import grp
import json
import os
import platform
import pwd
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from gpu_partlib import PROBE, ROOT, Part, budget_env, nvml, sh

HOOKS_C = ROOT / "native" / "interpose" / "hooks.c"
VERSIONS = (12000, 13000, 13010, 13020, 13030)  # CUDA versions cuGetProcAddress is asked at
# nvidia-smi -q lines worth a glance (section/key as the tool nests them)
SMI_KEYS = ("Driver Version", "CUDA Version", "Product Name", "Product Architecture", "Persistence Mode",
            "Addressing Mode", "MIG Mode/Current", "Compute Mode", "FB Memory Usage/Total",
            "Virtualization Mode", "GSP Firmware Version", "Bus Id")
SMI_CAP = 40_000


def part_machine(part: Part) -> None:
    carried_native(part)
    carried_packages(part)
    system(part)
    driver(part)
    gating(part)
    procaddr(part)
    frameworks(part)


# --- what was carried ----------------------------------------------------------------------------

def native_files(d: Path) -> tuple[list[Path], list[Path]]:
    """The shared libraries a process loads and the programs colo runs, of a native build folder.
    colo_spank.so is left out: only slurmd can load it (it needs Slurm's symbols)."""
    libs = [d / "libcolo-interpose.so"] + sorted((d / "fakegpu").glob("lib*.so.1"))
    progs = [d / n for n in ("colo-burn", "colo-shim", "colo-pin")]
    return libs, progs


def glibc_needed(paths: list[Path]) -> str | None:
    """The newest GLIBC_2.N version named in these files (an upper bound of what they need)."""
    best = 0
    for p in paths:
        try:
            best = max([best] + [int(m) for m in re.findall(rb"GLIBC_2\.([0-9]+)", p.read_bytes())])
        except OSError:
            pass
    return f"2.{best}" if best else None


def carried_native(part: Part) -> None:
    info = dict(part.ctx.get("native") or {})
    d = Path(info.get("dir", ROOT / "native" / "build"))
    libs, progs = native_files(d)
    info["glibc_needed_at_most"] = glibc_needed(libs + progs)
    part.put("native", info)
    if not part.check(f"native files are here ({info.get('how', '?')})", all(p.exists() for p in libs[:1] + progs),
                      {"missing": [str(p) for p in libs[:1] + progs if not p.exists()],
                       "build": info.get("build_log", "")[-800:]}):
        return
    code = ("import ctypes, sys\nfor p in sys.argv[1:]:\n    try:\n        ctypes.CDLL(p)\n        print('ok', p)\n"
            "    except OSError as e:\n        print('FAIL', p, e)\n")
    rc, text = sh([sys.executable, "-c", code, *map(str, libs)], 30, part.env)
    for lib in libs:
        line = next((x for x in text.splitlines() if x.split(" ", 2)[1:2] == [str(lib)]), text[-300:])
        part.check(f"{lib.relative_to(d)} loads here", line.startswith("ok "), line)
    for prog in progs:
        rc, text = sh([str(prog), "--help"], 10, part.env)
        part.check(f"{prog.relative_to(d)} runs here", "usage" in text.lower(), f"exit {rc}: {text[-300:]}")


def carried_packages(part: Part) -> None:
    """colo's imports on the paths the check uses, and each package .gpu-deps fills in for the image."""
    ov = part.ctx.get("overlay") or {}
    code = ("import importlib, importlib.metadata as md, json, sys\nout = {}\n"
            "for mod, dist in json.loads(sys.argv[1]):\n"
            "    try:\n        m = importlib.import_module(mod)\n"
            "        try:\n            v = md.version(dist)\n        except md.PackageNotFoundError:\n"
            "            v = getattr(m, '__version__', '?')\n"
            "        out[mod] = {'version': v, 'file': getattr(m, '__file__', None)}\n"
            "    except Exception as e:\n        out[mod] = {'error': type(e).__name__ + ': ' + str(e)[:300]}\n"
            "print(json.dumps(out))\n")
    wanted = [("typer", "typer"), ("pynvml", "nvidia-ml-py"), ("psutil", "psutil"), ("numpy", "numpy"),
              ("docker", "docker"), ("textual", "textual"), ("pytest", "pytest"), ("xdist", "pytest-xdist"),
              ("colo.daemon.core", "colo"), ("colo.cli.app", "colo")]
    wanted += [(m, m) for m in ov.get("linked_modules", []) if m not in {w[0] for w in wanted}]
    rc, text = sh([sys.executable, "-c", code, json.dumps(wanted)], 60, part.env)
    try:
        found = json.loads(text.splitlines()[-1])
    except (ValueError, IndexError):
        found = {"error": text[-600:]}
    carried = ov.get("dir") or "\0"
    for mod, info in found.items():
        if isinstance(info, dict) and info.get("file"):
            info["from"] = "carried" if info["file"].startswith(carried) else "checkout" if info["file"].startswith(
                str(ROOT)) else "image"
    part.put("python_packages", {"found": found, "overlay": ov})
    for mod in ("colo.daemon.core", "colo.cli.app"):
        part.check(f"{mod} imports here", "error" not in (found.get(mod) or {"error": "?"}), found.get(mod))
    for mod in ov.get("linked_modules", []):
        part.check(f"carried package {mod} (.gpu-deps) imports here", "error" not in (found.get(mod) or {"error": "?"}),
                   found.get(mod))


# --- the machine ---------------------------------------------------------------------------------

def read(path: str, cap: int = 8000) -> str | None:
    try:
        return Path(path).read_text(errors="replace")[:cap]
    except OSError as e:
        return None if isinstance(e, FileNotFoundError) else f"unreadable: {e.strerror}"


def system(part: Part) -> None:
    u = os.uname()
    release = u.release
    sandbox = ("gVisor (its kernel says 4.4.0)" if release == "4.4.0" else
               "Firecracker (by the kernel's name)" if "-fc-" in release else "none recognised")
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION").removeprefix("glibc ")
    except (ValueError, OSError):
        glibc = " ".join(platform.libc_ver())
    osr = read("/etc/os-release") or ""
    part.put("system", {
        "kernel": release, "uname": " ".join(u), "proc_version": (read("/proc/version") or "").strip(),
        "sandbox": sandbox, "glibc": glibc, "os": next((x.split("=", 1)[1].strip('"') for x in osr.splitlines()
                                                        if x.startswith("PRETTY_NAME=")), "?"),
        "python": sys.version.split()[0], "python_executable": sys.executable, "cpus": os.cpu_count(),
        "euid": os.geteuid(), "host": platform.node(), "cc": (sh(["cc", "--version"], 10)[1].splitlines() or [""])[0],
        "nvcc": (sh(["nvcc", "--version"], 20)[1].splitlines() or [""])[-1],
        "mps_control": shutil.which("nvidia-cuda-mps-control", path=part.env.get("PATH")) or "not found",
    })


def smi_summary(text: str) -> dict:
    """nvidia-smi -q nests "Key : value" lines by indentation: the SMI_KEYS entries, first GPU."""
    out: dict = {}
    stack: list[tuple[int, str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(":")
        key = key.strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if sep and value.strip():
            path = "/".join([s for _, s in stack[1:]] + [key])  # [0] is the "GPU 0000:..." header
            for want in SMI_KEYS:
                if (path == want or path.endswith("/" + want) or key == want) and want not in out:
                    out[want] = value.strip()
        else:
            stack.append((indent, key))
    return out


def driver(part: Part) -> None:
    n = nvml(part.ctx)
    info: dict = {}
    try:
        d = n.devices()[0]
        info = {"driver": n.driver_version(), "cuda_driver": n.cuda_version(), "gpus": len(n.devices()),
                "gpu0": d.name, "gpu0_memory": d.total, "compute_mode": d.compute_mode, "uuid": d.uuid}
    except Exception as e:  # noqa: BLE001 - recorded as the check's detail
        info = {"error": f"{type(e).__name__}: {e}"}
    part.put("nvml", info)
    part.check("NVML answers (driver version, GPU 0)", "error" not in info, info)
    rc, text = sh(["nvidia-smi", "-q"], 30, part.env)
    part.put("nvidia_smi", {"rc": rc, "summary": smi_summary(text) if rc == 0 else {}, "q": text[:SMI_CAP]})


def gating(part: Part) -> None:
    """Facts for gating GPUs (who may open the device files) and for containing jobs (cgroups)."""
    devs = []
    paths = sorted(Path("/dev").glob("nvidia*")) + sorted(Path("/dev/nvidia-caps").glob("*"))
    for p in paths:
        try:
            st = p.lstat()
        except OSError:
            continue
        kind = "char" if stat.S_ISCHR(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "other"
        devs.append({"path": str(p), "kind": kind, "mode": oct(stat.S_IMODE(st.st_mode)), "uid": st.st_uid,
                     "gid": st.st_gid, "owner": _name(pwd.getpwuid, st.st_uid), "group": _name(grp.getgrgid, st.st_gid),
                     "rdev": f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" if kind == "char" else None})
    params = read("/proc/driver/nvidia/params")
    dev_params = {k: v.strip() for k, _, v in (x.partition(":") for x in (params or "").splitlines())
                  if k.strip() in ("DeviceFileUID", "DeviceFileGID", "DeviceFileMode", "ModifyDeviceFiles")}
    mounts = [x for x in (read("/proc/self/mounts", 64000) or "").splitlines() if "cgroup" in x]
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    own = next((x.split("::", 1)[1] for x in (read("/proc/self/cgroup") or "").splitlines() if x.startswith("0::")),
               None)
    own_dir = Path("/sys/fs/cgroup") / own.lstrip("/") if v2 and own is not None else None
    part.put("gating", {
        "dev_nvidia": devs, "ls_l": sh(["ls", "-l", *map(str, paths)], 10)[1] if paths else "no /dev/nvidia*",
        "driver_params": params, "device_file_params": dev_params or "none in /proc/driver/nvidia/params",
        "driver_version_file": read("/proc/driver/nvidia/version"),
        "cgroup": {"self": read("/proc/self/cgroup"), "mounts": mounts, "mount_cmd": _mount_cgroup(),
                   "v2": v2, "controllers": read("/sys/fs/cgroup/cgroup.controllers"),
                   "subtree_control": read("/sys/fs/cgroup/cgroup.subtree_control"),
                   "own": own, "own_has_cgroup_kill": bool(own_dir and (own_dir / "cgroup.kill").exists()),
                   "child_cgroup": _try_child(own_dir) if own_dir else "no cgroup v2 tree",
                   "bpftool": shutil.which("bpftool") or "not installed",
                   "bpffs": any(" bpf " in x for x in (read("/proc/self/mounts", 64000) or "").splitlines())},
    })


def _name(fn, i: int) -> str | None:
    try:
        return fn(i)[0]
    except KeyError:
        return None


def _mount_cgroup() -> str:
    rc, text = sh(["mount"], 10)
    return "\n".join(x for x in text.splitlines() if "cgroup" in x) if rc == 0 else text


def _try_child(own: Path) -> str:
    """Can colo make a cgroup of its own under this process's (as its process runtime does)?"""
    probe = own / "colo-gpucheck-probe"
    try:
        probe.mkdir()
    except OSError as e:
        return f"cannot create one: {e.strerror}"
    files = sorted(p.name for p in probe.iterdir())
    try:
        probe.rmdir()
    except OSError:
        pass
    return f"created and removed; it had {len(files)} files, cgroup.kill {'yes' if 'cgroup.kill' in files else 'no'}"


# --- cuGetProcAddress ---------------------------------------------------------------------------

def counted_names() -> list[str]:
    """The entry points whose (name, version) the interposer resolves itself: its `rules` table."""
    text = HOOKS_C.read_text()
    block = text[text.index("} rules[] = {"):]
    block = block[:block.index("};")]
    return re.findall(r'\{"(cu[A-Za-z0-9]+)",', block)


def procaddr(part: Part) -> None:
    names = counted_names()
    args = [sys.executable, str(PROBE), "--procaddr", ",".join(names), "--versions", ",".join(map(str, VERSIONS))]
    inter_env, _ = budget_env(part, 1 << 30, "procaddr")
    tables = {}
    for how, env in (("driver", part.env), ("interposed", inter_env)):
        r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
        ev = next((json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")), {})
        tables[how] = {"rc": r.returncode, "via": ev.get("via"), "rows": ev.get("rows", []),
                       "stderr": r.stderr[-600:], "exported": ev.get("exported")}
    drv = {(x["name"], x["ver"], x["flags"]): x for x in tables["driver"]["rows"]}
    inter = {(x["name"], x["ver"], x["flags"]): x for x in tables["interposed"]["rows"]}
    mem = drv.get(("cuMemAlloc", 13020, 0), {})
    summary = {
        "cuMemAlloc@13020": mem.get("is"),
        "cuMemAlloc@13020_is_dlsym_cuMemAlloc_v2": mem.get("is") == "cuMemAlloc_v2",
        # the driver's answers by version, where they are not one exported symbol throughout
        "changes": {f"{n}{' ptsz' if f else ''}": {v: drv[(n, v, f)]["is"] or f"rc {drv[(n, v, f)]['rc']}"
                                                   for v in VERSIONS}
                    for n in names for f in (0, 2)
                    if len({drv.get((n, v, f), {}).get("is") for v in VERSIONS}) > 1},
        "unexported": sorted({f"{k[0]}@{k[1]}{' ptsz' if k[2] else ''}" for k, x in drv.items()
                              if x["is"] == "unexported"}),
        "refused_by_interposer": sorted(f"{k[0]}@{k[1]}{' ptsz' if k[2] else ''}" for k, x in inter.items()
                                        if x["rc"] != 0 and drv.get(k, {}).get("rc") == 0),
    }
    for t in tables.values():  # one line per answer: "name@version[ ptsz]" -> the exported symbol it is
        t["rows"] = {f"{x['name']}@{x['ver']}{' ptsz' if x['flags'] else ''}":
                     x["is"] if x["rc"] == 0 else f"rc {x['rc']}, status {x['status']}" for x in t["rows"]}
    part.put("procaddr", {"versions": VERSIONS, "names": names, "summary": summary, **tables})
    part.check("cuGetProcAddress answers for the counted entry points (bare driver)",
               tables["driver"]["rc"] == 0 and bool(drv), tables["driver"]["stderr"] or tables["driver"]["rc"])
    own = (part.results.get("nvml") or {}).get("cuda_driver") or max(VERSIONS)
    missed = [k for k in summary["refused_by_interposer"] if int(k.split("@")[1].split()[0]) <= own]
    part.check("the interposer answers every counted entry point the driver answers, at the driver's CUDA "
               "version and below", tables["interposed"]["rc"] == 0 and not missed,
               missed or tables["interposed"]["stderr"])


# --- frameworks ---------------------------------------------------------------------------------

FRAMEWORK_PROBES = {
    "torch": "import torch; print(torch.__version__, 'cuda', torch.version.cuda, 'available', "
             "torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')",
    "cupy": "import cupy; print(cupy.__version__, 'runtime', cupy.cuda.runtime.runtimeGetVersion(), "
            "'driver', cupy.cuda.runtime.driverGetVersion())",
    "jax": "import jax; print(jax.__version__, jax.default_backend(), jax.devices())",
    "tensorflow": "import tensorflow as tf; print(tf.__version__)",
}


def frameworks(part: Part) -> None:
    """Each framework's version, imported in its own process, all at once (imports can be slow)."""
    import importlib.util

    if part.simulated:
        part.skip("framework versions: the simulated driver runs none of them")
        return
    out: dict = {}
    ps = {}
    for name, code in FRAMEWORK_PROBES.items():
        if importlib.util.find_spec(name) is None:
            out[name] = "not installed"
            continue
        ps[name] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env={**part.env, "TF_CPP_MIN_LOG_LEVEL": "3"})
    for name, p in ps.items():
        try:
            text, _ = p.communicate(timeout=max(5.0, part.left(3)))
            lines = text.strip().splitlines()
            out[name] = lines[-1] if p.returncode == 0 and lines else f"error: {text.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            p.kill()
            out[name] = "error: its import did not finish within the part's time"
    part.put("frameworks", out)
