"""The GPUs' device files, who may open them, and what holds a job to its own (docs/gating.md).

The NVIDIA driver's files are /dev/nvidiactl, /dev/nvidia-uvm (and -uvm-tools), /dev/nvidia-modeset
and one /dev/nvidiaN per GPU, N its minor number; a process that cannot open nvidiactl gets no GPU
from CUDA or NVML, and one that cannot open nvidiaN does not see GPU N. The simulated driver keeps
files of the same names in `<state file>.dev` (native/fakegpu), and honours them the same way.

A node is *gated* when no file is open to every user (mode ...0): only root, and the group it is
given to (colo's `gpu_group`, which the root shim adds to GPU jobs), may open them. Each job is
then held to its own GPUs by device rules on its cgroup (colo/node/cgroup.py).
"""
from __future__ import annotations

import grp
import os
import pwd
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

CTL, UVM = "nvidiactl", "nvidia-uvm"
_GPU = re.compile(r"nvidia(\d+)$")
_NAMES = re.compile(r"nvidia(\d+|ctl|-uvm|-uvm-tools|-modeset)$")
DRIVER_INFO = Path("/proc/driver/nvidia/gpus")
DRIVER_PARAMS = Path("/proc/driver/nvidia/params")


@dataclass(frozen=True)
class Node:
    path: Path
    gpu: int | None  # N of nvidiaN (the GPU's minor number); None: nvidiactl, nvidia-uvm...
    char: tuple[int, int] | None  # (major, minor) of a character device; None: a plain file (the simulation's)
    uid: int
    gid: int
    mode: int  # permission bits

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def open_to_all(self) -> bool:
        """Any user may open it read-write, as the driver does (mode o+rw)."""
        return self.mode & 0o006 == 0o006

    def rule(self) -> str:
        """The device rule that names it, `c:MAJOR:MINOR` (what colo-devcg and cgroup.py take)."""
        assert self.char is not None
        return f"c:{self.char[0]}:{self.char[1]}"


def _driver_minors() -> dict[str, int]:
    """GPU UUID -> minor number, from the driver's /proc files (as `Device Minor:` and `GPU UUID:`)."""
    out = {}
    try:
        folders = list(DRIVER_INFO.iterdir())
    except OSError:
        return {}
    for d in folders:
        try:
            text = (d / "information").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        uuid, minor = fields.get("GPU UUID", "").strip(), fields.get("Device Minor", "").strip()
        if uuid and minor.isdigit():
            out[uuid] = int(minor)
    return out


def _fake_minors(state: Path) -> Callable[[], dict[str, int]]:
    def read() -> dict[str, int]:
        from .fakegpu import FakeNode  # the simulated driver numbers its devices by their index

        return {u: i for i, u in enumerate(FakeNode(state).uuids())}
    return read


class GpuNodes:
    """The device files of this node's GPUs: /dev on a real driver, `<state>.dev` of a simulation."""

    def __init__(self, folder: Path, minors: Callable[[], dict[str, int]]):
        self.folder = folder
        self._read_minors = minors
        self._minors: dict[str, int] = {}

    @classmethod
    def of(cls, fake_state: Path | None) -> "GpuNodes":
        if fake_state is None:
            return cls(Path("/dev"), _driver_minors)
        return cls(Path(os.path.realpath(fake_state) + ".dev"), _fake_minors(Path(fake_state)))

    def nodes(self) -> list[Node]:
        """The driver's files here (none when the folder is missing), by name."""
        out = []
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:
            return []
        for name in names:
            if not _NAMES.match(name):
                continue
            try:
                st = os.stat(self.folder / name, follow_symlinks=False)
            except OSError:
                continue
            m = _GPU.match(name)
            char = (os.major(st.st_rdev), os.minor(st.st_rdev)) if stat.S_ISCHR(st.st_mode) else None
            out.append(Node(self.folder / name, int(m.group(1)) if m else None, char, st.st_uid, st.st_gid,
                            stat.S_IMODE(st.st_mode)))
        return out

    def minor(self, uuid: str) -> int | None:
        if uuid not in self._minors:
            self._minors = self._read_minors()  # read again for a GPU not seen yet (a driver reload)
        return self._minors.get(uuid)

    def split(self, uuids: list[str]) -> tuple[list[Node], list[Node]]:
        """(the files a job on these GPUs may open, those it may not): its GPUs' nvidiaN and the
        driver's shared files (nvidiactl, nvidia-uvm...); a job of no GPU opens none of them.
        LookupError for a GPU whose minor number is not known."""
        mine = set()
        for u in uuids:
            m = self.minor(u)
            if m is None:
                raise LookupError(f"the device file of GPU {u} is not known (no minor number for it)")
            mine.add(m)
        allow, deny = [], []
        for n in self.nodes():
            ok = bool(uuids) and (n.gpu is None or n.gpu in mine)
            (allow if ok else deny).append(n)
        return allow, deny

    def deny_rules(self, uuids: list[str]) -> list[str]:
        """Device rules (`c:195:1`) for the character devices a job on these GPUs must not open."""
        return [n.rule() for n in self.split(uuids)[1] if n.char is not None]


