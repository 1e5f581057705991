"""Simulated NVIDIA GPUs (native/fakegpu) for machines without one.

A state file describes N devices and their live use; a process uses them through the fake
libcuda.so.1 / libnvidia-ml.so.1 when `FakeNode.env` is in its environment. Nothing here is
loaded unless asked for: colo never puts the fake in front of a real driver.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

from colo.node import native
from colo.units import format_size, parse_size

GiB = 1024**3
MAX_DEVICES = 16  # FG_MAX_DEV in native/fakegpu/fakegpu.h
MODES = ("default", "exclusive_process", "prohibited")


class FakeGpuError(RuntimeError):
    pass


def _ctl(*args: str) -> str:
    r = subprocess.run([str(native.path(native.FAKEGPU_CTL)), *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise FakeGpuError(r.stderr.strip() or f"colo-fakegpu {args[0]} failed ({r.returncode})")
    return r.stdout


def create(path, count: int = 2, mem: int | str = 16 * GiB, name: str = "Colo Simulated GPU",
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

    def set_mps_attribution(self, how: str) -> None:
        """Whose pid NVML's per-process samples give MPS clients' activity: "client" (their own)
        or "server" (their server's, as some real drivers report it)."""
        if how not in ("client", "server"):
            raise ValueError(f"MPS attribution must be client or server, not {how!r}")
        _ctl("mps-attribution", str(self.state), how)

    def uuids(self) -> list[str]:
        return [d["uuid"] for d in self.read()["devices"]]


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
    c.add_argument("--name", default="Colo Simulated GPU")
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
        else:
            node.set_mps_attribution(args.how)
    except (FakeGpuError, native.NativeMissing, ValueError) as e:
        msg = str(e)
        print(msg if msg.startswith("colo-fakegpu") else f"colo-fakegpu: {msg}", file=sys.stderr)
        return 1
    return 0
