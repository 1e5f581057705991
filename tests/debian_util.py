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
from pathlib import Path

import docker.errors
import pytest

MIRROR = os.environ.get("COLO_DEBIAN_MIRROR", "http://deb.debian.org/debian")
LABEL = "colo.test.debootstrap"
PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REPO = Path(__file__).resolve().parent.parent
# The image the package is installed into (tests/test_package.py in Docker, tests/test_systemd.py
# booted with systemd-nspawn): the package's Depends as apt would add them, and systemd to boot.
# One image for both, so a bare CI machine bootstraps it once (~2.5 min).
PACKAGE_IMAGE_INCLUDE = ("python3", "procps", "systemd", "systemd-sysv", "dbus")


def clone_head(tmp_path: Path) -> Path:
    """A clean clone of this repository at its HEAD (what CI tests: committed work only)."""
    dest = tmp_path / "clone"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(REPO), str(dest)], check=True, timeout=120)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", head], check=True, timeout=120)
    return dest


def build_package(tmp_path: Path) -> tuple[Path, Path]:
    """packaging/build-deb.sh in a clean clone of HEAD: (the .deb, the wheel) in tmp_path/out."""
    out = tmp_path / "out"
    # a maintainer with a real mail host, as a release sets it (the default, @localhost, is for local builds)
    env = {**os.environ, "COLO_DEB_MAINTAINER": "colo maintainers <colo-maintainers@example.org>"}
    r = subprocess.run([str(clone_head(tmp_path) / "packaging" / "build-deb.sh"), str(out)], capture_output=True,
                       text=True, timeout=900, env=env)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    deb, whl = (Path(p) for p in r.stdout.split())
    return deb, whl


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
