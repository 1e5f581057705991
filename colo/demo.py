"""`colo demo`: a private daemon on simulated GPUs, a handful of jobs, a summary. Stops cleanly."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import fakegpu, native
from .client import Client, ClientError
from .units import format_duration, format_size

GiB = 1024**3

# name, budget, what colo-burn does, why it is in the demo
JOBS = [
    ("train-a", "10GiB", ["--mem", "8GiB", "--duty", "60", "--seconds", "4"], "fits on a GPU of its own"),
    ("train-b", "10GiB", ["--mem", "8GiB", "--duty", "60", "--seconds", "4"], "fits on the other GPU"),
    ("infer", "4GiB", ["--mem", "3GiB", "--duty", "20", "--seconds", "3"], "fits beside one of them"),
    ("finetune", "12GiB", ["--mem", "10GiB", "--duty", "50", "--seconds", "2"], "must wait for memory"),
    ("greedy", "2GiB", ["--mem", "1GiB", "--over", "4GiB", "--seconds", "1"],
     "tries to pass its budget: refused, keeps running"),
]


def _say(msg: str) -> None:
    print(msg, flush=True)


def run_demo(keep: bool = False) -> int:
    native.ensure_built()
    if shutil.which("nvidia-smi"):
        _say("A real NVIDIA GPU seems present; this demo still uses simulated GPUs. Run the real daemon with "
             "`sudo colo daemon` (or the systemd unit in packaging/) and submit with `colo submit`.")
    root = Path(tempfile.mkdtemp(prefix="colo-demo-"))
    state = root / "fakegpu" / "state"
    state.parent.mkdir()
    os.chmod(state.parent, 0o777)
    fakegpu.create(state, count=2, mem=16 * GiB, name="Colo Simulated GPU")
    sock = root / "colo.sock"
    env = {**os.environ, "COLO_SOCKET": str(sock)}
    env.pop("COLO_FAKEGPU_STATE", None)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "colo", "daemon", "--state-dir", str(root / "state"), "--socket", str(sock),
         "--fake-gpus", str(state)], env=env, stdout=open(root / "daemon.log", "wb"), stderr=subprocess.STDOUT)
    client = Client(sock, timeout=30)
    try:
        hello = _wait_up(client, daemon, root)
        image = _demo_image() if hello["docker_error"] is None else None
        where = f"containers of the local image {image}" if image else "host processes (no Docker engine here)"
        _say(f"colo demo: a private daemon on 2 simulated 16 GiB GPUs; jobs run as {where}.\n")
        ids = {}
        burn = "/opt/colo/native/colo-burn" if image else str(native.path(native.BURN))
        for name, budget, args, why in JOBS:
            spec = {"argv": [burn, *args], "image": image, "name": name, "gpu_mem": budget, "gpus": 1,
                    "workdir": None if image else str(root)}
            job = client.submit(spec)
            ids[job["id"]] = name
            _say(f"  submitted job {job['id']:>2} {name:<9} budget {budget:>5}  ({why})")
        _say("")
        _watch(client, list(ids))
        return _summary(client, list(ids))
    except (ClientError, RuntimeError) as e:
        _say(f"colo demo: {e} (daemon log: {root / 'daemon.log'})")
        keep = True
        return 1
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        if keep:
            _say(f"state kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _wait_up(client: Client, daemon: subprocess.Popen, root: Path) -> dict:
    deadline = time.monotonic() + 30
    while True:
        if daemon.poll() is not None:
            raise RuntimeError(f"the demo daemon exited: {(root / 'daemon.log').read_text()[-500:]}")
        try:
            return client.hello()
        except ClientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _demo_image() -> str | None:
    try:
        import docker

        from .runtimes.image import build_local_image

        return build_local_image(docker.from_env(), "colo/demo:1", with_shell=True)
    except Exception as e:  # noqa: BLE001 - fall back to host processes
        _say(f"(could not build the demo image: {e}; using host processes)")
        return None


def _watch(client: Client, ids: list[int]) -> None:
    seen: dict[int, str] = {}
    t0 = time.monotonic()
    while True:
        jobs = {j["id"]: j for j in client.ls() if j["id"] in ids}
        for i in ids:
            j = jobs[i]
            if seen.get(i) != j["state"]:
                seen[i] = j["state"]
                gpu = f" on GPU{_gpu_index(client, j)}" if j["gpus"] else ""
                _say(f"  [{time.monotonic() - t0:5.1f}s] job {i:>2} {j['name']:<9} {j['state']:<9}{gpu}  "
                     f"{j['reason']}")
        if all(s in ("succeeded", "failed", "cancelled", "lost") for s in seen.values()):
            return
        time.sleep(0.2)


_gpu_cache: dict[str, int] = {}


def _gpu_index(client: Client, j: dict) -> int:
    if not _gpu_cache:
        _gpu_cache.update({g["uuid"]: g["index"] for g in client.gpus()["gpus"]})
    return _gpu_cache.get(j["gpus"][0], -1)


def _summary(client: Client, ids: list[int]) -> int:
    _say("\nSummary")
    ok = True
    for i in ids:
        j = client.show(i)
        waited = (j["started_at"] or j["submitted_at"]) - j["submitted_at"]
        ran = (j["ended_at"] or time.time()) - (j["started_at"] or time.time())
        _say(f"  job {i:>2} {j['name']:<9} {j['state']:<9} budget {format_size(j['budget']):>7}  waited "
             f"{format_duration(waited):>4}  ran {format_duration(ran):>4}  {j['reason']}")
        ok &= j["state"] == "succeeded"
    _say("\nEvery budget held: no GPU ever had more memory promised than it has, and the job that tried to "
         "take more than its budget had only that allocation refused.")
    _say("Next: `colo daemon &` then `colo submit --process --gpu-mem 1GiB -- CMD`; `colo top` to watch.")
    return 0 if ok else 1
