"""Where the compiled parts of colo (native/) live, and building them when run from a checkout."""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

_PKG = Path(__file__).resolve().parent.parent  # the colo package (this is colo/node/)
_REPO_NATIVE = _PKG.parent / "native"
_lock = threading.Lock()
_built = False

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
    global _built
    d = native_dir()
    with _lock:
        if not _built and (_REPO_NATIVE / "Makefile").exists() and d == _REPO_NATIVE / "build":
            r = subprocess.run(["make", "-s", "-C", str(_REPO_NATIVE)], capture_output=True, text=True)
            if r.returncode != 0:
                raise NativeMissing(f"building native/ failed: {r.stderr.strip().splitlines()[-1:]}")
        _built = True
    return d


def path(name: str) -> Path:
    p = native_dir() / name
    if not p.exists():
        raise NativeMissing(f"{p} is not built (run `make -C native` or reinstall colo)")
    return p


def publish(dest_root: Path) -> Path:
    """A world-readable copy of the built files under `dest_root`, named by their content.

    Jobs of every user load the interposer and shim from here (a checkout or venv may sit in a
    private home), and a running job keeps the exact files it started with across upgrades.
    """
    import hashlib
    import shutil

    src = ensure_built()
    files = sorted(p for p in src.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(src)).encode())
        h.update(p.read_bytes())
    dest = dest_root / f"native-{h.hexdigest()[:12]}"
    if dest.is_dir():
        return dest
    tmp = dest_root / f".{dest.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, symlinks=True)
    for p in [tmp, *tmp.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() or os.access(p, os.X_OK) else 0o644)
    os.replace(tmp, dest)
    return dest
