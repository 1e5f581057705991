"""What a submitter may ask for. Everything a job gets beyond this is colo's own doing."""
from __future__ import annotations

import grp
import os
import pwd
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..jobs import JobSpec, Mount
from ..protocol import short
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


def by_admin(owner: str, by: str | None) -> bool:
    """A hold or pause set by someone other than the job's owner: an admin's (only the owner and
    admins may set one), which only an admin lifts (`colo release`, `colo resume`)."""
    return by is not None and by != owner


def stopped_text(owner: str, by: str, what: str, undo: str) -> str:
    """Who holds (`what` "held") or paused a job, as its owner and everyone sees it: an admin's
    says so, and that only an admin may undo it."""
    if by_admin(owner, by):
        return f"{what} by {by}, an admin (only an admin may {undo})"
    return f"{what} by {by} ({undo})"


def lift_refusal(job_id: int, owner: str, by: str, caller: Caller, admin_group: str | None, what: str) -> str | None:
    """Why `caller` may not lift a hold or pause set by `by` (an admin's), or None."""
    if by_admin(owner, by) and not is_admin(caller, admin_group):
        return f"job {job_id} was {what} by {by}, an admin: only an admin may undo it"
    return None


def takes_over(owner: str, by: str | None, caller: Caller) -> bool:
    """A hold or pause by `caller` of a job already held or paused by `by`: an admin's replaces its
    owner's own (so that the owner can no longer lift it); anything else changes nothing."""
    return by is not None and not by_admin(owner, by) and caller.user != owner


# What of another user's spec `colo history` shows (as ls does: its command, name, GPUs, budget,
# priority, profile, array), these blanked: environments, mounts, paths and commands may hold
# secrets (a token in an --on-end command, a path that names a project).
PRIVATE_SPEC = {"env": {}, "mounts": [], "workdir": None, "on_end": None, "output": None, "error": None,
                "mail_user": None, "mail_type": None}


MAX_TASKS = 1 << 22  # Linux's PID_MAX_LIMIT: more tasks than a node can have at all
SPEC_FIELDS = {"argv", "image", "name", "gpu_mem", "gpus", "env", "mounts", "workdir", "after", "after_any",
               "after_fail", "priority", "profile", "retries", "grow", "no_suspend", "cpus", "mem", "time", "gpu_ids", "gpu_type",
               "array", "interactive", "hold", "begin", "output", "error", "on_end", "mail_type", "mail_user", "tasks"}
# colo's own plumbing: a job that could set these could escape its budget or reach MPS.
# NVIDIA_*: what the NVIDIA container runtime's hook reads to hand a container devices (GPUs, MIG
# capabilities, IMEX channels, GDS/MOFED/NVSwitch/GDRCopy devices); others (NVIDIA_TF32_OVERRIDE) are the job's.
RESERVED_ENV = re.compile(r"^(LD_PRELOAD|LD_AUDIT|LD_LIBRARY_PATH|COLO_.*|CUDA_MPS_.*|CUDA_VISIBLE_DEVICES|"
                          r"NVIDIA_VISIBLE_DEVICES|NVIDIA_DRIVER_CAPABILITIES|NVIDIA_MIG_CONFIG_DEVICES|"
                          r"NVIDIA_MIG_MONITOR_DEVICES|NVIDIA_IMEX_CHANNELS|NVIDIA_GDS|NVIDIA_MOFED|NVIDIA_NVSWITCH|"
                          r"NVIDIA_GDRCOPY|GPU_DEVICE_ORDINAL)$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
FORBIDDEN_SOURCES = ("/var/run/docker.sock", "/run/docker.sock", "/run/containerd", "/proc", "/sys", "/dev")


# Limits on what one job may ask for (README "Who may do what"): a spec is at most ~200 KiB, so a
# queue of them stays small in the store and in the daemon's memory.
MAX_ARGV = 4096            # arguments
MAX_ARGV_BYTES = 64 << 10  # all arguments together, UTF-8
MAX_ENV = 256              # variables
MAX_ENV_NAME = 128         # bytes
MAX_ENV_BYTES = 64 << 10   # all names and values together
MAX_MOUNTS = 16
MAX_PATH = 1024            # bytes: mount source and target, workdir
MAX_IMAGE = 255            # characters of an image reference
MAX_AFTER = 1000           # jobs one of --after, --after-any, --after-fail may name (an array's id: its tasks)
MAX_GPU_MEM = 1 << 50      # 1 PiB per GPU: more is a typo
MAX_SIZE_TEXT = 32         # "4GiB"
MAX_ARRAY_TASKS = 1000     # tasks one --array may make (Slurm's default MaxArraySize is 1001)
MAX_ARRAY_INDEX = 1_000_000
MAX_ARRAY_TEXT = 256       # characters of an --array
MAX_GPU_IDS = 64
MAX_ON_END = 4096          # bytes of an --on-end command
MAIL_TYPES = frozenset({"END", "FAIL", "ALL", "NONE"})
MAIL_USER = re.compile(r"^[A-Za-z0-9._%+-]{1,64}(@[A-Za-z0-9.-]{1,190})?$")
OUT_KEYS = frozenset("jAaxu%")  # what --output/--error may hold after a % (JobSpec.out_path)
GPU_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._+-]{0,63}$")
IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _utf8(label: str, v: str) -> int:
    """Bytes of a user's string; NUL (exec and the kernel stop there) and lone surrogates refused:
    JSON's \\udcXX escapes, bytes a client could not decode (submit and edit both come here)."""
    if "\0" in v:
        raise Invalid("NUL characters are not allowed in a job")
    try:
        return len(v.encode())
    except UnicodeEncodeError:
        raise Invalid(f"{label} holds text that is not UTF-8 (lone surrogates): colo carries commands "
                      "as UTF-8 text") from None


