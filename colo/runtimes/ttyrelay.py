"""A container session's terminal: the bytes between the session's pty (the slave end the daemon
made, its master with the client) and the terminal the engine allocated in the container
(`tty=True`), through the container's attach socket.

The engine's terminal does what a terminal does (echo, line editing, Ctrl-C and Ctrl-Z as signals
to the container's foreground process group), so the daemon's pty is raw: a byte typed is a byte
sent. A window size set on the master reaches no process here (no one has this pty as its
controlling terminal, so nothing gets SIGWINCH): the relay looks at it whenever it wakes, and at
least every SIZE_LOOK seconds, and passes a change to the engine (`resize`) through a thread of its
own: an engine call takes a while (over 200 ms on a busy node, each session's first one included),
and the container's bytes do not wait for it (its first line would: bench/session_bench.py). Keys
typed after a size change do: they reach the container once the engine has the size, as on a
terminal (`stty size` typed after a resize says the new one).

`colo run --image` fed from a pipe (`docker run -i`) has no terminal: the container's is none
(`tty=False`), the daemon's end is a socket (`resize` None), whose bytes go to the container's input
as they come, its end closing that input once they are sent; the engine's multiplexed stream (its
frames say stdout or stderr) goes back as it is, for the client to take apart (colo/cli/attach.py).

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

    def __init__(self, name: str, tty_fd: int, sock: socket.socket, resize: Callable[[int, int], None] | None,
                 rate: int = RATE):
        super().__init__(name=f"colo-tty-{name}", daemon=True)
        self.tty, self.sock, self.resize, self.rate = tty_fd, sock, resize, rate
        self.size: tuple[int, int] | None = None  # the size last asked of the engine (None: none, or refused)
        self._sizing = threading.Condition()  # guards _want, _pending and _done, the sizer's
        self._want: tuple[int, int] | None = None  # the size the sizer passes to the engine next
        self._pending = False  # a size the engine does not have yet: keys wait for it
        self._done = False
        # the client's input: open (True), ended with bytes still to send (False), closed (None)
        self._input: bool | None = True
        if resize is not None:
            tty.setraw(tty_fd, termios.TCSANOW)
        os.set_blocking(tty_fd, False)
        sock.setblocking(False)
        self._halt_r, self._halt_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sized_r, self._sized_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)  # the sizer's word: done

    def stop(self) -> None:
        try:
            os.write(self._halt_w, b"x")
        except OSError:
            pass

    def _look_at_size(self) -> None:
        if self.resize is None:  # a wire: no window
            return
        try:
            size = window(self.tty)
        except OSError:
            return
        if size != self.size and size[0] and size[1]:
            with self._sizing:
                self.size = self._want = size
                self._pending = True
                self._sizing.notify()

    def _sizer(self) -> None:
        """Passes each size the relay saw to the engine, the latest only, until the relay ends
        (then it closes its pipe: it is the last to write there)."""
        while True:
            with self._sizing:
                while self._want is None and not self._done:
                    self._sizing.wait()
                if self._done:
                    os.close(self._sized_r)
                    os.close(self._sized_w)
                    return
                size, self._want = self._want, None
            try:
                self.resize(*size)
            except Exception as e:  # noqa: BLE001 - an engine that refuses one resize: tried at the next look
                log.debug("%s: resize refused: %s", self.name, e)
                with self._sizing:
                    if self._want is None and self.size == size:
                        self.size = None
            with self._sizing:
                if self._want is None:
                    self._pending = False
            try:
                os.write(self._sized_w, b"s")
            except OSError:  # (full: the relay wakes all the same)
                pass

    def run(self) -> None:
        if self.resize is None:
            try:
                self._run()
            finally:
                os.close(self._sized_r)
                os.close(self._sized_w)
            return
        sizer = threading.Thread(target=self._sizer, name=f"{self.name}-size", daemon=True)
        sizer.start()
        try:
            self._run()
        finally:
            with self._sizing:
                self._done = True
                self._sizing.notify()

    def _run(self) -> None:
        to_sock, to_tty = b"", b""
        second, read = 0.0, 0  # this second's start, the container's bytes read in it (RATE)
        try:
            while True:
                self._look_at_size()
                now = time.monotonic()
                if now - second >= 1.0:
                    second, read = now, 0
                keys = not self._pending  # (keys read before a size change was seen wait for it too)
                rl = [self._halt_r, self._sized_r]
                if len(to_sock) < BUFFER and keys and self._input:
                    rl.append(self.tty)
                if len(to_tty) < BUFFER and read <= self.rate:
                    rl.append(self.sock)
                wl = ([self.sock] if to_sock and keys else []) + ([self.tty] if to_tty else [])
                wait = SIZE_LOOK if read <= self.rate else max(0.0, min(SIZE_LOOK, second + 1.0 - now))
                r, w, _ = select.select(rl, wl, [], wait)
                if self._halt_r in r:
                    return
                if self._sized_r in r:
                    os.read(self._sized_r, 512)
                if self.tty in r:
                    try:
                        data = os.read(self.tty, BUFFER)
                    except BlockingIOError:
                        data = None
                    except OSError as e:  # EIO: no one holds the master any more
                        if e.errno != errno.EIO:
                            raise
                        return
                    if data == b"" and self.resize is not None:
                        return
                    if data == b"":  # a wire's input ended: the container's ends once what came is sent
                        self._input = False
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
                if self.sock in w and to_sock and keys:
                    try:
                        to_sock = to_sock[self.sock.send(to_sock):]
                    except BlockingIOError:
                        pass
                if self._input is False and not to_sock:
                    self.sock.shutdown(socket.SHUT_WR)  # end-of-file on the container's input (stdin_once)
                    self._input = None
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
