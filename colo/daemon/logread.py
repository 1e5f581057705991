"""A job's log read for `colo logs` without ever holding it whole.

The log is the job's to fill (up to `log_cap`, 256 MiB by default, with no bound when the cap is
0), and a root daemon that read it whole for `--tail 1` held a Python object per line: 700 MiB for
an 8 MB log of empty lines, so one user could take the node's memory. Here --tail and --since find
where to begin by scanning back from the end a block at a time, and the output goes out in pieces
of at most CHUNK bytes (4096 lines an event). Lines are split as bytes.splitlines() splits them
(\\n, \\r, \\r\\n), so the text sent is the same as that of the whole file split at once.
"""
from __future__ import annotations

import asyncio
import bisect
import codecs
import os
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

BLOCK = 1 << 16  # bytes read at a time when scanning back
CHUNK = 1 << 18  # bytes read at a time when sending
LINES = 4096  # lines in one event
_NL, _CR = 0x0A, 0x0D


async def settled(fn: Callable[[], T]) -> T:
    """fn() in a worker thread. A stream whose client goes is cancelled: this then waits for the
    thread to be done with the log's descriptor before the stream's `finally` closes it."""
    task = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise


def starts_before(fd: int, lo: int, hi: int) -> Iterator[int]:
    """Line starts p with lo < p < hi, the last first: p follows a \\n, or a \\r that no \\n follows."""
    b = hi
    while b > lo + 1:
        a = max(lo + 1, b - BLOCK)  # positions a..b-1 looked at; data[a-1 .. b-1] read
        buf = os.pread(fd, b - a + 1, a - 1)
        if len(buf) < b - a + 1:  # the file was cut short meanwhile
            return
        end = len(buf) - 1
        rn, rr = buf.rfind(b"\n", 0, end), buf.rfind(b"\r", 0, end)
        while rn >= 0 or rr >= 0:
            if rn > rr:
                i, rn = rn, buf.rfind(b"\n", 0, rn)
                yield a + i
            else:
                i, rr = rr, buf.rfind(b"\r", 0, rr)
                if buf[i + 1] != _NL:
                    yield a + i
        b = a


def line_start(fd: int, at: int) -> int:
    """Where the line holding byte `at` begins."""
    return next(starts_before(fd, 0, at + 1), 0)


def tail_start(fd: int, lo: int, hi: int, n: int) -> int:
    """Where the last `n` lines of bytes lo..hi begin (lo itself is a line start)."""
    if n <= 0:
        return hi
    for k, p in enumerate(starts_before(fd, lo, hi), 1):
        if k == n:
            return p
    return lo


def since_range(fd: int, size: int, index: tuple[list[int], list[float]], since: float,
                fallback: float) -> tuple[int, int]:
    """Bytes [start, stop) of the lines colo first saw whole at or after `since`, as
    logtimes.stamp() stamps them: by the first noted size at or past a line's end, or `fallback`
    for lines past the last noted size. Noted times only grow, so these lines are one run."""
    sizes, ats = index
    k = bisect.bisect_left(ats, since)  # the first noted time at or after since
    late = fallback >= since  # lines past the last noted size
    if k == len(sizes):  # no noted size is late enough: only lines past the last one may be
        if not late:
            return size, size
        b = sizes[-1] if sizes else 0
        return (line_start(fd, b) if b < size else size), size
    start = 0 if k == 0 else line_start(fd, sizes[k - 1]) if sizes[k - 1] < size else size
    if late:
        return start, size
    last = sizes[-1]  # lines that end past it are stamped `fallback`, too early
    stop = size if last >= size else line_start(fd, last)
    return start, max(start, stop)


def ends_line(fd: int, pos: int) -> bool:
    """Does byte pos-1 end a line (or is pos the start of the file)?"""
    return pos == 0 or os.pread(fd, 1, pos - 1) in (b"\n", b"\r")


def _line_end(fd: int, at: int, stop: int) -> int:
    """Where the line going on at `at` ends (after its break), or `stop`."""
    while at < stop:
        buf = os.pread(fd, min(BLOCK, stop - at), at)
        if not buf:
            return at
        i = min((j for j in (buf.find(b"\n"), buf.find(b"\r")) if j >= 0), default=-1)
        if i >= 0:
            end = at + i + 1
            if buf[i] == _CR and end < stop and os.pread(fd, 1, end) == b"\n":
                end += 1
            return end
        at += len(buf)
    return stop


def decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")("replace")


def pieces(fd: int, start: int, stop: int, index: tuple[list[int], list[float]], fallback: float,
           stamps: bool, dec: codecs.IncrementalDecoder, begun: bool = True) -> Iterator[dict]:
    """Events with bytes [start, stop) of the log: {"data": text}, or with `stamps` {"lines":
    [[at, text], ...]}, `at` the time colo first saw the line whole (logtimes.stamp), None on a
    piece that goes on with a line begun earlier (`begun` False: the first byte does). `dec`
    keeps a character cut at `stop` for the next call."""
    if not stamps:
        pos = start
        while pos < stop:
            buf = os.pread(fd, min(CHUNK, stop - pos), pos)
            if not buf:
                break
            pos += len(buf)
            text = dec.decode(buf)
            if text:
                yield {"data": text}
        return
    sizes, ats = index

    def when(end: int) -> float:
        i = bisect.bisect_left(sizes, end)
        return ats[i] if i < len(sizes) else fallback

    base, carry = start, b""  # carry: bytes from `base` not sent yet (a line not ended in what was read)
    out: list = []
    while True:
        read_to = base + len(carry)
        buf = os.pread(fd, min(CHUNK, stop - read_to), read_to) if read_to < stop else b""
        data = carry + buf
        final = not buf
        if final and not data:
            if out:
                yield {"lines": out}
            return
        cut = len(data)
        if not final:  # keep back the line that may go on in what comes next
            n, r = data.rfind(b"\n"), data.rfind(b"\r", 0, len(data) - 1)  # a last \r may begin \r\n
            cut = max(n, r) + 1
            if cut == 0 and len(data) < CHUNK:
                carry = data
                continue
        if cut == 0:  # one line longer than CHUNK: send what there is, stamped by the line's end
            n = len(data) - 1 if data.endswith(b"\r") else len(data)  # a last \r may end it: read on
            out.append([when(_line_end(fd, base + n, stop)) if begun else None, dec.decode(data[:n])])
            begun, base, carry = False, base + n, data[n:]
        else:
            end = base
            for ln in data[:cut].splitlines(keepends=True):
                end += len(ln)
                out.append([when(end) if begun else None, dec.decode(ln)])
                begun = True
                if len(out) >= LINES:
                    yield {"lines": out}
                    out = []
            base, carry = base + cut, data[cut:]
        if out and (final or len(out) >= LINES):
            yield {"lines": out}
            out = []
        if final:
            if out:
                yield {"lines": out}
            return