def _path(label: str, v: Any) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise Invalid(f"{label} must be an absolute path")
    if _utf8(label, v) > MAX_PATH:
        raise Invalid(f"{label} is longer than {MAX_PATH} bytes")
    return v


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _gpu_mem(v: Any, gpus: int) -> int:
    """Bytes per GPU: a whole number of bytes, or a size such as "4GiB" (never true, 1.5, [1])."""
    if v is None or (v == 0 and _int(v)):
        if gpus:
            raise Invalid("--gpu-mem is required for a GPU job (e.g. --gpu-mem 4GiB), or use --gpus 0")
        return 0
    if isinstance(v, str) and len(v) <= MAX_SIZE_TEXT:
        try:
            v = parse_size(v)
        except BadSize as e:
            raise Invalid(str(e)) from None
    if not _int(v):
        raise Invalid(f"--gpu-mem must be a whole number of bytes or a size such as 4GiB, not {short(v)}")
    if not 0 < v <= MAX_GPU_MEM:
        raise Invalid(f"--gpu-mem must be from 1 byte to 1PiB, not {short(v)}")
    return v if gpus else 0


def _argv(argv: Any) -> list[str]:
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
        raise Invalid("missing command: give it after `--`, e.g. colo submit --gpu-mem 1GiB -- python train.py")
    if len(argv) > MAX_ARGV:
        raise Invalid(f"the command has {len(argv)} arguments; at most {MAX_ARGV}")
    if sum(_utf8("the command", a) + 1 for a in argv) > MAX_ARGV_BYTES:
        raise Invalid(f"the command is longer than {MAX_ARGV_BYTES // 1024} KiB")
    if len(argv[0].encode()) > MAX_PATH * 4:
        # a path at most (PATH_MAX); runc quotes it in its error, and one past its 64 KiB pipe hung
        # the container's create in the Docker engine for good
        raise Invalid(f"the program name is longer than {MAX_PATH * 4} bytes")
    return argv


def _env(env: Any) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise Invalid("env must map names to strings")
    if len(env) > MAX_ENV:
        raise Invalid(f"env has {len(env)} variables; at most {MAX_ENV}")
    total = 0
    for k, v in env.items():
        n = _utf8("env", k)
        if n > MAX_ENV_NAME:
            raise Invalid(f"environment variable name {short(k)} is longer than {MAX_ENV_NAME} bytes")
        if not ENV_NAME.fullmatch(k):
            raise Invalid(f"malformed environment variable name {short(k)}")
        if RESERVED_ENV.match(k):
            raise Forbidden(f"{k} is set by colo itself and cannot be set by a job")
        total += n + _utf8("env", v) + 2
    if total > MAX_ENV_BYTES:
        raise Invalid(f"env is {total // 1024} KiB; at most {MAX_ENV_BYTES // 1024} KiB in all")
    return env