@dataclass
class GateStatus:
    gated: bool  # no GPU file is open to every user
    ok: bool  # what colo needs holds: not gated, or gated to the group colo grants its jobs
    detail: str  # one line
    driver: str | None  # what the driver's parameters say, one line (None: no NVIDIA driver here)


def group_id(name: str | None) -> int | None:
    """The gid of `gpu_group` (None: none configured); LookupError naming it when there is no such group."""
    if name is None:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise LookupError(f"gpu_group: no group {name!r} on this node (make it: groupadd {name}; "
                          "docs/gating.md)") from None


def _name(get, ident: int) -> str:
    try:
        return get(ident)[0]
    except KeyError:
        return str(ident)


def driver_params() -> dict[str, str]:
    """The NVIDIA driver's module parameters (DeviceFileUID/GID/Mode, ModifyDeviceFiles), {} without one."""
    try:
        text = DRIVER_PARAMS.read_text()
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}


def gate_status(nodes: GpuNodes, gpu_group: str | None = None) -> GateStatus:
    """Is the node gated, read from its files (and the driver's parameters where there is a driver)?
    `gpu_group`: the group colo grants GPU jobs (its config), to check the files are that group's."""
    found = [n for n in nodes.nodes() if n.gpu is not None or n.name in (CTL, UVM)]
    params = driver_params()
    driver = None
    if params:
        mode = params.get("DeviceFileMode", "")
        driver = (f"driver parameters: DeviceFileUID {params.get('DeviceFileUID', '?')}, DeviceFileGID "
                  f"{params.get('DeviceFileGID', '?')}, DeviceFileMode {oct(int(mode)) if mode.isdigit() else '?'}, "
                  f"ModifyDeviceFiles {params.get('ModifyDeviceFiles', '?')}")
        if (found and not any(n.open_to_all for n in found) and mode.isdigit() and int(mode) & 0o006 == 0o006
                and params.get("ModifyDeviceFiles") == "1"):
            driver += " (the driver makes its files open to all again when it creates them: set the NVreg_ options)"
    if not found:
        return GateStatus(False, gpu_group is None, f"no GPU device files in {nodes.folder}", driver)
    open_ = [n for n in found if n.open_to_all]
    if open_:
        names = ", ".join(n.name for n in open_[:4]) + (f" and {len(open_) - 4} more" if len(open_) > 4 else "")
        return GateStatus(False, gpu_group is None,
                          f"not gated: {names} open to every user ({oct(open_[0].mode)}): a process outside colo "
                          "can use the GPUs (docs/gating.md)", driver)
    groups = sorted({_name(grp.getgrgid, n.gid) for n in found})
    modes = sorted({oct(n.mode) for n in found})
    owners = sorted({_name(pwd.getpwuid, n.uid) for n in found})
    detail = (f"gated: {len(found)} files in {nodes.folder} {'/'.join(modes)} {'/'.join(owners)}:"
              f"{'/'.join(groups)}, none open to every user")
    if gpu_group is None:
        return GateStatus(True, False, detail + "; but colo grants its jobs no group (gpu_group): they cannot "
                                                "open them either", driver)
    if groups != [gpu_group]:
        return GateStatus(True, False, detail + f"; but colo grants its jobs the group {gpu_group}: they cannot "
                                                "open them", driver)
    return GateStatus(True, True, detail + f"; colo's GPU jobs get the group {gpu_group}", driver)
