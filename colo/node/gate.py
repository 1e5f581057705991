"""The node's gate (docs/gating.md "The gate"): where a process may open the GPUs' devices is decided
by the cgroup it is in, which its user cannot carry away, not only by a group a job holds.

On a gated node the daemon attaches one device program (colo-devcg --gate, native/tools/devcg.c)
to each cgroup2 folder of `gpu_gate_at` (default the cgroup2 root: every process of the node). For
the GPUs' character devices (every minor of their majors: /dev/nvidia*, nvidia-uvm) it refuses
the open to any process but root's and those beneath an allowed folder: colo's own jobs' folder
(`colo-<instance>`, root's: nobody else can put a process there; the MPS control daemons start in
its `mps` folder, so the users' MPS servers are allowed too), and `gpu_gate_allow` (the container
engine's cgroup parent). The daemon's own cgroup is not allowed: an --on-end command, user code,
runs there. A setgid copy of
the GPU group, a `systemd-run --user`, an ssh login: all open from a cgroup of no job, and are
refused there, whatever their groups.

The kernel checks devices at open: a descriptor opened in a job and passed out keeps working. That
is the patrol's to find (patrol_kill_foreign, on by default on a gated node).

The program is called NAME wherever it is: a restarted daemon replaces it (colo's folder may be
made anew, with a new cgroup id; a new state folder is a new instance, whose jobs an earlier
program would refuse). So one gated daemon per node. A daemon that stops leaves its gate: the
node stays shut (its jobs run on in the folder it allows).
"""
from __future__ import annotations

import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import cgroup, native, procs
from .devices import GpuNodes


MPS = "mps"  # colo's folder for MPS control daemons, beside the jobs' (Cgroups.close removes it)


class GateError(RuntimeError):
    pass


@dataclass
class Gate:
    at: list[Path]  # the cgroup2 folders the program is attached to
    allowed: list[Path]  # the folders whose processes may open the GPUs
    rules: list[str]  # c:MAJOR:* for each major of the GPUs' character devices

    def describe(self) -> str:
        return (f"the GPUs' devices ({', '.join(self.rules)}) are refused beneath {', '.join(map(str, self.at))} "
                f"but to root and to {', '.join(map(str, self.allowed))}")


NAME = "colo_gate"  # the program's (15 characters at most, the kernel's limit)


NVIDIA_MAJOR = 195  # the driver's fixed major: nvidiactl, nvidiaN, nvidia-modeset


def rules(nodes: GpuNodes) -> list[str]:
    """Every minor of each major the GPUs' files are character devices of (nvidia-modeset and the
    GPUs added later share 195; on a real node 195 even before the driver made its files, whose
    nvidia-uvm major is then found at the next start); none when the files are plain (a
    simulation without --char)."""
    majors = {n.char[0] for n in nodes.nodes() if n.char is not None}
    if nodes.folder == Path("/dev"):
        majors.add(NVIDIA_MAJOR)
    return [f"c:{m}:*" for m in sorted(majors)]


def plan(cg: cgroup.Cgroups, nodes: GpuNodes, at: list[str] | None, allow: list[str]) -> Gate | None:
    """What the gate would be here; None when there is nothing to gate by cgroup (no character
    devices); GateError when it cannot be had (no cgroup2, no folder of colo's there)."""
    want = rules(nodes)
    if not want:
        return None
    mount = cgroup.v2_mount()
    if mount is None:
        raise GateError("no cgroup2 here: the GPUs are gated by their group alone")
    if cg.contain is None or not cg.v2:
        raise GateError(f"colo's jobs have no cgroup2 folder here ({cg.missing.get('contain', 'none')})")
    allowed = [cg.contain]
    for p in allow:
        d = mount / p.strip("/")
        if d.is_dir() and d != mount and d not in allowed:
            allowed.append(d)
    return Gate([mount / p.strip("/") if p.strip("/") else mount for p in (["/"] if at is None else at)],
                allowed, want)


