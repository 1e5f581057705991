"""Simulated NVIDIA GPUs (native/fakegpu) for machines without one.

A state file describes N devices and their live use; a process uses them through the fake
libcuda.so.1 / libnvidia-ml.so.1 when `FakeNode.env` is in its environment. Nothing here is
loaded unless asked for: colo never puts the fake in front of a real driver.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import grp
import os
import stat
import subprocess
import sys
from pathlib import Path

from colo.node import native
from colo.units import format_size, parse_size

GiB = 1024**3
MAX_DEVICES = 16  # FG_MAX_DEV in native/fakegpu/fakegpu.h
MODES = ("default", "exclusive_process", "prohibited")
# Device numbers of the simulated driver's files when made character devices: the real driver's
# 195:N for nvidiaN and 195:255 for nvidiactl; nvidia-uvm (a dynamic major on a real node) gets
# 120:0, a major the kernel keeps for local use and never hands to a driver. With no driver of
# these majors loaded, open() passes the permission and cgroup checks, then fails with ENXIO,
# which the simulated driver counts as opened.
NVIDIA_MAJOR, CTL_MINOR, UVM_MAJOR = 195, 255, 120


class FakeGpuError(RuntimeError):
    pass


def _ctl(*args: str) -> str:
    r = subprocess.run([str(native.path(native.FAKEGPU_CTL)), *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise FakeGpuError(r.stderr.strip() or f"colo-fakegpu {args[0]} failed ({r.returncode})")
    return r.stdout


DEFAULT_NAME = "Colo Simulated GPU"  # what NVML calls a simulated GPU unless told otherwise


def create(path, count: int = 2, mem: int | str = 16 * GiB, name: str = DEFAULT_NAME,
           sms: int = 108, uuids: list[str] | None = None) -> None:
    """Write a fresh state file for `count` idle devices of `mem` bytes each (mode 0666)."""
    args = ["create", str(path), "--count", str(count), "--mem", str(parse_size(mem)),
            "--name", name, "--sms", str(sms)]
    for u in uuids or []:
        args += ["--uuid", u]
    _ctl(*args)


def lib_dir() -> Path:
    return native.native_dir() / native.FAKEGPU_DIR


class FakeNode:
    """A simulated node: its state file, and what a process needs to use it."""

    def __init__(self, state: Path):
        self.state = Path(state)

    @property
    def lib_dir(self) -> Path:
        return lib_dir()

    @property
    def mps_control(self) -> Path:
        return self.lib_dir / "nvidia-cuda-mps-control"

    @property
    def env(self) -> dict[str, str]:
        old = os.environ.get("LD_LIBRARY_PATH")
        return {
            "COLO_FAKEGPU_STATE": str(self.state),
            "LD_LIBRARY_PATH": str(self.lib_dir) + (os.pathsep + old if old else ""),
        }

    def read(self) -> dict:
        """{"devices": [{index, uuid, name, total, used, free, sms, compute_mode, cc, sm_util,
        mem_util, processes: [{pid, uid, used, kind, mps, sm, membw}]}]} with pids as seen here."""
        return json.loads(_ctl("show", str(self.state)))

    def set_compute_mode(self, index: int, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"compute mode must be one of {MODES}, not {mode!r}")
        _ctl("set-compute-mode", str(self.state), str(index), mode)

    def fail_nvml(self, index: int | str, how: str | int = "lost") -> None:
        """Make NVML queries of device `index` ("all": every one) fail: "lost" (GPU is lost),
        "unknown", a numeric NVML code, or "off" to answer again."""
        _ctl("fail-nvml", str(self.state), str(index), str(how))

    def xid(self, index: int, code: int) -> None:
        """An Xid error on device `index` (79: fallen off the bus, 48: double-bit ECC...): NVML's event
        sets registered for Xid critical errors deliver it."""
        _ctl("xid", str(self.state), str(index), str(code))

    def ecc(self, index: int, count: int = 1) -> None:
        """`count` more uncorrectable ECC errors on device `index`; its page retirement is pending then."""
        _ctl("ecc", str(self.state), str(index), str(count))

    def set_mps_attribution(self, how: str) -> None:
        """Whose pid NVML's per-process samples give MPS clients' activity: "client" (their own)
        or "server" (their server's, as some real drivers report it)."""
        if how not in ("client", "server"):
            raise ValueError(f"MPS attribution must be client or server, not {how!r}")
        _ctl("mps-attribution", str(self.state), how)

    def uuids(self) -> list[str]:
        return [d["uuid"] for d in self.read()["devices"]]

    @property
    def node_dir(self) -> Path:
        """The simulated /dev/nvidia* files: `<state>.dev` beside the state file (found through
        its real path, as the driver finds it)."""
        return Path(os.path.realpath(self.state) + ".dev")

    def make_nodes(self, char: bool = False, gid: int | None = None, mode: int = 0o666) -> None:
        """Make the device files again, as an admin gates a real node: root-owned, of group `gid`
        (None: root's), with `mode`; `char`: character devices of the real driver's numbers, so
        that a devices cgroup decides too (root only). Each replaces the old one atomically."""
        count = len(self.read()["devices"])
        numbers = {"nvidiactl": (NVIDIA_MAJOR, CTL_MINOR), "nvidia-uvm": (UVM_MAJOR, 0),
                   **{f"nvidia{i}": (NVIDIA_MAJOR, i) for i in range(count)}}
        d = self.node_dir
        d.mkdir(mode=0o755, exist_ok=True)
        for name, (major, minor) in numbers.items():
            tmp = d / f".{name}.new"
            tmp.unlink(missing_ok=True)
            if char:
                os.mknod(tmp, stat.S_IFCHR | 0o600, os.makedev(major, minor))
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            if gid is not None or os.geteuid() == 0:
                os.chown(tmp, 0 if os.geteuid() == 0 else -1, 0 if gid is None else gid)
            os.chmod(tmp, mode)
            os.replace(tmp, d / name)


def use_fake_nvml(state: Path) -> None:
    """Make the real `pynvml` in this process read the simulated devices of `state`.

    pynvml loads CDLL("libnvidia-ml.so.1"); once a library with that SONAME is loaded, the
    dynamic loader hands it back for the bare name, so preloading the fake is enough.
    """
    os.environ["COLO_FAKEGPU_STATE"] = str(state)
    ctypes.CDLL(str(lib_dir() / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: {message} (see colo-fakegpu --help)\n")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _mode(text: str) -> int:
    try:
        v = int(text, 8)
    except ValueError:
        v = -1
    if not 0 <= v <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0660")
    return v


def _gid(group: str | None) -> int | None:
    if group is None or group.isdigit():
        return None if group is None else int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"no group {group!r}") from None


def _count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_DEVICES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of devices from 1 to {MAX_DEVICES}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="colo-fakegpu", description="Simulated NVIDIA GPUs for trying and testing colo without one.",
                epilog="Example: colo-fakegpu create ~/.colo-gpus --count 2 --mem 16GiB && "
                       "colo daemon --fake-gpus ~/.colo-gpus")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser, metavar="COMMAND")
    c = sub.add_parser("create", help="write a state file of idle devices (mode 0666; its folder made if missing)")
    c.add_argument("path", metavar="PATH")
    c.add_argument("--count", type=_count, default=2, help="devices (default 2)")
    c.add_argument("--mem", type=_size, default=16 * GiB, help="memory of each, e.g. 16GiB (default)")
    c.add_argument("--name", default=DEFAULT_NAME)
    c.add_argument("--sms", type=int, default=108, help="streaming multiprocessors of each (default 108)")
    c.add_argument("--uuid", action="append", default=[], help="a device's UUID (repeat; the rest are made up)")
    s = sub.add_parser("show", help="the devices and their processes, as JSON")
    s.add_argument("path", metavar="PATH")
    m = sub.add_parser("set-compute-mode", help="a device's compute mode")
    m.add_argument("path", metavar="PATH")
    m.add_argument("index", type=int)
    m.add_argument("mode", choices=MODES)
    f = sub.add_parser("fail-nvml", help="make NVML queries of a device fail (lost, unknown, a code) or answer (off)")
    f.add_argument("path", metavar="PATH")
    f.add_argument("index", help="a device's index, or all")
    f.add_argument("how", help="lost, unknown, an NVML code, or off")
    for name, what, number in (("xid", "an Xid error event on a device", "code"),
                               ("ecc", "uncorrectable ECC errors on a device (page retirement pending)", "count")):
        x = sub.add_parser(name, help=what)
        x.add_argument("path", metavar="PATH")
        x.add_argument("index", type=int)
        x.add_argument(number, type=int)
    n = sub.add_parser("nodes", help="make the simulated /dev/nvidia* files again, gated as an admin gates a real "
                                     "node (docs/gating.md)")
    n.add_argument("path", metavar="PATH")
    n.add_argument("--group", help="their group (a name or gid; default root's)")
    n.add_argument("--mode", type=_mode, default=0o666, help="their mode, octal (default 0666: open to all)")
    n.add_argument("--char", action="store_true", help="character devices of the real driver's numbers (195:N, "
                                                       "195:255), so a devices cgroup applies too (needs root)")
    a = sub.add_parser("mps-attribution", help="whose pid NVML's samples give MPS clients' activity")
    a.add_argument("path", metavar="PATH")
    a.add_argument("how", choices=("client", "server"))
    return p


