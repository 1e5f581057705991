"""A cgroup of its own for every process job: what contains it, and its optional CPU and memory limits.

Each job's leaf is `<base>/colo-<instance>/job-<ID>` in every hierarchy colo uses, where <base> is
the daemon's own cgroup there (under systemd with `Delegate=yes`, the unit's; when the daemon sits
in a `supervisor` leaf, as `DelegateSubgroup=supervisor` puts it, that leaf's parent).

Two layouts are supported:
- pure cgroup v2 (`/sys/fs/cgroup` is cgroup2): containment and the cpu and memory controllers
  in one tree. Controllers can only be handed down through cgroups that hold no processes, so
  a daemon in a non-root cgroup first moves itself into a `supervisor` leaf.
- hybrid (cgroup2 at `/sys/fs/cgroup/unified`, controllers on v1 hierarchies): the v2 leaf
  contains the job (cgroup.kill, cgroup.events); limits go to the v1 `cpu` and `memory` leaves.
Device rules (a job opens only the GPUs it was given, docs/gating.md) go to the v1 `devices` leaf
where that controller is mounted, else to the v2 leaf as a device program (native/tools/devcg.c).
Where neither exists (or the daemon is not root), jobs run without a cgroup: the shim, a child
subreaper, still ends every descendant; --cpus/--mem are refused with the reason.

Which job a process belongs to is read from the FULL path of its cgroup, compared with the exact
folder colo made (`Cgroups.paths`; for a container, the engine's own path of it): on a systemd
host every user owns a delegated subtree (user@UID.service) and can make a folder named
colo-<instance>/job-<N> there, so a name matched anywhere in the path would let a user's process
be blamed on someone else's job. colo's folders are root's: nobody else can put a process there.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import native

SUPERVISOR = "supervisor"
CPU_PERIOD = 100_000  # microseconds
DEVCG = "colo-devcg"  # native/tools/devcg.c
ONEND = "onend-"  # the leaf of a job's --on-end command: onend-<ID>, under the job's limits


class CgroupError(RuntimeError):
    pass


def places(pid: int | str) -> dict[str, str]:
    """A process's cgroup in each hierarchy, as /proc/PID/cgroup names it: {hierarchy: path}, the
    hierarchy being the line's controller field ("" for cgroup v2, "pids", "cpu,cpuacct"...)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read(1 << 16).splitlines()
    except (OSError, ValueError):
        return {}
    out = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            out[parts[1]] = parts[2]
    return out


def owner(place: dict[str, str], owners: dict[tuple[str, str], int]) -> int | None:
    """The job whose exact cgroup folder (`owners`: (hierarchy, path) -> job) holds a process at
    `place` (places()), at its top or beneath it; None when it is in none of them."""
    for key, path in place.items():
        while path and path != "/":
            job = owners.get((key, path))
            if job is not None:
                return job
            path = path.rsplit("/", 1)[0]
    return None


def v2_mount() -> Path | None:
    """Where cgroup v2 is mounted (/sys/fs/cgroup on a pure v2 host, /sys/fs/cgroup/unified on a
    hybrid one), or None."""
    return _mounts()[0]


def _mounts() -> tuple[Path | None, dict[str, Path]]:
    """(the cgroup2 mount, {v1 controller: its mount}) from /proc/self/mountinfo."""
    unified, v1 = None, {}
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None, {}
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 5 or len(rparts) < 3:
            continue
        point, fstype, opts = Path(parts[4].replace("\\040", " ")), rparts[0], rparts[2].split(",")
        if fstype == "cgroup2" and unified is None:
            unified = point
        elif fstype == "cgroup":
            for c in ("cpu", "memory", "pids", "freezer", "devices"):
                if c in opts:
                    v1.setdefault(c, point)
    return unified, v1


def _own(pid: int | str = "self") -> tuple[str | None, dict[str, str]]:
    """This process's cgroup path in v2 and in each v1 hierarchy, from /proc/PID/cgroup."""
    v2, v1 = None, {}
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None, {}
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and ctrls == "":
            v2 = path
        for c in ctrls.split(","):
            v1[c] = path
    return v2, v1


def _base(mount: Path, path: str) -> Path:
    rel = path.strip("/")
    if rel.rsplit("/", 1)[-1] == SUPERVISOR:
        rel = rel.rsplit("/", 1)[0] if "/" in rel else ""
    return mount / rel if rel else mount


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


