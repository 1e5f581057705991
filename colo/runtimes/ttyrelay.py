"""A container session's terminal: the bytes between the session's pty (the slave end the daemon
made, its master with the client) and the terminal the engine allocated in the container
(`tty=True`), through the container's attach socket.

The engine's terminal does what a terminal does (echo, line editing, Ctrl-C and Ctrl-Z as signals
to the container's foreground process group), so the daemon's pty is raw: a byte typed is a byte
sent. A window size set on the master reaches no process here (no one has this pty as its
controlling terminal, so nothing gets SIGWINCH): the relay looks at it whenever it wakes, and at
least every SIZE_LOOK seconds, and passes a change to the engine (`resize`).

One thread per running container session. It ends when either side ends: the container's stream
(the container exited, or was stopped), or the pty (every master holder closed it: the client
went, and the daemon cancels the job); then it closes both.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import socket
import termios
import threading
import time
import tty
from typing import Callable

log = logging.getLogger(__name__)
SIZE_LOOK = 0.5  # seconds between looks at the window size while nothing flows
BUFFER = 1 << 16  # bytes held for a side that does not take them yet, before reading the other stops
RATE = 4 << 20  # bytes a second of the container's output (detach_read_rate): faster, it waits (as on a slow terminal)


def window(fd: int) -> tuple[int, int]:
    """(rows, columns) of a terminal."""
    raw = fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8)
    return int.from_bytes(raw[0:2], "little"), int.from_bytes(raw[2:4], "little")


class Relay(threading.Thread):
    """Owns `tty` (the pty's slave end) and `sock` (the container's attach socket); closes both."""

    def __init__(self, name: str, tty_fd: int, sock: socket.socket, resize: Callable[[int, int], None],
                 rate: int = RATE):
        super().__init__(name=f"colo-tty-{name}", daemon=True)
        self.tty, self.sock, self.resize, self.rate = tty_fd, sock, resize, rate
        self.size: tuple[int, int] | None = None
        tty.setraw(tty_fd, termios.TCSANOW)
        os.set_blocking(tty_fd, False)
        sock.setblocking(False)
        self._halt_r, self._halt_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def stop(self) -> None:
        try:
            os.write(self._halt_w, b"x")
        except OSError:
            pass

    def _look_at_size(self) -> None:
        try:
            size = window(self.tty)
        except OSError:
            return
        if size != self.size and size[0] and size[1]:
            try:
                self.resize(*size)
                self.size = size
            except Exception as e:  # noqa: BLE001 - an engine that refuses one resize: tried at the next look
                log.debug("%s: resize refused: %s", self.name, e)

    def run(self) -> None:
        to_sock, to_tty = b"", b""
        second, read = 0.0, 0  # this second's start, the container's bytes read in it (RATE)
        try:
            while True:
                self._look_at_size()
                now = time.monotonic()
                if now - second >= 1.0:
                    second, read = now, 0
                rl = [self._halt_r]
                if len(to_sock) < BUFFER:
                    rl.append(self.tty)
                if len(to_tty) < BUFFER and read <= self.rate:
                    rl.append(self.sock)
                wl = ([self.sock] if to_sock else []) + ([self.tty] if to_tty else [])
                wait = SIZE_LOOK if read <= self.rate else max(0.0, min(SIZE_LOOK, second + 1.0 - now))
                r, w, _ = select.select(rl, wl, [], wait)
                if self._halt_r in r:
                    return
                if self.tty in r:
                    try:
                        data = os.read(self.tty, BUFFER)
                    except BlockingIOError:
                        data = None
                    except OSError as e:  # EIO: no one holds the master any more
                        if e.errno != errno.EIO:
                            raise
                        return
                    if data == b"":
                        return
                    to_sock += data or b""
                if self.sock in r:
                    try:
                        data = self.sock.recv(BUFFER)
                    except BlockingIOError:
                        data = None
                    if data == b"":  # the container's stream ended: so does its terminal here
                        self._flush(to_tty)
                        return
                    to_tty += data or b""
                    read += len(data or b"")
                if self.sock in w and to_sock:
                    try:
                        to_sock = to_sock[self.sock.send(to_sock):]
                    except BlockingIOError:
                        pass
                if self.tty in w and to_tty:
                    try:
                        to_tty = to_tty[os.write(self.tty, to_tty):]
                    except BlockingIOError:
                        pass
        except OSError as e:
            log.debug("%s: ended: %s", self.name, e)
        finally:
            for close in (self.sock.close, lambda: os.close(self.tty), lambda: os.close(self._halt_r),
                          lambda: os.close(self._halt_w)):
                try:
                    close()
                except OSError:
                    pass

    def _flush(self, data: bytes) -> None:
        """The container's last words to the terminal, as far as the client takes them within a while."""
        while data:
            _, w, _ = select.select([], [self.tty], [], 5.0)
            if not w:
                return
            try:
                data = data[os.write(self.tty, data):]
            except BlockingIOError:
                continue
            except OSError:
                return