def check_spec(raw: Any, caller: Caller, protected: list[Path]) -> JobSpec:
    """A JobSpec from what the client sent, or Invalid/Forbidden with one line saying why.

    Every field has a type and a size limit. Mount sources are checked here by name only; the
    daemon then opens them as the caller (colo/daemon/pin.py)."""
    if not isinstance(raw, dict):
        raise Invalid("spec must be an object")
    unknown = set(raw) - SPEC_FIELDS
    if unknown:
        raise Forbidden(f"not allowed in a job: {', '.join(short(u, 30) for u in sorted(map(str, unknown))[:5])} "
                        "(colo starts no privileged jobs, no added capabilities, devices or host namespaces)")
    argv = _argv(raw.get("argv"))
    image = raw.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise Invalid("image must be a non-empty name")
    if image is not None and (len(image) > MAX_IMAGE or not IMAGE.fullmatch(image)):
        raise Invalid(f"malformed image name {short(image)}")
    gpus = raw.get("gpus", 1)
    if not _int(gpus) or not 0 <= gpus <= 64:
        raise Invalid(f"--gpus must be a whole number from 0 to 64, not {short(gpus)}")
    gpu_mem = _gpu_mem(raw.get("gpu_mem"), gpus)
    env = _env(raw.get("env"))
    mounts = []
    raw_mounts = raw.get("mounts") or []
    if not isinstance(raw_mounts, list):
        raise Invalid("mounts must be a list of SRC:DST[:ro]")
    if len(raw_mounts) > MAX_MOUNTS:
        raise Invalid(f"{len(raw_mounts)} mounts; at most {MAX_MOUNTS}")
    for m in raw_mounts:
        if isinstance(m, str) and _utf8("mount", m) > 2 * MAX_PATH + 4:  # SRC:DST:ro
            raise Invalid(f"mount is longer than {2 * MAX_PATH + 4} bytes")
        try:
            mount = Mount.parse(m) if isinstance(m, str) else Mount(**m)
        except (TypeError, ValueError) as e:
            raise Invalid(f"malformed mount: {short(str(e), 120)}") from None
        if not (isinstance(mount.source, str) and isinstance(mount.target, str)
                and isinstance(mount.read_only, bool)):
            raise Invalid("malformed mount: source and target must be paths, read_only true or false")
        mounts.append(check_mount(mount, caller, protected))
    if mounts and image is None:
        raise Invalid("--mount is for container jobs; a process job already sees the host's files")
    workdir = raw.get("workdir")
    if workdir is not None:
        workdir = _path("--workdir", workdir)
    deps = {}
    for key in ("after", "after_any", "after_fail"):
        ids = deps[key] = raw.get(key) or []
        if not isinstance(ids, list) or not all(_int(a) and 0 < a < 1 << 63 for a in ids):
            raise Invalid(f"--{key.replace('_', '-')} takes job ids, ARRAY_INDEX (12_3) or names")
        if len(ids) > MAX_AFTER:
            raise Invalid(f"--{key.replace('_', '-')} names {len(ids):,} jobs; at most {MAX_AFTER:,} "
                          "(an array's tasks counted)")
    priority = raw.get("priority", 0)
    if not _int(priority) or not -1000 <= priority <= 1000:
        raise Invalid("--priority must be a whole number from -1000 to 1000")
    name, profile = raw.get("name"), raw.get("profile")
    for label, v in (("--name", name), ("--profile", profile)):
        if v is not None and (not isinstance(v, str) or not NAME.fullmatch(v)):
            raise Invalid(f"{label} must be 1-64 letters, digits, '.', '_' or '-'")
    grow, interactive, no_suspend = raw.get("grow", False), raw.get("interactive", False), raw.get("no_suspend", False)
    for label, v in (("grow", grow), ("interactive", interactive), ("no_suspend", no_suspend)):
        if not isinstance(v, bool):
            raise Invalid(f"{label} must be true or false")
    retries = raw.get("retries", 0)
    if not _int(retries) or not 0 <= retries <= 10:
        raise Invalid("retries must be 0 to 10")
    cpus = raw.get("cpus")
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float))
                             or not 0.01 <= cpus <= 4096):
        raise Invalid(f"--cpus must be a number of cores from 0.01 to 4096, not {cpus!r}")
    mem = raw.get("mem")
    if mem is not None:
        try:
            mem = parse_size(mem)
        except BadSize as e:
            raise Invalid(f"--mem: {e}") from None
        if mem < 4 << 20:
            raise Invalid("--mem must be at least 4MiB")
    tasks = raw.get("tasks")
    if tasks is not None and (not _int(tasks) or not 1 <= tasks <= MAX_TASKS):
        raise Invalid(f"--tasks must be a number of processes and threads from 1 to {MAX_TASKS}, not {tasks!r}")
    limit = raw.get("time")
    if limit is not None:
        limit = parse_time(limit)
    gpu_ids, gpu_type = _gpu_filter(raw.get("gpu_ids"), raw.get("gpu_type"), gpus)
    if not isinstance(raw.get("hold", False), (bool, type(None))):
        raise Invalid("hold must be true or false")
    return JobSpec(argv=argv, image=image, name=name, gpu_mem=gpu_mem, gpus=gpus, env=env, mounts=mounts,
                   workdir=workdir, **deps, priority=priority, profile=profile, retries=retries,
                   grow=grow, cpus=float(cpus) if cpus is not None else None, mem=mem, tasks=tasks, time=limit,
                   gpu_ids=gpu_ids, gpu_type=gpu_type, interactive=interactive, no_suspend=no_suspend, begin=_begin(raw.get("begin")),
                   **_outputs(raw, image), **_on_end(raw))


