"""Validation on a real NVIDIA GPU (pytest mark `gpu`; skipped on machines without one).

Each framework runs in its own process under the interposer with a 2 GiB budget and must see
2 GiB as the card's size, get its own out-of-memory error at the budget, and live on.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from colo.node import interposer

pytestmark = pytest.mark.gpu
GiB = 1024**3
BUDGET = 2 * GiB


def budgeted(tmp_path, code: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    ledger = tmp_path / "ledger"
    interposer.create_ledger(ledger, BUDGET)
    env = {**os.environ, **(extra_env or {}),
           **interposer.job_env(BUDGET, str(ledger), str(interposer.library_path()))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_pytorch_sees_the_budget_and_ooms_at_it(tmp_path):
    pytest.importorskip("torch")
    r = budgeted(tmp_path, """
        import torch
        free, total = torch.cuda.mem_get_info()
        print("total", total)
        x = torch.empty(int(1.5 * 2**30), dtype=torch.uint8, device="cuda")
        try:
            y = torch.empty(2**30, dtype=torch.uint8, device="cuda")
            print("no-oom")
        except torch.cuda.OutOfMemoryError:
            print("oom")
        print("alive", float(torch.ones(10, device="cuda").sum()))
    """)
    assert r.returncode == 0, r.stderr
    assert f"total {BUDGET}" in r.stdout and "oom" in r.stdout.split() and "alive 10.0" in r.stdout


def test_pytorch_expandable_segments(tmp_path):
    pytest.importorskip("torch")
    r = budgeted(tmp_path, """
        import torch
        xs = []
        try:
            while True:
                xs.append(torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            print("oom after", len(xs))
        print("alive", float(torch.ones(4, device="cuda").sum()))
    """, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert r.returncode == 0, r.stderr
    n = int(r.stdout.split("oom after")[1].split()[0])
    assert 4 <= n <= 8 and "alive 4.0" in r.stdout  # 2 GiB in 256 MiB steps, less the context's own


@pytest.mark.parametrize("pool", ["default", "async"])
def test_cupy_pools(tmp_path, pool):
    pytest.importorskip("cupy")
    r = budgeted(tmp_path, f"""
        import cupy
        if "{pool}" == "async":
            cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
        free, total = cupy.cuda.runtime.memGetInfo()
        print("total", total)
        a = cupy.empty(int(1.5 * 2**30), dtype=cupy.uint8)
        try:
            b = cupy.empty(2**30, dtype=cupy.uint8)
            print("no-oom")
        except cupy.cuda.memory.OutOfMemoryError:
            print("oom")
        print("alive", int(cupy.ones(3).sum()))
    """)
    assert r.returncode == 0, r.stderr
    assert f"total {BUDGET}" in r.stdout and "oom" in r.stdout.split() and "alive 3" in r.stdout


def test_jax_preallocation_sizes_itself_to_the_budget(tmp_path):
    pytest.importorskip("jax")
    r = budgeted(tmp_path, """
        import jax, jax.numpy as jnp
        x = jnp.ones(1000).block_until_ready()
        stats = jax.devices()[0].memory_stats()
        print("limit", stats["bytes_limit"])
    """)
    assert r.returncode == 0, r.stderr
    limit = int(r.stdout.split("limit")[1].split()[0])
    assert 0.5 * BUDGET <= limit <= BUDGET  # XLA preallocates a fraction of what it sees as the card


def test_mps_control_exists_and_starts(tmp_path):
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None:
        pytest.skip("nvidia-cuda-mps-control is not installed on this GPU machine")
    from colo.node import mps

    m = mps.MpsManager(tmp_path / "mps", ctl)
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        d = m.ensure(uuid if isinstance(uuid, str) else uuid.decode(), 0)
        assert d.health() in ("active", "off")
    finally:
        m.stop_all()


def test_real_mps_serves_an_allowed_uid_through_search_only_and_no_other(other_user):
    """docs/mps.md "Who may reach the daemon": the real daemon's client and the server it starts
    as the client's uid need no more than `--x` on the pipe directory; another uid is refused."""
    import socket
    import tempfile
    from pathlib import Path

    from colo.node import mps, native
    from harness.daemon import as_user
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None or os.geteuid() != 0:
        pytest.skip("needs nvidia-cuda-mps-control and root")
    import pynvml

    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    uuid = uuid if isinstance(uuid, str) else uuid.decode()
    root = Path(tempfile.mkdtemp(prefix="cg", dir="/tmp"))  # short: the socket path must fit
    root.chmod(0o755)
    m = mps.MpsManager(root / "mps", ctl)
    try:
        m.allow(uuid, 0, {other_user.pw_uid})
        d = m.ensure(uuid, 0)
        burn = [str(native.native_dir() / native.BURN), "--mem", "64MiB", "--seconds", "2", "--quiet"]
        env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": uuid, **d.client_env(GiB, None)}
        r = subprocess.run(burn, env=env, user=other_user.pw_uid, group=other_user.pw_gid,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        log = (d.log_dir / "control.log").read_text()
        assert f"from user {other_user.pw_uid}" in log, log[-2000:]  # it ran as an MPS client
        m.keep_only(uuid, set())

        def connect() -> str:
            try:
                socket.socket(socket.AF_UNIX).connect(str(d.pipe_dir / "control"))
                return "ok"
            except OSError as e:
                return type(e).__name__
        assert as_user(other_user, connect) == ("ok", "PermissionError")
    finally:
        m.stop_all()
        shutil.rmtree(root, ignore_errors=True)


def test_gpu_check_passes_on_the_real_driver(tmp_path):
    """The whole check (bench/gpu_check.py, docs/gpu.md); its report says what failed and why."""
    import json
    from pathlib import Path

    check = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
    r = subprocess.run([sys.executable, str(check), str(tmp_path)], capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    bad = {n: (p["status"], p.get("error"), [c for c in p["checks"] if not c["ok"]])
           for n, p in report["parts"].items() if p["status"] not in ("ok", "skipped")}
    assert r.returncode == 0 and not bad, bad
