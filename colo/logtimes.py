"""When a job's output lines reached colo, for `colo logs --timestamps/--since`.

A job writes its log file directly (a process job's stdout is the file; a container's output is
copied in as Docker sends it), so its lines carry no times. The daemon notes, at each sample
(`sample_interval`, 1 s by default), how long each running job's log has grown: "AT SIZE" lines
in logs/ID.times beside logs/ID.log. A line's time is then the first moment colo saw the file
hold it: it was written at or before that time, at most one sample earlier. A reader of a live
job's log that gets to lines colo has not noted yet notes them itself (`cover`) before it
stamps them, so every view of a line (`--timestamps`, `--json`, `--since`, now or later) gives
the one time stored for it, however the reads and the samples fall. Lines of an ended job that
were never noted are stamped with the job's end (also every line of a job that ran before colo
kept these notes).
"""
from __future__ import annotations

import bisect
import os
import time
from pathlib import Path


def times_path(log_path: Path) -> Path:
    return Path(log_path).with_suffix(".times")


def note(log_path: Path, last: int) -> int:
    """Append (now, size) when the log grew past `last`; returns the size seen."""
    try:
        size = os.stat(log_path).st_size
    except OSError:
        return last
    if size > last:
        # root's own state dir (0711, logs/ not listable): no user chooses this path
        with open(times_path(log_path), "a", encoding="ascii") as f:
            f.write(f"{time.time():.3f} {size}\n")
    return size


class Seen:
    """The noted (size, time) pairs of one log, read on from where the last read stopped (a
    `logs -f` reads the notes again for each new piece of output, not the whole file).

    A note counts only when it goes past every note before it in the file: the first note
    to cover a byte fixes its time for good, so two notes written at once (the sampler's and a
    reader's) leave every reader with the same answer."""

    def __init__(self, log_path: Path):
        self.path = times_path(log_path)
        self.sizes: list[int] = []
        self.ats: list[float] = []
        self._read = 0  # bytes of the notes file taken in (whole lines only)

    @property
    def index(self) -> tuple[list[int], list[float]]:
        return self.sizes, self.ats

    def read(self) -> "Seen":
        """Take in the notes written since the last read; a torn last line waits for its end."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._read)
                data = f.read()
        except OSError:
            return self
        whole = data[:data.rfind(b"\n") + 1]
        self._read += len(whole)
        for ln in whole.splitlines():
            parts = ln.split()
            try:
                at, size = float(parts[0]), int(parts[1])
            except (IndexError, ValueError):  # a line torn by a daemon killed mid-write
                continue
            if not self.sizes or size > self.sizes[-1]:
                self.sizes.append(size)
                self.ats.append(at)
        return self

    def cover(self, size: int) -> "Seen":
        """The notes, with the log's first `size` bytes noted as seen now if no note reaches
        that far yet; read back after writing, so that what is answered is what is stored."""
        self.read()
        if size > (self.sizes[-1] if self.sizes else 0):
            try:
                with open(self.path, "a", encoding="ascii") as f:  # one write (O_APPEND): never interleaved
                    f.write(f"{time.time():.3f} {size}\n")
            except OSError:  # (a full disk) lines past the last note are stamped as before: now
                return self
            self.read()
        return self


def load(log_path: Path) -> tuple[list[int], list[float]]:
    """(sizes, times), by size; a torn last line (a daemon killed mid-write) is skipped."""
    return Seen(log_path).read().index


def stamp(lines: list[bytes], index: tuple[list[int], list[float]], fallback: float) -> list[float]:
    """The time colo first saw each line whole (the file reached past its end), or `fallback`."""
    sizes, ats = index
    out, end = [], 0
    for ln in lines:
        end += len(ln)
        i = bisect.bisect_left(sizes, end)
        out.append(ats[i] if i < len(sizes) else fallback)
    return out
