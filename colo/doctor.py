"""`colo doctor`: is each piece colo needs present and working? One line each."""
from __future__ import annotations

import shutil
from pathlib import Path

from . import interposer, native
from .client import Client, ClientError
from .gpu import NoDriver, Nvml


def run_checks(sock: Path | None) -> bool:
    ok = True

    def line(good: bool, what: str, detail: str) -> None:
        nonlocal ok
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'}  {what:<12} {detail}")

    try:
        lib = interposer.library_path()
        problem = interposer.library_problem()
        line(problem is None, "interposer", f"{lib} preloads cleanly" if problem is None else problem)
    except native.NativeMissing as e:
        line(False, "interposer", str(e))
    try:
        nv = Nvml()
        devs = nv.devices()
        cuda = nv.cuda_version()
        line(True, "driver", f"NVIDIA driver {nv.driver_version()}, CUDA {cuda // 1000}.{cuda % 1000 // 10}"
             if cuda else f"NVIDIA driver {nv.driver_version()}")
        line(True, "gpus", ", ".join(f"GPU{d.index} {d.name} ({d.compute_mode})" for d in devs) or "none")
    except NoDriver as e:
        print(f"--    driver       {e}")
    mps = shutil.which("nvidia-cuda-mps-control")
    print(f"{'ok  ' if mps else '--  '}  mps          {mps or 'nvidia-cuda-mps-control not found: jobs run time-sliced'}")
    try:
        import docker

        docker.from_env(timeout=5).ping()
        print("ok    docker       engine reachable")
    except Exception as e:  # noqa: BLE001
        print(f"--    docker       not reachable ({e.__class__.__name__}): only --process jobs")
    try:
        h = Client(sock, timeout=5).hello()
        line(True, "daemon", f"colo {h['version']} answers on {Client(sock).path} (you are {h['user']})")
    except ClientError as e:
        print(f"--    daemon       {e}")
    return ok
