"""Memory a client made the daemon take is given back when it goes. glibc's malloc raises its mmap
threshold each time a large block is freed, so after one flood of large requests the next ones
land in the heap, and a heap with a few live blocks at its top is never trimmed: 1,000 half-sent
1 MiB requests left the daemon 250 MiB larger after they closed. A fixed threshold keeps large
blocks in mmap (returned at free); trim() gives back what the heap freed (on the event loop). No-ops off glibc."""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_AT = 128 << 10  # glibc's own starting threshold, kept fixed
TRIM_EVERY = 2.0  # seconds between trims at most (a trim walks the heap)

_libc = None
_last = 0.0
_pending = False  # a trim is due (call_later)


def _lib():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.mallopt, lib.malloc_trim  # noqa: B018 - glibc has both; musl neither
            _libc = lib
        except (OSError, AttributeError):
            _libc = False
    return _libc


def fix_thresholds() -> None:
    lib = _lib()
    if lib:
        lib.mallopt(M_MMAP_THRESHOLD, MMAP_AT)
        lib.mallopt(M_TRIM_THRESHOLD, 4 * MMAP_AT)


def trim(now: bool = False) -> None:
    """Give freed heap memory back to the system: now, or TRIM_EVERY seconds after the last trim
    (one trim then for everything freed meanwhile, the last of a flood included). now: at once
    whatever the last trim (after work that took far longer than a trim, such as a reply of
    megabytes: the next request must not find it still held)."""
    global _last, _pending
    lib = _lib()
    if not lib or (_pending and not now):
        return
    wait = 0 if now else _last + TRIM_EVERY - time.monotonic()
    if wait <= 0:
        _last = time.monotonic()
        lib.malloc_trim(0)
        return
    _pending = True
    asyncio.get_running_loop().call_later(wait, _later)


def _later() -> None:
    global _pending
    _pending = False
    trim()
