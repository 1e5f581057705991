"""Commands a user types that need no GPU of their own: the no-driver daemon, run-budgeted, doctor."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from harness.daemon import DaemonProc

GiB = 1024**3


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a real driver")
def test_daemon_without_a_driver_runs_cpu_jobs_and_says_why_gpu_jobs_cannot(tmp_path):
    d = DaemonProc(tmp_path).start()  # no --fake-gpus: NVML finds no library
    try:
        r = d.cli("gpus")
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no NVIDIA driver found" in r.stderr
        r = d.cli("submit", "--process", "--gpu-mem", "1GiB", "--", "true")
        assert r.returncode == 1 and "no NVIDIA driver found" in r.stderr
        j = d.submit("--process", "--gpus", "0", "--", "echo", "cpu only")
        assert d.cli("wait", str(j)).returncode == 0
        assert d.cli("logs", str(j)).stdout == "cpu only\n"
    finally:
        d.stop()


def test_run_budgeted_holds_one_command_to_its_budget(fakegpu, native_dir):
    env = {**os.environ, **fakegpu.env}
    burn = str(native_dir / "colo-burn")
    r = subprocess.run([sys.executable, "-m", "colo", "run-budgeted", "--gpu-mem", "1GiB", "--", burn, "--mem",
                        "768MiB", "--over", "512MiB"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "allocated 768MiB" in r.stdout and "refused" in r.stdout
    assert "colo: allocation of 512MiB refused: job budget 1.0GiB" in r.stderr or "refused" in r.stderr
    r = subprocess.run([sys.executable, "-m", "colo", "run-budgeted", "--gpu-mem", "256MiB", "--", burn, "--mem",
                        "512MiB"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 3  # its own allocation failed; the process ended normally with that code
    r = subprocess.run([sys.executable, "-m", "colo", "run-budgeted", "--gpu-mem", "12XB", "--", burn],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "malformed size" in r.stderr


def test_exclusive_gpu_set_to_default_when_configured(tmp_path, fakegpu):
    fakegpu.set_compute_mode(1, "exclusive_process")
    d = DaemonProc(tmp_path, fakegpu.state, {"set_default_compute_mode": True}).start()
    try:
        modes = [g["compute_mode"] for g in d.client.gpus()["gpus"]]
        assert modes == ["default", "default"]
        assert "setting it to DEFAULT" in d.log.read_text()
    finally:
        d.stop()


def test_doctor_reports_each_piece(tmp_path):
    r = subprocess.run([sys.executable, "-m", "colo", "doctor", "--socket", str(tmp_path / "none.sock")],
                       capture_output=True, text=True, timeout=60)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("FAIL") and lines[0].split()[1] == "daemon" and "daemon is not running" in lines[0]
    assert r.returncode == 1  # a check failed: the exit code says so
    assert lines[1] == "this machine:"
    assert [ln.split()[1] for ln in lines[2:]] == ["interposer", "driver", "gating", "devices", "mps", "docker"]
    assert lines[2].startswith("ok") and "preloads cleanly" in lines[2]


def test_doctor_describes_the_daemon_it_reaches_not_only_this_machine(daemon):
    """This machine has no driver and no MPS tools; the daemon runs on simulated GPUs with MPS."""
    r = subprocess.run([sys.executable, "-m", "colo", "doctor"], capture_output=True, text=True, timeout=60,
                       env=daemon.env())
    out = r.stdout
    head, _, local = out.partition("this machine:")
    by = {ln.split()[1]: ln for ln in head.splitlines()[1:]}
    assert by["gpus"].startswith("ok") and "simulated GPUs" in by["gpus"] and "GPU0" in by["gpus"] and "GPU1" in by["gpus"]
    assert by["mps"].startswith("ok") and "MPS clients" in by["mps"], out
    assert "per user: queued 10000" in by["limits"] and "patrol kills after 30 s" in by["limits"]  # the default queue limit
    assert "NVML" in local or "driver" in local  # the local machine's own lines follow
    assert r.returncode == 0, out


def test_the_session_commands_path_imports_no_heavy_module(tmp_path):
    """`colo run --image IMG -- CMD` and `colo shell` (the client until it would connect) take the
    short path: no typer, rich, textual, docker or numpy, whose imports a person would wait for
    before a session's first line (bench/session_bench.py)."""
    probe = ("import sys\nsys.argv = ['colo', 'run', '--image', 'img:1', '--gpus', '0', '--', 'true']\n"
             "from colo.cli.entry import main\ntry:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
             "import colo.cli.attach\n"
             "heavy = ('typer', 'click', 'rich', 'textual', 'numpy', 'docker', 'pynvml', 'colo.cli.app', "
             "'colo.daemon', 'colo.store', 'colo.runtimes')\n"
             "print('loaded:' + ','.join(m for m in heavy if m in sys.modules), code)")
    env = {**os.environ, "COLO_SOCKET": str(tmp_path / "none" / "colo.sock")}  # (nothing answers: it fails there)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "loaded: 1", r.stdout + r.stderr


def test_the_submit_short_path_imports_no_slow_module_and_its_codec_is_json():
    """`colo submit` skips typer, and json, re, pathlib, typing and socket too (bench/cli_bench.py
    times it); the client's codec writes and reads what json does."""
    import json
    from pathlib import Path

    from hypothesis import given, settings, strategies as st

    from colo import protocol

    root = str(Path(__file__).resolve().parent.parent)
    code = (f"import sys; sys.path.insert(0, {root!r})\n"
            "import colo.cli.entry, colo.cli.submitspec, colo.client\n"
            "print(','.join(m for m in ('typer', 'json', 're', 'pathlib', 'typing', 'socket', 'enum') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr  # -S: no site, no editable finder

    values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                          lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids), max_leaves=20)

    @settings(max_examples=100, deadline=None)
    @given(values)
    def same(v):
        text = protocol.dumps(v)
        assert text == json.dumps(v, separators=(",", ":"), default=str)
        assert protocol.loads(text.encode() + b"\n") == json.loads(text)

    same()
    for bad in (b"", b"{", b"{}x", b"[1,]", b" 1 2"):
        with pytest.raises(ValueError):
            protocol.loads(bad)
