"""Why a job's processes ran without colo's interposer, in the dynamic loader's own words.

A GPU job's processes load the interposer by LD_PRELOAD. Where it cannot be loaded (an image
whose C library lacks a symbol version it needs, a musl image, a 32-bit program), the
loader says so on the job's stderr, and the program either ends at once (code 127) or runs on
without it, its budget not held. colo reads those lines back from the end of the job's log so
that the job's reason says so. A static binary loads nothing: no loader, no line, nothing to tell.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..node.native import INTERPOSER

TAIL = 64 * 1024  # the loader's lines come first, and a failed start writes little after them


def note(log_path: Path) -> str:
    """What the loader said about the interposer in this log ("" when nothing)."""
    text = _tail(Path(log_path))
    for line in text.splitlines():
        line = line.strip()
        if INTERPOSER in line:
            if "cannot be preloaded" in line:  # glibc: the program ran on without it
                return f"colo's interposer was not loaded, so the job ran without its GPU budget held ({line})"
            m = re.search(r"version `(GLIBC_[0-9.]+)' not found", line)
            if m:
                return (f"colo's interposer cannot load in this image: its C library lacks {m.group(1)} "
                        f"({line})")
            if line.startswith("Error ") or "symbol not found" in line:  # musl's loader
                return f"colo's interposer cannot load in this image (a musl C library?): {line}"
            if "error" in line.lower():
                return f"colo's interposer cannot load in this image: {line}"
    return ""


def _tail(path: Path) -> str:
    """The last TAIL bytes of a job's log (root's, in the root-only logs/ folder; opened without
    following a link all the same)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, TAIL, max(0, size - TAIL)).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)
