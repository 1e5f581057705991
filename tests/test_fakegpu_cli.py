"""`colo-fakegpu` as a user types it, and the demo's closing step on a machine without a GPU."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from colo.cli.demo import next_step
from colo.node import native
from harness.daemon import wait_for

BIN = Path(sys.executable).parent  # the venv's colo and colo-fakegpu


def run(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, env=env, timeout=60)


def test_unknown_options_are_refused_and_make_no_file(tmp_path):
    fg = str(BIN / "colo-fakegpu")
    r = run(fg, "create", "--help", cwd=tmp_path)
    assert r.returncode == 0 and "--count" in r.stdout and "PATH" in r.stdout
    for bad in (["create", "--bogus"], ["create", "gpus", "--bogus", "1"], ["create", "gpus", "--count", "x"],
                ["create", "gpus", "--count", "17"], ["create", "gpus", "--mem", "lots"], ["frobnicate", "gpus"]):
        r = run(fg, *bad, cwd=tmp_path)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("colo-fakegpu"), (bad, r)
    r = run(fg, "show", "missing", cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.splitlines() == ["colo-fakegpu: cannot open missing: No such file or directory"]
    # the C tool behind it, too: a PATH never starts with '-'
    r = run(str(native.ensure_built() / "colo-fakegpu"), "create", "--help", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("usage: colo-fakegpu create PATH")
    assert sorted(os.listdir(tmp_path)) == []
    r = run(fg, "create", "gpus", "--count", "3", "--mem", "4GiB", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("gpus: 3 simulated GPU(s) of 4.0GiB; use them with `colo daemon --fake-gpus gpus`")
    shown = run(fg, "show", "gpus", cwd=tmp_path)
    assert [d["total"] for d in json.loads(shown.stdout)["devices"]] == [4 << 30] * 3


def test_the_demos_next_step_works_without_a_gpu(tmp_path):
    """The commands of the demo's closing line, as printed, with CMD a real command."""
    text = next_step(have_gpu=False)
    start, submit = re.findall(r"`([^`]+)`", text)[:2]
    create, daemon = (c.strip().rstrip("&").strip() for c in start.split("&&"))
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{BIN}:{os.environ['PATH']}",
           # a private daemon: as root the defaults would be the machine's own /run/colo and /var/lib/colo
           "COLO_SOCKET": str(tmp_path / "run" / "colo.sock"), "COLO_STATE_DIR": str(tmp_path / "state")}
    env.pop("COLO_FAKEGPU_STATE", None)
    r = subprocess.run(["bash", "-c", create], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and (tmp_path / ".colo-gpus").exists(), r.stderr
    d = subprocess.Popen(["bash", "-c", f"exec {daemon}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def up():
            assert d.poll() is None, d.stderr.read().decode()
            return run("colo", "gpus", cwd=tmp_path, env=env).returncode == 0
        wait_for(up, 30, "the daemon on simulated GPUs")
        argv = shlex.split(submit.replace("CMD", "sh -c 'echo ran on $CUDA_VISIBLE_DEVICES'"))
        r = run(*argv, cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip()
        assert run("colo", "wait", job, cwd=tmp_path, env=env).returncode == 0
        assert run("colo", "logs", job, cwd=tmp_path, env=env).stdout.startswith("ran on GPU-")
    finally:
        d.terminate()
        d.wait(30)
