"""Where the compiled parts of colo (native/) live, and building them when run from a checkout."""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

_PKG = Path(__file__).resolve().parent
_REPO_NATIVE = _PKG.parent / "native"
_lock = threading.Lock()

INTERPOSER = "libcolo-interpose.so"
BURN = "colo-burn"
FAKEGPU_DIR = "fakegpu"  # holds libcuda.so.1, libnvidia-ml.so.1, nvidia-cuda-mps-control
FAKEGPU_CTL = "colo-fakegpu"


class NativeMissing(RuntimeError):
    pass


def native_dir() -> Path:
    """The folder with the built native files (COLO_NATIVE_DIR, the wheel's copy, or the checkout's build)."""
    env = os.environ.get("COLO_NATIVE_DIR")
    if env:
        return Path(env)
    packaged = _PKG / "_native"
    if packaged.is_dir():
        return packaged
    return _REPO_NATIVE / "build"


def ensure_built() -> Path:
    """Build native/ from a checkout if its outputs are missing; return the build folder."""
    d = native_dir()
    with _lock:
        if not (d / INTERPOSER).exists() and (_REPO_NATIVE / "Makefile").exists() and d == _REPO_NATIVE / "build":
            r = subprocess.run(["make", "-s", "-C", str(_REPO_NATIVE)], capture_output=True, text=True)
            if r.returncode != 0:
                raise NativeMissing(f"building native/ failed: {r.stderr.strip().splitlines()[-1:]}")
    return d


def path(name: str) -> Path:
    p = native_dir() / name
    if not p.exists():
        raise NativeMissing(f"{p} is not built (run `make -C native` or reinstall colo)")
    return p