def main(argv: list[str] | None = None) -> int:
    """`colo-fakegpu`: options it does not know are refused (a PATH never starts with '-')."""
    args = _parser().parse_args(argv)
    node = FakeNode(Path(args.path))
    try:
        if args.cmd == "create":
            Path(args.path).parent.mkdir(parents=True, exist_ok=True)
            create(args.path, args.count, args.mem, args.name, args.sms, args.uuid)
            print(f"{args.path}: {args.count} simulated GPU(s) of {format_size(args.mem)}; use them with "
                  f"`colo daemon --fake-gpus {args.path}`")
        elif args.cmd == "show":
            print(json.dumps(node.read(), indent=2))
        elif args.cmd == "set-compute-mode":
            node.set_compute_mode(args.index, args.mode)
        elif args.cmd == "fail-nvml":
            node.fail_nvml(args.index, args.how)
        elif args.cmd == "xid":
            node.xid(args.index, args.code)
        elif args.cmd == "ecc":
            node.ecc(args.index, args.count)
        elif args.cmd == "nodes":
            node.make_nodes(args.char, _gid(args.group), args.mode)
        else:
            node.set_mps_attribution(args.how)
    except OSError as e:
        print(f"colo-fakegpu: {e.strerror}: {e.filename}", file=sys.stderr)
        return 1
    except (FakeGpuError, native.NativeMissing, ValueError) as e:
        msg = str(e)
        print(msg if msg.startswith("colo-fakegpu") else f"colo-fakegpu: {msg}", file=sys.stderr)
        return 1
    return 0
