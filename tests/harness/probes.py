"""Looks at a running daemon from outside: its memory, its database read-only, how fast `ls` answers."""
from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from colo.client import Client


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def db_ro(state_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{state_dir / 'colo.db'}?mode=ro", uri=True)


class LsProbe(threading.Thread):
    """Times `ls` (all jobs) every `every` seconds until stopped: the daemon's responsiveness."""

    def __init__(self, socket: Path, every: float = 0.05):
        super().__init__(daemon=True)
        self.client, self.every = Client(socket, timeout=30), every
        self.times: list[float] = []
        self.errors: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            t = time.perf_counter()
            try:
                self.client.ls()
                self.times.append(time.perf_counter() - t)
            except Exception as e:  # noqa: BLE001
                self.errors.append(str(e))
            self._halt.wait(self.every)

    def stop(self) -> None:
        self._halt.set()
        self.join(35)