@dataclass
class Cgroups:
    """The cgroups of one daemon's jobs. `contain` is where a job is watched and killed (v2, or a v1
    hierarchy); `limits` maps "cpu"/"memory" to the tree that takes that limit; `missing` says why
    a limit cannot be had here."""
    instance: str
    contain: Path | None = None  # colo-<instance> in the tree that contains jobs
    v2: bool = False  # contain is cgroup v2 (cgroup.kill, cgroup.events)
    # contain as /proc/PID/cgroup names it: (its hierarchy's controller field, its path there)
    contain_at: tuple[str, str] | None = None
    limits: dict[str, Path] = field(default_factory=dict)
    limit_v2: dict[str, bool] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    device_bpf: bool = False  # device rules go to the v2 leaf as a program (no v1 devices controller)

    @classmethod
    def setup(cls, instance: str) -> "Cgroups":
        """Find the layout and make this daemon's folders; degrade (saying why) where not possible."""
        cg = cls(instance)
        name = f"colo-{instance}"
        if os.geteuid() != 0:
            why = "the daemon is not root"
            cg.missing = {"cpu": why, "memory": why, "contain": why, "devices": why}
            return cg
        unified, v1 = _mounts()
        own2, own1 = _own()
        if unified is not None and own2 is not None:
            base = _base(unified, own2)
            want = {"cpu", "memory", "pids"} & set(_read(base / "cgroup.controllers").split())
            if want and base != unified:
                try:
                    cg._leave_for_leaf(own2, base)
                except OSError as e:
                    for c in want:
                        cg.missing[c] = f"cannot move the daemon into {base / SUPERVISOR}: {e.strerror}"
                    want = set()
            try:
                (base / name).mkdir(exist_ok=True)
                cg.contain, cg.v2 = base / name, True
                cg.contain_at = ("", _within(unified, base / name))
            except OSError as e:
                cg.missing["contain"] = f"cannot make {base / name}: {e.strerror}"
                want = set()
            for c in sorted(want):
                try:
                    _enable(base, c)
                    _enable(base / name, c)
                    cg.limits[c], cg.limit_v2[c] = base / name, True
                except OSError as e:
                    cg.missing[c] = f"cannot hand the {c} controller down from {base}: {e.strerror}"
        for c in ("cpu", "memory", "pids"):
            if c in cg.limits:
                continue
            if c in v1 and c in own1:
                d = _base(v1[c], own1[c]) / name
                try:
                    d.mkdir(exist_ok=True)
                    cg.limits[c], cg.limit_v2[c] = d, False
                    cg.missing.pop(c, None)
                except OSError as e:
                    cg.missing[c] = f"cannot make {d}: {e.strerror}"
                continue
            cg.missing.setdefault(c, f"no {c} cgroup controller is available to colo here")
        if cg.contain is None:  # no cgroup v2: a v1 hierarchy contains (a kill loop over cgroup.procs)
            for c in ("pids", "freezer", "memory"):
                if c in v1 and c in own1:
                    d = _base(v1[c], own1[c]) / name
                    try:
                        d.mkdir(exist_ok=True)
                        cg.contain = d
                        key = next((k for k in places("self") if c in k.split(",")), c)
                        cg.contain_at = (key, _within(v1[c], d))
                        cg.missing.pop("contain", None)
                        break
                    except OSError:
                        continue
        cg._setup_devices(v1, own1)
        return cg

    def _setup_devices(self, v1: dict[str, Path], own1: dict[str, str]) -> None:
        """Where device rules go: the v1 `devices` controller (hybrid layouts, where the system's
        own rules live), else a device program on the v2 leaf when this kernel loads one."""
        name = f"colo-{self.instance}"
        if "devices" in v1 and "devices" in own1:
            d = _base(v1["devices"], own1["devices"]) / name
            try:
                d.mkdir(exist_ok=True)
                self.limits["devices"], self.limit_v2["devices"] = d, False
                return
            except OSError as e:
                self.missing["devices"] = f"cannot make {d}: {e.strerror}"
                return
        if self.contain is None or not self.v2:
            self.missing.setdefault("devices", "no devices controller and no cgroup v2 for colo here")
            return
        why = _devcg_check()
        if why is None:
            self.device_bpf = True
        else:
            self.missing["devices"] = why

    def restrict_devices(self, job_id: int, deny: list[str], leaf: str | None = None) -> None:
        """Refuse the job the devices `deny` names (`c:195:1`: /dev/nvidia1) before anything of
        it runs; CgroupError when this host has no way to (missing["devices"] says why). `leaf`:
        another leaf of the job's (its --on-end command's)."""
        if not deny:
            return
        leaf = leaf or f"job-{job_id}"
        try:
            if "devices" in self.limits:
                for rule in deny:
                    kind, major, minor = rule.split(":")
                    _write(self.limits["devices"] / leaf / "devices.deny", f"{kind} {major}:{minor} rwm")
                return
            if self.device_bpf and self.contain is not None:
                r = subprocess.run([str(native.path(DEVCG)), str(self.contain / leaf), *deny], capture_output=True,
                                   text=True, timeout=30)
                if r.returncode != 0:
                    raise CgroupError(f"cannot hold the job to its GPUs: {r.stderr.strip() or r.returncode}")
                return
        except OSError as e:
            raise CgroupError(f"cannot hold the job to its GPUs: {e.strerror}") from None
        raise CgroupError(f"cannot hold the job to its GPUs: {self.missing.get('devices', 'no device rules here')}")

    @staticmethod
    def _leave_for_leaf(own2: str, base: Path) -> None:
        """cgroup v2 hands controllers down only through cgroups without processes: leave the
        delegated cgroup for a leaf of our own (what systemd's DelegateSubgroup= would do)."""
        if own2.rstrip("/").endswith("/" + SUPERVISOR):
            return
        leaf = base / SUPERVISOR
        leaf.mkdir(exist_ok=True)
        _write(leaf / "cgroup.procs", "0")

    # per job ----------------------------------------------------------------------------------
    def dirs(self, job_id: int) -> list[Path]:
        """Every leaf of this job, the containing one first (the shim kills and watches that one)."""
        out = [self.contain / f"job-{job_id}"] if self.contain is not None else []
        for c in ("cpu", "memory", "pids", "devices"):
            d = self.limits.get(c)
            if d is not None and d / f"job-{job_id}" not in out:
                out.append(d / f"job-{job_id}")
        return out

    def paths(self, job_id: int) -> dict[str, str]:
        """Where the job's processes are, as /proc/PID/cgroup names it: {hierarchy: the exact path
        of its leaf}, the folder colo made (root's); {} without a cgroup."""
        if self.contain_at is None:
            return {}
        key, path = self.contain_at
        return {key: f"{path.rstrip('/')}/job-{job_id}"}

    def create(self, job_id: int, cpus: float | None = None, mem: int | None = None,
               tasks: int | None = None, leaf: str | None = None) -> list[Path]:
        """Make the job's leaves with its limits; CgroupError when a limit cannot be had here.
        `tasks` (pids.max) is kept where the pids controller is and skipped where it is not (every
        job has one by default: `missing["pids"]` says why; colo doctor shows it). `leaf`: another
        leaf under the job's limits (an --on-end command's), made beside the job's."""
        for what, want in (("cpu", cpus), ("memory", mem)):
            if want and what not in self.limits:
                flag = "--cpus" if what == "cpu" else "--mem"
                raise CgroupError(f"{flag} cannot be enforced here: {self.missing.get(what, 'no controller')}")
        leaf = leaf or f"job-{job_id}"
        dirs = [d.parent / leaf for d in self.dirs(job_id)]
        for d in dirs:
            d.mkdir(exist_ok=True)
        try:
            if tasks and "pids" in self.limits:
                _write(self.limits["pids"] / leaf / "pids.max", str(int(tasks)))
            if cpus:
                d = self.limits["cpu"] / leaf
                quota = max(1000, int(cpus * CPU_PERIOD))
                if self.limit_v2["cpu"]:
                    _write(d / "cpu.max", f"{quota} {CPU_PERIOD}")
                else:
                    _write(d / "cpu.cfs_period_us", str(CPU_PERIOD))
                    _write(d / "cpu.cfs_quota_us", str(quota))
            if mem:
                d = self.limits["memory"] / leaf
                if self.limit_v2["memory"]:
                    _write(d / "memory.max", str(int(mem)))
                    try:
                        _write(d / "memory.swap.max", "0")  # the limit is on memory, not memory + swap
                    except OSError:
                        pass
                else:
                    _write(d / "memory.limit_in_bytes", str(int(mem)))
                    try:
                        _write(d / "memory.memsw.limit_in_bytes", str(int(mem)))
                    except OSError:
                        pass
        except OSError as e:
            for d in dirs:
                try:
                    d.rmdir()
                except OSError:
                    pass
            raise CgroupError(f"cannot set the job's limits: {e.strerror}") from None
        return dirs

    def pids(self, job_id: int) -> list[int]:
        if self.contain is None:
            return []
        try:
            return [int(x) for x in _read(self.contain / f"job-{job_id}" / "cgroup.procs").split()]
        except (OSError, ValueError):
            return []

    def signal(self, job_id: int, sig: int) -> None:
        for pid in self.pids(job_id):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self, job_id: int, timeout: float = 30.0) -> bool:
        """SIGKILL everything in the job (setsid children, double forks); True once it is empty."""
        if self.contain is None:
            return True
        d = self.contain / f"job-{job_id}"
        deadline = time.monotonic() + timeout
        while True:
            if self.v2:
                try:
                    _write(d / "cgroup.kill", "1")
                except FileNotFoundError:
                    return True  # gone: nothing left
                except OSError:
                    self.signal(job_id, signal.SIGKILL)  # a kernel before 5.14
            else:
                self.signal(job_id, signal.SIGKILL)
            if not self.pids(job_id):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def empty(self, job_id: int) -> bool:
        return not self.pids(job_id)

    def remove(self, job_id: int) -> None:
        for d in self.dirs(job_id):
            try:
                d.rmdir()
            except OSError:
                pass

    def sweep(self, keep: set[int]) -> None:
        """Empty leaves of jobs that are no longer open (ended while the daemon was away)."""
        roots = {self.contain, *self.limits.values()} - {None}
        for root in roots:
            try:
                names = os.listdir(root)
            except OSError:
                continue
            for n in names:
                if (n.startswith("job-") and n[4:].isdigit() and int(n[4:]) not in keep
                        or n.startswith(ONEND)):  # (an --on-end command's, left by a daemon that stopped)
                    try:
                        (root / n).rmdir()
                    except OSError:
                        pass

    def close(self) -> None:
        """The daemon's own folders, when no job is left in them (jobs outlive a daemon stop)."""
        if self.contain is not None:  # the MPS control daemons' (colo/node/gate.py), when they are gone
            try:
                (self.contain / "mps").rmdir()
            except OSError:
                pass
        for root in {self.contain, *self.limits.values()} - {None}:
            try:
                root.rmdir()
            except OSError:
                pass


