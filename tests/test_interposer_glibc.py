"""The interposer loads on any glibc from 2.17: read from the built library what it requires of the
dynamic linker (readelf, from binutils, which the C toolchain that builds it comes with)."""
from __future__ import annotations

import re
import subprocess

from colo.node import interposer


def _readelf(*args) -> str:
    return subprocess.run(["readelf", "--wide", *args, str(interposer.library_path())], capture_output=True,
                          text=True, check=True, timeout=60).stdout


def test_only_libc_is_needed():
    # libdl.so.2 and libpthread.so.0 are missing from some images on glibc >= 2.34 (a preload
    # naming them fails every process of the job with exit code 127)
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", _readelf("--dynamic"))
    assert needed == ["libc.so.6"]


def test_no_symbol_version_newer_than_glibc_2_17():
    text = _readelf("--version-info")
    needs = text[text.index(".gnu.version_r"):]
    versions = re.findall(r"Name: (GLIBC_[0-9.]+)", needs)
    assert versions, needs
    newest = max(tuple(map(int, v[len("GLIBC_"):].split("."))) for v in versions)
    assert newest <= (2, 17), (newest, versions)
    # every required version is libc's own (no GLIBC_PRIVATE, nothing from another file)
    assert re.findall(r"File: (\S+)", needs) == ["libc.so.6"]
    assert "GLIBC_PRIVATE" not in needs
