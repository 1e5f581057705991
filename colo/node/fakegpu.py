"""Simulated NVIDIA GPUs (native/fakegpu) for machines without one.

A state file describes N devices and their live use; a process uses them through the fake
libcuda.so.1 / libnvidia-ml.so.1 when `FakeNode.env` is in its environment. Nothing here is
loaded unless asked for: colo never puts the fake in front of a real driver.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
from pathlib import Path

from colo.node import native
from colo.units import parse_size

GiB = 1024**3
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
