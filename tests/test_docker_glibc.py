"""Container jobs under the interposer in an image of an older Debian, and jobs whose image cannot
load it: their reason gives the dynamic loader's words, not only an exit code.

Debian 11 (bullseye, glibc 2.31, as Ubuntu 20.04's) is the oldest suite that Debian's mirror
reachable here serves (stretch and buster have moved to archive.debian.org, out of reach)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from colo.node import native
from colo.runtimes import preload
from colo.runtimes.image import build_image_of
from debian_util import debian_image

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def bullseye(docker_client):
    return debian_image(docker_client, "bullseye", configured=False)


def test_gpu_container_job_on_glibc_2_31_runs_under_the_interposer(daemon, bullseye):
    """Needs the interposer to ask no symbol newer than GLIBC_2.17 (branch `interposer`)."""
    j = daemon.submit("--image", bullseye, "--gpu-mem", "256MiB", "--", "sh", "-c",
                      "ls /lib/x86_64-linux-gnu/libc-2.*.so; grep -q libcolo-interpose /proc/$$/maps && echo loaded")
    rc = daemon.cli("wait", str(j)).returncode
    job = daemon.job(j)
    assert rc == 0, job["reason"]
    assert daemon.cli("logs", str(j), check=True).stdout.split() == ["/lib/x86_64-linux-gnu/libc-2.31.so", "loaded"]


def test_a_musl_program_fails_with_the_loaders_reason(daemon, docker_client, tmp_path):
    """An Alpine-like image: musl's loader cannot load colo's interposer (a glibc library)."""
    if not shutil.which("musl-gcc"):
        (pytest.fail if os.environ.get("CI") else pytest.skip)("needs musl-gcc (apt-get install musl-tools)")
    src = tmp_path / "hello.c"
    src.write_text('#include <stdio.h>\nint main(void) { puts("musl ran"); return 0; }\n')
    subprocess.run(["musl-gcc", "-O2", "-o", str(tmp_path / "hello"), str(src)], check=True, timeout=120)
    loader = Path("/lib/ld-musl-x86_64.so.1")
    image = build_image_of(docker_client, "colo-test/musl:1", {"/usr/bin/hello": tmp_path / "hello",
                                                               str(loader): loader})
    j = daemon.submit("--image", image, "--gpu-mem", "256MiB", "--", "/usr/bin/hello")
    assert daemon.cli("wait", str(j)).returncode == 127
    reason = daemon.job(j)["reason"]
    assert re.fullmatch(r"exited with code 127; colo's interposer cannot load in this image \(a musl C library\?\): "
                        rf"Error relocating /opt/colo/native/{native.INTERPOSER}: \S+: symbol not found", reason), reason
    # without a GPU there is no interposer to load: the same program runs
    j = daemon.submit("--image", image, "--gpus", "0", "--", "/usr/bin/hello")
    assert daemon.cli("wait", str(j)).returncode == 0 and daemon.job(j)["reason"] == "exited with code 0"


def test_a_preload_the_loader_ignored_is_named(tmp_path):
    """glibc runs the program on when the preloaded file cannot be opened: the job ran unbudgeted."""
    log = tmp_path / "log"
    with open(log, "wb") as f:
        subprocess.run(["/bin/echo", "ran"], stdout=f, stderr=f, check=True,
                       env={"LD_PRELOAD": f"/opt/colo/gone/{native.INTERPOSER}"})
    assert preload.note(log).startswith("colo's interposer was not loaded, so the job ran without its GPU budget "
                                        f"held (ERROR: ld.so: object '/opt/colo/gone/{native.INTERPOSER}' from "
                                        "LD_PRELOAD cannot be preloaded")
    log.write_text("ran\n")
    assert preload.note(log) == ""