def _within(mount: Path, d: Path) -> str:
    """The path of folder `d` inside the hierarchy mounted at `mount`, as /proc/PID/cgroup says it."""
    rel = d.relative_to(mount).as_posix()
    return "/" if rel == "." else "/" + rel


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def device_rules_here() -> tuple[bool, str]:
    """Whether jobs can be held to their own GPUs here, and how (for `colo doctor`; changes nothing)."""
    unified, v1 = _mounts()
    if "devices" in v1:
        return True, f"per job in the cgroup v1 devices controller ({v1['devices']})"
    if unified is None:
        return False, "no devices controller and no cgroup v2: jobs cannot be held to their own GPUs"
    if os.geteuid() != 0:
        return True, f"per job by a device program on cgroup v2 ({unified}); whether the kernel loads one is seen as root"
    why = _devcg_check()
    return (True, f"per job by a device program on cgroup v2 ({unified})") if why is None else (False, why)


def _devcg_check() -> str | None:
    """None when this kernel loads a device program for colo-devcg, else why not."""
    try:
        r = subprocess.run([str(native.path(DEVCG)), "--check"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError, native.NativeMissing) as e:
        return f"no device program: {e}"
    return None if r.returncode == 0 else f"no device program on cgroup v2: {r.stderr.strip()}"


def _enable(parent: Path, ctrl: str) -> None:
    if ctrl not in _read(parent / "cgroup.subtree_control").split():
        _write(parent / "cgroup.subtree_control", f"+{ctrl}")
