"""What a submitter may ask for. Everything a job gets beyond this is colo's own doing."""
from __future__ import annotations

import grp
import os
import pwd
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jobs import JobSpec, Mount
from ..units import BadSize, parse_size


class Invalid(ValueError):
    pass


class Forbidden(PermissionError):
    pass


@dataclass(frozen=True)
class Caller:
    pid: int
    uid: int
    gid: int

    @property
    def user(self) -> str:
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return str(self.uid)

    def groups(self) -> set[int]:
        try:
            return set(os.getgrouplist(self.user, self.gid))
        except (KeyError, OSError):
            return {self.gid}


def is_admin(caller: Caller, admin_group: str | None) -> bool:
    if caller.uid == 0:
        return True
    if not admin_group:
        return False
    try:
        return grp.getgrnam(admin_group).gr_gid in caller.groups()
    except KeyError:
        return False


SPEC_FIELDS = {"argv", "image", "name", "gpu_mem", "gpus", "env", "mounts", "workdir", "after",
               "priority", "profile", "retries"}
# colo's own plumbing: a job that could set these could escape its budget or reach MPS.
RESERVED_ENV = re.compile(r"^(LD_PRELOAD|LD_AUDIT|LD_LIBRARY_PATH|COLO_.*|CUDA_MPS_.*|CUDA_VISIBLE_DEVICES|"
                          r"NVIDIA_VISIBLE_DEVICES|NVIDIA_DRIVER_CAPABILITIES|GPU_DEVICE_ORDINAL)$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
FORBIDDEN_SOURCES = ("/var/run/docker.sock", "/run/docker.sock", "/run/containerd", "/proc", "/sys", "/dev")


def readable_by(path: Path, uid: int, gids: set[int]) -> bool:
    """Could this user read `path` (and search every folder on the way) by the file modes?"""
    if uid == 0:
        return True
    parts = [Path("/")] + [Path(*path.parts[: i + 1]) for i in range(1, len(path.parts))]
    for i, p in enumerate(parts):
        try:
            st = os.stat(p)
        except OSError:
            return False
        last = i == len(parts) - 1
        need = (stat.S_IRUSR | (stat.S_IXUSR if stat.S_ISDIR(st.st_mode) else 0)) if last else stat.S_IXUSR
        if st.st_uid == uid:
            ok = st.st_mode & need == need
        elif st.st_gid in gids:
            ok = st.st_mode & (need >> 3) == need >> 3
        else:
            ok = st.st_mode & (need >> 6) == need >> 6
        if not ok:
            return False
    return True


def _no_nul(raw: Any) -> None:
    """exec and the kernel's paths end at NUL: a string holding one would fail at start (or mean less)."""
    if isinstance(raw, str):
        if "\0" in raw:
            raise Invalid("NUL characters are not allowed in a job")
    elif isinstance(raw, dict):
        for k, v in raw.items():
            _no_nul(k)
            _no_nul(v)
    elif isinstance(raw, list):
        for v in raw:
            _no_nul(v)


def check_spec(raw: Any, caller: Caller, protected: list[Path]) -> JobSpec:
    """A JobSpec from what the client sent, or Invalid/Forbidden with one line saying why."""
    if not isinstance(raw, dict):
        raise Invalid("spec must be an object")
    _no_nul(raw)
    unknown = set(raw) - SPEC_FIELDS
    if unknown:
        raise Forbidden(f"not allowed in a job: {', '.join(sorted(unknown))} "
                        "(colo starts no privileged jobs, no added capabilities, devices or host namespaces)")
    argv = raw.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
        raise Invalid("missing command: give it after `--`, e.g. colo submit --gpu-mem 1GiB -- python train.py")
    image = raw.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise Invalid("image must be a non-empty name")
    gpus = raw.get("gpus", 1)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or not 0 <= gpus <= 64:
        raise Invalid(f"--gpus must be a whole number from 0 to 64, not {gpus!r}")
    gpu_mem = raw.get("gpu_mem")
    if gpus > 0:
        if gpu_mem in (None, 0):
            raise Invalid("--gpu-mem is required for a GPU job (e.g. --gpu-mem 4GiB), or use --gpus 0")
        try:
            gpu_mem = parse_size(gpu_mem)
        except BadSize as e:
            raise Invalid(str(e)) from None
    else:
        gpu_mem = 0
    env = raw.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise Invalid("env must map names to strings")
    for k in env:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
            raise Invalid(f"malformed environment variable name {k!r}")
        if RESERVED_ENV.match(k):
            raise Forbidden(f"{k} is set by colo itself and cannot be set by a job")
    mounts = []
    raw_mounts = raw.get("mounts") or []
    if not isinstance(raw_mounts, list):
        raise Invalid("mounts must be a list of SRC:DST[:ro]")
    for m in raw_mounts:
        try:
            mount = Mount.parse(m) if isinstance(m, str) else Mount(**m)
        except (TypeError, ValueError) as e:
            raise Invalid(f"malformed mount: {e}") from None
        if not (isinstance(mount.source, str) and isinstance(mount.target, str)
                and isinstance(mount.read_only, bool)):
            raise Invalid("malformed mount: source and target must be paths, read_only true or false")
        mounts.append(check_mount(mount, caller, protected))
    if mounts and image is None:
        raise Invalid("--mount is for container jobs; a process job already sees the host's files")
    workdir = raw.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise Invalid("--workdir must be an absolute path")
    after = raw.get("after") or []
    if not isinstance(after, list) or not all(isinstance(a, int) and not isinstance(a, bool) and 0 < a < 1 << 63
                                              for a in after):
        raise Invalid("--after takes job ids")
    priority = raw.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or not -1000 <= priority <= 1000:
        raise Invalid("--priority must be a whole number from -1000 to 1000")
    name, profile = raw.get("name"), raw.get("profile")
    for label, v in (("--name", name), ("--profile", profile)):
        if v is not None and (not isinstance(v, str) or not NAME.match(v)):
            raise Invalid(f"{label} must be 1-64 letters, digits, '.', '_' or '-'")
    retries = raw.get("retries", 0)
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= 10:
        raise Invalid("retries must be 0 to 10")
    return JobSpec(argv=argv, image=image, name=name, gpu_mem=gpu_mem, gpus=gpus, env=env, mounts=mounts,
                   workdir=workdir, after=after, priority=priority, profile=profile, retries=retries)


def check_mount(m: Mount, caller: Caller, protected: list[Path]) -> Mount:
    if not m.source.startswith("/") or not m.target.startswith("/"):
        raise Invalid(f"mount {m.source}:{m.target}: both paths must be absolute")
    if ".." in Path(m.target).parts or m.target.rstrip("/") in ("", "/opt/colo") or m.target.startswith("/opt/colo/"):
        raise Forbidden(f"mount target {m.target} is not allowed")
    real = Path(os.path.realpath(m.source))  # symlinks and `..` resolved before any check
    if not real.exists():
        raise Invalid(f"mount source {m.source} does not exist")
    for bad in [*(Path(p) for p in FORBIDDEN_SOURCES), *protected]:
        if real == bad or bad in real.parents or (real in bad.parents and caller.uid != 0):
            raise Forbidden(f"mounting {m.source} is not allowed (it holds {bad})")
    if not readable_by(real, caller.uid, caller.groups()):
        raise Forbidden(f"you cannot read {m.source}, so you cannot mount it")
    return Mount(str(real), m.target, m.read_only)
