"""Processes colo did not start: who one is, and killing exactly that one.

A pid alone names a process only until it exits; the number may then be given to another. So a
process is named by (pid, start time, real uid), and a kill goes through a pidfd opened first and
checked against that name afterwards: the signal reaches the process that was looked at or none.
"""
from __future__ import annotations

import os
import signal


def identity(pid: int) -> tuple[int, int] | None:
    """(start time in clock ticks since boot, real uid) of a live process, or None."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read(4096)
        with open(f"/proc/{int(pid)}/status", "rb") as f:
            status = f.read(8192)
    except (OSError, ValueError):
        return None
    try:
        # fields after the command name (which may hold spaces and parentheses): state is 3rd,
        # starttime the 22nd of the whole line
        start = int(stat[stat.rindex(b")") + 2:].split()[19])
        uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith(b"Uid:"))
    except (ValueError, IndexError, StopIteration):
        return None
    return start, uid


def kill_exact(pid: int, start: int, uid: int) -> bool:
    """SIGKILL the process `pid` if it is still the one that started at `start` as `uid`; True when
    the signal was sent."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone (or a kernel before 5.3: then nothing is killed)
        return False
    try:
        if identity(pid) != (start, uid):  # the pidfd holds the process: a check after it is final
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