def apply(gate: Gate) -> None:
    """Attach the gate (replacing an earlier one there); GateError with the reason."""
    mount = cgroup.v2_mount()
    assert mount is not None
    ids = []
    for d in gate.allowed:
        try:
            ids.append(f"{os.stat(d).st_ino}:{len(d.relative_to(mount).parts)}")
        except OSError as e:
            raise GateError(f"cannot read {d}: {e.strerror}") from None
    for d in gate.at:
        try:
            r = subprocess.run([str(native.path(cgroup.DEVCG)), "--gate", str(d), NAME, *ids, "--",
                                *gate.rules], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError, native.NativeMissing) as e:
            raise GateError(f"cannot gate {d}: {e}") from None
        if r.returncode != 0:
            raise GateError(f"cannot gate {d}: {r.stderr.strip() or r.returncode}")


def attached(d: Path) -> list[str] | None:
    """The names of the device programs on cgroup2 folder `d` (root only; None when not readable)."""
    try:
        r = subprocess.run([str(native.path(cgroup.DEVCG)), "--list", str(d)], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError, native.NativeMissing):
        return None
    return r.stdout.split() if r.returncode == 0 else None


def mps_folder(cg: cgroup.Cgroups) -> Path | None:
    """`colo-<instance>/mps`, where MPS control daemons start on a gated node (their servers run as
    the users and open the GPUs); None when it cannot be made (MPS then starts where it did)."""
    if cg.contain is None:
        return None
    d = cg.contain / MPS
    try:
        d.mkdir(exist_ok=True)
    except OSError:
        return None
    return d


def spared(cg: cgroup.Cgroups, allow: list[str]) -> list[tuple[str, str]]:
    """Where a process may hold the GPUs' files open under the gate, as /proc/PID/cgroup names it:
    colo's jobs' folder (and its MPS leaf) and gpu_gate_allow's folders (descriptor_holders)."""
    return ([cg.contain_at] if cg.contain_at else []) + [("", "/" + p.strip("/")) for p in allow]


def setup(cg: cgroup.Cgroups, nodes: GpuNodes, at: list[str] | None, allow: list[str]) -> tuple[bool, str]:
    """The daemon's start on a gated node: (True, what is gated) or (False, why there is no gate)."""
    if at == []:
        return False, "no gate: gpu_gate_at = [] (the group alone gates: a job's user can carry it away)"
    try:
        g = plan(cg, nodes, at, allow)
        if g is None:
            return False, f"no gate: the GPUs' files in {nodes.folder} are not character devices"
        apply(g)
        return True, g.describe()
    except GateError as e:
        return False, f"no gate: {e}"


def _beneath(path: str | None, folder: str) -> bool:
    return path is not None and (folder == "/" or path == folder or path.startswith(folder.rstrip("/") + "/"))


def descriptor_holders(nodes: GpuNodes, spared: list[tuple[str, str]]) -> list[tuple[int, int, int]]:
    """(pid, start, uid) of every process but root's that holds one of the GPUs' files open and is
    beneath none of the `spared` cgroup folders ((hierarchy, path) as /proc/PID/cgroup names
    them: colo's jobs' folder, gpu_gate_allow's). On a gated node such a process holds a descriptor
    opened in a job and handed out (SCM_RIGHTS, pidfd_getfd), or inherited from one: the gate
    checks at open, so this is where it shows. The file is named by what the descriptor's stat
    says (a character device's numbers, a plain file's device and inode), not by its path text,
    which a mount namespace of the user's own could make up."""
    want: set[tuple] = set()
    for n in nodes.nodes():
        try:
            st = os.stat(n.path)
        except OSError:
            continue
        want.add(("c", st.st_rdev) if n.char is not None else ("f", st.st_dev, st.st_ino))
    if not want:
        return []
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        ident = procs.identity(pid)
        if ident is None or ident[1] == 0 or pid == os.getpid():
            continue
        place = cgroup.places(pid)
        if any(_beneath(place.get(key), path) for key, path in spared):
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            key = ("c", st.st_rdev) if stat.S_ISCHR(st.st_mode) else ("f", st.st_dev, st.st_ino)
            if key in want:
                out.append((pid, *ident))
                break
    return out
