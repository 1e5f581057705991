"""A container's output copied into its job's log file while it runs (docker.py's follower, a
thread per container), resuming from a sidecar cursor file after a daemon restart: no line lost,
none written twice."""

from __future__ import annotations

import calendar
import json
import logging
import os
import threading
import time
from pathlib import Path

import docker.errors
import requests
import urllib3

RETRIES = 30  # reconnects of a follower (1 s apart) before it gives up
CURSOR_EVERY = (
    0.25  # seconds between cursor saves while output flows (a stale cursor only costs a re-read)
)

log = logging.getLogger("colo.runtimes.docker")  # the runtime's own (its lines read as they did)


def cursor_path(log_path: Path) -> Path:
    return Path(log_path).with_suffix(".cursor")


def _since(stamp: str) -> int | None:
    """Whole seconds (rounded down) of a Docker log timestamp, for the inclusive `since=` filter."""
    if not stamp:
        return None
    return calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return len(data)


def write_cursor(path: Path, ts: str, n: int, offset: int) -> None:
    tmp = path.with_suffix(".cursor.tmp")
    tmp.write_text(json.dumps({"ts": ts, "n": n, "offset": offset}))
    os.replace(tmp, path)  # atomic: a crash leaves the old cursor or the new one, never half of one


class Follower(threading.Thread):
    """Copies one container's output into its log file, resuming from the cursor file.

    The cursor holds (timestamp of the last written message, how many messages carried exactly
    that timestamp, byte size of the log at that point). On start the log is cut back to that
    size and messages up to that position are skipped, so the log matches Docker's exactly.
    Docker writes log timestamps in a fixed-width UTC form ('2024-05-01T10:00:00.123456789Z'),
    so comparing them as strings orders them in time.
    """

    def __init__(self, api, handle: str, log_path: Path, cap: int = 0, reserve: int = 0):
        super().__init__(name=f"colo-logs-{handle[:12]}", daemon=True)
        self.api, self.handle, self.log_path = api, handle, Path(log_path)
        self.cap, self.reserve = cap, reserve  # as the process shim: bytes kept, free bytes kept on the disk
        self._starved = False
        self.cursor = cursor_path(self.log_path)
        self.error: BaseException | None = None
        self._stream = None
        self._halt = threading.Event()

    def _load(self) -> tuple[str, int, int]:
        try:
            c = json.loads(self.cursor.read_text())
            return str(c["ts"]), int(c["n"]), int(c["offset"])
        except (OSError, ValueError, KeyError, TypeError):
            return "", 0, 0

    def _save(self, ts: str, n: int, offset: int) -> None:
        write_cursor(self.cursor, ts, n, offset)

    def run(self) -> None:
        failures = 0
        while not self._halt.is_set():
            try:
                self._pump()
                return
            except docker.errors.NotFound:
                return  # removed: what was written stays
            except (
                docker.errors.APIError,
                requests.exceptions.RequestException,
                urllib3.exceptions.HTTPError,
                OSError,
            ) as e:
                # The engine restarted or dropped the stream: go on from the cursor, a few times.
                failures += 1
                if failures > RETRIES or self._halt.wait(1.0):
                    self.error = e
                    break
            except Exception as e:  # noqa: BLE001 - a thread must not die silently
                self.error = e
                break
        if self.error is not None and not self._halt.is_set():
            log.warning(
                "output of container %s may be incomplete in %s: %s",
                self.handle[:12],
                self.log_path,
                self.error,
            )

    def _pump(self) -> None:
        ts, n, offset = self._load()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT, 0o640)
        try:
            os.truncate(fd, offset)  # drop what was written after the last cursor save
            os.lseek(fd, offset, os.SEEK_SET)
            follow = True
            while not self._halt.is_set():
                # since= is inclusive and whole seconds here; the exact resume point is found below.
                self._stream = self.api.logs(
                    self.handle,
                    stdout=True,
                    stderr=True,
                    stream=True,
                    follow=follow,
                    timestamps=True,
                    since=_since(ts),
                )
                ts0, n0, equal, past = ts, n, 0, not ts
                last_save = time.monotonic()
                for frame in self._stream:
                    stamp, _, msg = frame.partition(b" ")
                    t = stamp.decode()
                    if not past:
                        # Skip up to the cursor: older stamps, then the first n0 at its stamp.
                        if t < ts0:
                            continue
                        if t == ts0:
                            equal += 1
                            if equal <= n0:
                                continue
                        past = True
                    ts, n = (ts, n + 1) if t == ts else (t, 1)
                    offset += self._write(fd, msg, offset)
                    if time.monotonic() - last_save > CURSOR_EVERY:
                        self._save(ts, n, offset)
                        last_save = time.monotonic()
                self._save(ts, n, offset)
                if not follow:
                    return
                # The follow stream ended: the container stopped (or the connection dropped). A last
                # plain read from the cursor then catches anything a follow could miss at exit.
                follow = self.api.inspect_container(self.handle)["State"]["Running"]
        finally:
            os.close(fd)

    def _write(self, fd: int, msg: bytes, offset: int) -> int:
        """Write under the log cap and the disk reserve; the bytes written."""
        if self.cap and offset >= self.cap:
            return 0  # capped already (the marker is there)
        if self.reserve:
            st = os.fstatvfs(fd)
            if st.f_bavail * st.f_frsize < self.reserve + len(msg):
                if self._starved:
                    return 0
                self._starved = True
                return _write_all(fd, f"\n[colo: output dropped: less than {self.reserve >> 20} MiB free on "
                                      "the state disk]\n".encode())
            if self._starved:
                self._starved = False
                msg = b"[colo: output resumes: the state disk has room again]\n" + msg
        if self.cap and offset + len(msg) > self.cap:
            return _write_all(fd, msg[: self.cap - offset] + f"\n[colo: the log reached its cap of {self.cap} "
                                                            "bytes; further output is dropped]\n".encode())
        return _write_all(fd, msg)

    def stop(self) -> None:
        self._halt.set()
        s = self._stream
        if s is not None:
            try:
                s.close()
            except Exception:  # noqa: BLE001 - a half-dead stream may fail to close; it is going anyway
                pass

