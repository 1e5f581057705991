"""`colo doctor`: is each piece colo needs present and working? One line each."""
from __future__ import annotations

import shutil
from pathlib import Path

from ..node import interposer, native
from ..client import Client, ClientError
from ..node.gpu import NoDriver, Nvml
from ..textsafe import safe


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
    # the daemon runs the jobs: ask it whether container jobs can run, not this user's own
    # reach to the Docker socket (root's, which users are not let into)
    try:
        h = Client(sock, timeout=5).hello()
    except ClientError as e:
        h, daemon_error = None, e
    if h is not None:
        if h.get("docker_error"):
            print(f"--    docker       the daemon has no Docker engine ({safe(h['docker_error'])}): only --process jobs")
        else:
            print("ok    docker       the daemon reaches the Docker engine: container jobs can run")
    else:
        try:
            import docker

            docker.from_env(timeout=5).ping()
            print("ok    docker       engine reachable from here (no daemon to ask)")
        except Exception as e:  # noqa: BLE001
            print(f"--    docker       not reachable from here ({e.__class__.__name__}) and no daemon to ask")
    if h is not None:
        line(True, "daemon", f"colo {h['version']} answers on {Client(sock).path} (you are {safe(h['user'])})")
    else:
        print(f"--    daemon       {safe(str(daemon_error))}")
    return ok