def _begin(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e11:
        raise Invalid(f"--begin must be a time (seconds since the epoch), not {short(v)}")
    return float(v)


def _outputs(raw: dict, image: Any) -> dict:
    """--output/--error: absolute paths (the client makes them so), Slurm's % replacements only;
    for process jobs, whose output colo-shim also hands to a writer running as the user."""
    out = {}
    for key in ("output", "error"):
        v = raw.get(key)
        if v is None:
            continue
        flag = f"--{key}"
        v = _path(flag, v)
        i = v.find("%")
        while i >= 0:
            if i + 1 >= len(v) or v[i + 1] not in OUT_KEYS:
                raise Invalid(f"{flag} {short(v, 80)}: {v[i:i + 2]!r} is not a replacement colo makes (%j the job "
                              "id, %A the array's, %a the task's index, %x the name, %u the user, %% a %)")
            i = v.find("%", i + 2)
        out[key] = v
    if out and image is not None:
        raise Invalid("--output and --error are for process jobs (a container's output: colo logs ID > FILE)")
    return out


def _on_end(raw: dict) -> dict:
    cmd, kind, to = raw.get("on_end"), raw.get("mail_type"), raw.get("mail_user")
    if cmd is not None and (not isinstance(cmd, str) or not cmd.strip() or _utf8("--on-end", cmd) > MAX_ON_END):
        raise Invalid(f"--on-end takes a shell command of 1 to {MAX_ON_END} bytes")
    if kind is not None:
        if not isinstance(kind, str) or not set(kind.upper().split(",")) <= MAIL_TYPES:
            raise Invalid(f"--mail-type takes END, FAIL, ALL or NONE, not {short(kind)}")
        kind = kind.upper()
    if to is not None and (not isinstance(to, str) or not MAIL_USER.fullmatch(to)):
        raise Invalid(f"--mail-user takes an address (user or user@host), not {short(to)}")
    if to is not None and kind is None:
        raise Invalid("--mail-user says where --mail-type mails go: give --mail-type END, FAIL or ALL too")
    return {"on_end": cmd, "mail_type": None if kind == "NONE" else kind, "mail_user": to}


def _gpu_filter(ids: Any, kind: Any, gpus: int) -> tuple[list[int], str | None]:
    """--gpu-id (indices, as `colo gpus` numbers them) and --gpu-type (part of the GPU's name)."""
    ids = [] if ids is None else ids
    if not isinstance(ids, list) or len(ids) > MAX_GPU_IDS or not all(_int(i) and 0 <= i < MAX_GPU_IDS for i in ids):
        raise Invalid(f"--gpu-id takes up to {MAX_GPU_IDS} GPU indices from 0 to {MAX_GPU_IDS - 1} (see colo gpus)")
    if len(set(ids)) != len(ids):
        raise Invalid("--gpu-id names a GPU twice")
    if kind is not None and (not isinstance(kind, str) or not GPU_TYPE.fullmatch(kind)):
        raise Invalid(f"--gpu-type must be 1-64 letters, digits, spaces, '.', '_', '+' or '-' (part of a GPU's "
                      f"name, e.g. A100), not {short(kind)}")
    if (ids or kind) and not gpus:
        raise Invalid("--gpu-id and --gpu-type choose GPUs: they do not apply to a job with --gpus 0")
    if ids and len(ids) < gpus:
        raise Invalid(f"--gpus {gpus} but --gpu-id allows only {len(ids)} GPU(s)")
    return sorted(ids), kind


_ARRAY_ITEM = re.compile(r"^(\d{1,9})(?:-(\d{1,9})(?::(\d{1,9}))?)?$")


def parse_array(raw: Any) -> tuple[list[int], int | None]:
    """--array as Slurm reads it: `0-9`, `0-9:2` (a step), `1,3,5`, mixed (`0-3,8`), with `%N` at the
    end for at most N tasks running at once. (task indices ascending, N or None). The count is
    worked out before anything is expanded, so `0-999999999` costs nothing to refuse."""
    if not isinstance(raw, str) or not raw.strip():
        raise Invalid("--array takes indices such as 0-9, 0-9:2, 1,3,5 or 0-15%4")
    if len(raw) > MAX_ARRAY_TEXT:
        raise Invalid(f"--array is longer than {MAX_ARRAY_TEXT} characters")
    text, pct, lim = raw.strip().partition("%")
    limit = None
    if pct:
        if not lim.isdigit() or len(lim) > 9 or int(lim) < 1:
            raise Invalid(f"malformed --array {short(raw)}: %N needs a whole number of tasks, 1 or more")
        limit = int(lim)
    ranges, total = [], 0
    for item in text.split(","):
        m = _ARRAY_ITEM.match(item.strip())
        if not m:
            raise Invalid(f"malformed --array {short(raw)}: use indices such as 0-9, 0-9:2, 1,3,5 or 0-15%4")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        step = int(m.group(3)) if m.group(3) is not None else 1
        if b < a or step < 1:
            raise Invalid(f"malformed --array {short(raw)}: a range goes up (0-9) and a step is 1 or more")
        if b > MAX_ARRAY_INDEX:
            raise Invalid(f"--array index {b} is above {MAX_ARRAY_INDEX}, the largest colo takes")
        total += (b - a) // step + 1
        if total > MAX_ARRAY_TASKS:
            raise Invalid(f"--array {short(raw)} makes more than {MAX_ARRAY_TASKS} tasks, the most one array may "
                          "have here; split it, or submit fewer")
        ranges.append((a, b, step))
    indices = sorted({i for a, b, step in ranges for i in range(a, b + 1, step)})
    return indices, limit


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_UNIT = re.compile(r"^(\d+)([smhd])$")


def parse_time(raw: Any) -> int:
    """--time in seconds, read as Slurm reads it: MIN, MIN:SEC, H:MIN:SEC, D-H, D-H:MIN, D-H:MIN:SEC
    (a bare number is minutes); also 90s, 10m, 2h, 1d. A whole number in a raw request is seconds."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        secs = raw
    elif isinstance(raw, str) and (m := _UNIT.match(raw.strip())):
        secs = int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    elif isinstance(raw, str) and (m := _TIME.match(raw.strip())):
        days, a, b, c = m.groups()
        if days is not None:  # D-H[:M[:S]]
            secs = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
        elif c is not None:  # H:M:S
            secs = int(a) * 3600 + int(b) * 60 + int(c)
        elif b is not None:  # M:S
            secs = int(a) * 60 + int(b)
        else:  # M
            secs = int(a) * 60
    else:
        raise Invalid(f"malformed --time {raw!r}: use minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]] or 90s/10m/2h/1d")
    if not 1 <= secs <= 366 * 86400:
        raise Invalid("--time must be from 1 second to 366 days")
    return secs


def forbidden_source(path: str, caller: Caller, protected: list[Path]) -> str | None:
    """What `path` (absolute, normalised) would expose that no job may mount, or None."""
    real = Path(path)
    for bad in [*(Path(p) for p in FORBIDDEN_SOURCES), *protected]:
        if real == bad or bad in real.parents or (real in bad.parents and caller.uid != 0):
            return str(bad)
    return None


def check_mount(m: Mount, caller: Caller, protected: list[Path]) -> Mount:
    """A mount by its names alone: absolute paths, no `..`, nothing colo or the host must keep.

    The source is not looked at here: the daemon opens it as the caller, following no symlink,
    and mounts what it opened (pin.py)."""
    source, target = _path("mount source", m.source), _path("mount target", m.target)
    if ".." in Path(target).parts:
        raise Forbidden(f"mount target {short(target, 200)} is not allowed")
    # as Docker will read it (it cleans the path): /opt//colo and /opt/./colo are /opt/colo
    target = "/" + "/".join(p for p in target.split("/") if p and p != ".")
    if target == "/" or target == "/opt/colo" or target.startswith("/opt/colo/"):
        raise Forbidden(f"mount target {short(m.target, 200)} is not allowed")
    if ".." in source.split("/"):
        raise Invalid(f"mount source {short(source, 200)}: '..' is not allowed; name the folder itself")
    source = "/" + "/".join(p for p in source.split("/") if p and p != ".")
    bad = forbidden_source(source, caller, protected)
    if bad is not None:
        raise Forbidden(f"mounting {short(m.source, 200)} is not allowed (it holds {bad})")
    return Mount(source, target, m.read_only)  # the cleaned names
