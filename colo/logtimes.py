"""When a job's output lines reached colo, for `colo logs --timestamps/--since`.

A job writes its log file directly (a process job's stdout is the file; a container's output is
copied in as Docker sends it), so its lines carry no times. The daemon notes, at each sample
(`sample_interval`, 1 s by default), how long each running job's log has grown: "AT SIZE" lines
in logs/ID.times beside logs/ID.log. A line's time is then the first moment colo saw the file
hold it: it was written at or before that time, at most one sample earlier. Lines colo has not
noted yet are stamped with the time they are read (a live job) or the job's end (an ended one;
also every line of a job that ran before colo kept these notes).
"""
from __future__ import annotations

import bisect
import os
from pathlib import Path


def times_path(log_path: Path) -> Path:
    return Path(log_path).with_suffix(".times")


def note(log_path: Path, last: int) -> int:
    """Append (now, size) when the log grew past `last`; returns the size seen."""
    import time

    try:
        size = os.stat(log_path).st_size
    except OSError:
        return last
    if size > last:
        # root's own state dir (0711, logs/ not listable): no user chooses this path
        with open(times_path(log_path), "a", encoding="ascii") as f:
            f.write(f"{time.time():.3f} {size}\n")
    return size


def load(log_path: Path) -> tuple[list[int], list[float]]:
    """(sizes, times), by size; a torn last line (a daemon killed mid-write) is skipped."""
    sizes: list[int] = []
    ats: list[float] = []
    try:
        with open(times_path(log_path), encoding="ascii", errors="replace") as f:
            for ln in f:
                parts = ln.split()
                try:
                    at, size = float(parts[0]), int(parts[1])
                except (IndexError, ValueError):
                    continue
                if not sizes or size > sizes[-1]:
                    sizes.append(size)
                    ats.append(at)
    except OSError:
        pass
    return sizes, ats


def stamp(lines: list[bytes], index: tuple[list[int], list[float]], fallback: float) -> list[float]:
    """The time colo first saw each line whole (the file reached past its end), or `fallback`."""
    sizes, ats = index
    out, end = [], 0
    for ln in lines:
        end += len(ln)
        i = bisect.bisect_left(sizes, end)
        out.append(ats[i] if i < len(sizes) else fallback)
    return out
