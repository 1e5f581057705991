"""The listening socket's accept loop, which stays usable at the daemon's descriptor limit.

asyncio's own loop, at EMFILE, logs a traceback and stops accepting for a second; clients then
queue in the backlog until it is full, and root's own `colo` cannot connect. Here one descriptor
is kept in reserve: at the limit it is given up to accept a waiting client, which is served when
it is root or an admin and otherwise told the daemon is busy and closed, and the reserve is taken
back; accepting then pauses, 10 ms doubling to a second while the limit lasts (the log says so
once: colo/daemon/logflood.py counts the rest)."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import struct
from typing import Callable

from .. import protocol

log = logging.getLogger("colo")
BATCH = 64  # connections accepted per wake-up before others on the loop get a turn
AT_LIMIT_BATCH = 16  # waiting clients answered through the reserve per pause
MAX_PAUSE = 1.0
OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
BUSY = protocol.error("the colo daemon is out of file descriptors; try again shortly", protocol.UNAVAILABLE)


def peer_uid(conn: socket.socket) -> int:
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]


def _spare() -> int | None:
    try:
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


class Acceptor:
    """Accepts on `sock` and hands each connection to `serve`; `privileged(uid)` says who is served
    through the reserve at the limit."""

    def __init__(self, sock: socket.socket, serve: Callable[[socket.socket], None],
                 privileged: Callable[[int], bool]):
        self.sock, self.serve, self.privileged = sock, serve, privileged
        self.loop = asyncio.get_running_loop()
        self.reserve = _spare()
        self.pause = 0.0
        self.paused = False
        self.at_limit = 0  # times the limit was met (for tests and `hello`)
        sock.setblocking(False)

    def start(self) -> None:
        self.paused = False
        if self.reserve is None:
            self.reserve = _spare()
        self.loop.add_reader(self.sock.fileno(), self._ready)

    def close(self) -> None:
        if not self.paused:
            self.loop.remove_reader(self.sock.fileno())
        if self.reserve is not None:
            os.close(self.reserve)
            self.reserve = None

    def _ready(self) -> None:
        for _ in range(BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                self.pause = 0.0
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno in OUT_OF:
                    self._at_limit(e)
                else:
                    log.error("accepting a connection failed: %s", e)
                return
            self.serve(conn)

    def _at_limit(self, e: OSError) -> None:
        self.at_limit += 1
        log.warning("out of descriptors (%s): waiting clients are told the daemon is busy (root and admins "
                    "are served) and accepting pauses", e.strerror)
        for _ in range(AT_LIMIT_BATCH):
            if self.reserve is None:
                self.reserve = _spare()
                if self.reserve is None:
                    break  # nothing freed since: the pause below is all there is to do
            os.close(self.reserve)
            self.reserve = None
            try:
                conn, _ = self.sock.accept()
            except OSError:
                break
            try:
                if self.privileged(peer_uid(conn)):
                    self.serve(conn)  # on the reserve's descriptor: taken again once one is free
                    continue
                conn.setblocking(False)
                conn.send(BUSY)
            except OSError:
                pass
            conn.close()
        self.loop.remove_reader(self.sock.fileno())
        self.paused = True
        self.pause = min(MAX_PAUSE, max(0.01, self.pause * 2))
        self.loop.call_later(self.pause, self.start)
