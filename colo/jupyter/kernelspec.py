"""The kernelspec `colo kernelspec install` writes: an ipykernel command whose kernels Jupyter starts
through the provisioner `colo` (its metadata), each as a colo job with the budget written here."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from ..units import BadSize, format_size, parse_size

PROVISIONER = "colo"  # the entry point's name (pyproject.toml)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # what jupyter_client takes as a kernel's name


class KernelspecError(ValueError):
    """One line for the user."""


def data_dir() -> Path:
    """The user's Jupyter data folder, where `jupyter kernelspec install --user` writes."""
    try:
        from jupyter_core.paths import jupyter_data_dir
    except ImportError:  # the same rule on Linux, without jupyter_core
        if os.environ.get("JUPYTER_DATA_DIR"):
            return Path(os.environ["JUPYTER_DATA_DIR"])
        return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "jupyter"
    return Path(jupyter_data_dir())


def spec(python: str, gpu_mem: str | None, gpus: int, display_name: str | None = None,
         socket: str | None = None) -> dict:
    """kernel.json: `python -m ipykernel_launcher`, interrupted by SIGINT (the `signal` op), started
    by the provisioner `colo` with this budget."""
    config: dict = {"gpus": gpus}
    if gpu_mem and gpus:
        config["gpu_mem"] = gpu_mem
    if socket:
        config["socket"] = socket
    budget = f"{format_size(parse_size(gpu_mem))} GPU" if gpu_mem and gpus else "no GPU"
    return {"argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": display_name or f"Python 3 (colo, {budget})", "language": "python",
            "interrupt_mode": "signal",
            "metadata": {"kernel_provisioner": {"provisioner_name": PROVISIONER, "config": config}}}


def install(name: str = "colo", gpu_mem: str | None = None, gpus: int | None = None, display_name: str | None = None,
            python: str | None = None, prefix: Path | None = None, socket: str | None = None) -> Path:
    """Write the kernelspec NAME for the caller (or under PREFIX/share/jupyter); its folder."""
    if not NAME.fullmatch(name):
        raise KernelspecError(f"malformed kernelspec name {name!r}: 1-64 letters, digits, '.', '_' or '-'")
    try:
        size = parse_size(gpu_mem) if gpu_mem is not None else None
    except BadSize as e:
        raise KernelspecError(str(e)) from None
    gpus = (1 if size else 0) if gpus is None else gpus
    if gpus and not size:
        raise KernelspecError("--gpu-mem is required for kernels with a GPU (e.g. --gpu-mem 4GiB), or use --gpus 0")
    exe = shutil.which(python or "python3")
    if exe is None:
        raise KernelspecError(f"no {python or 'python3'} found: give --python PATH (a Python with ipykernel)")
    exe = os.path.abspath(exe)  # kernels start as jobs: the daemon's PATH is not this one
    try:
        r = subprocess.run([exe, "-c", "import ipykernel"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelspecError(f"cannot run {exe}: {e}") from None
    if r.returncode != 0:
        raise KernelspecError(f"{exe} has no ipykernel: `{exe} -m pip install ipykernel`, or give --python")
    dest = (prefix / "share" / "jupyter" / "kernels" if prefix is not None else data_dir() / "kernels") / name
    try:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "kernel.json").write_text(json.dumps(spec(exe, gpu_mem, gpus, display_name, socket), indent=1) + "\n")
    except OSError as e:
        raise KernelspecError(f"cannot write {dest}: {e.strerror}") from None
    return dest
