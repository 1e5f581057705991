"""Debian images built here: debootstrap from Debian's package mirror, then `docker import` (no
image can be pulled). Kept in the engine under a label naming what went in, so a later run (or
test) on the same engine reuses it instead of bootstrapping again (2 minutes for bookworm with
python3 on 2 CPUs, 40 s for bullseye unconfigured)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

import docker.errors
import pytest

MIRROR = os.environ.get("COLO_DEBIAN_MIRROR", "http://deb.debian.org/debian")
LABEL = "colo.test.debootstrap"
PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def debian_image(client, suite: str, include: tuple[str, ...] = (), configured: bool = True) -> str:
    """The tag of a minimal Debian `suite` image (minbase, plus `include`). configured=False stops
    after debootstrap's first stage: the packages unpacked, none configured (no dpkg database
    worth using), enough to run the suite's own programs with its own C library."""
    key = f"{suite} {MIRROR} minbase {','.join(include)} {'configured' if configured else 'unpacked'}"
    tag = f"colo-test/debian-{suite}:{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    try:
        if ((client.api.inspect_image(tag).get("Config") or {}).get("Labels") or {}).get(LABEL) == key:
            return tag
    except docker.errors.ImageNotFound:
        pass
    if os.geteuid() != 0 or not shutil.which("debootstrap"):
        pytest.fail(f"building the {suite} image needs root and debootstrap (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix=f"colo-{suite}-") as tmp:
        root = os.path.join(tmp, "root")
        args = ["debootstrap", "--variant=minbase"]
        args += [f"--include={','.join(include)}"] if include else []
        args += [] if configured else ["--foreign"]
        r = subprocess.run([*args, suite, root, MIRROR], capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            pytest.fail(f"debootstrap {suite} from {MIRROR} failed: {(r.stdout + r.stderr).strip()[-1500:]}")
        tar = subprocess.Popen(["tar", "-C", root, "--exclude=./debootstrap", "--exclude=./var/cache/apt/archives/*.deb",
                                "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        repo, _, version = tag.partition(":")
        try:
            client.api.import_image_from_stream(tar.stdout, repository=repo, tag=version,
                                                changes=[f'LABEL {LABEL}="{key}"', f"ENV PATH={PATH_ENV}"])
        finally:
            tar.stdout.close()
            tar.wait()
    return tag
