"""Detached sessions (`colo shell --detach`, `colo run --detach`, `colo attach`), as `docker run
-dit` and `docker attach`, or a tmux session, are.

A session started detached keeps its terminal's master end in the daemon instead of sending it
to a client, and the daemon reads all the job writes, always (up to RATE bytes a second): into a
scrollback of the last SCROLLBACK bytes (older bytes are dropped), so a client that attaches
later sees the last screen. `colo attach JOB` (op `attach`, the job's owner
only) gets the scrollback, then a terminal of its own (a new pty pair: its master end to the
client, SCM_RIGHTS, as a session's); the daemon copies the job's output to it as it comes, the
client's keys to the job, and the client's window size (looked at every SIZE_LOOK seconds while
attached, and whenever a key comes: nothing signals the daemon of it) to the job's terminal.
When that client goes (its detach key, a dropped connection, a killed client: its terminal
hangs up) the job runs on unattached. A second attach takes the terminal over; the first client's
stream ends saying so.

A session not started detached keeps its rule: its client going ends it (session.py).

Owns, per detached session: the job's master end, the scrollback, the attached client's
terminal (the slave end of its pair) and what is on its way to either. Calls nothing: the job's
end is the table's (job_changed closes the terminals). Runs on the event loop only.
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import struct
import termios
import tty

from ..jobs import TERMINAL, Job

log = logging.getLogger("colo")
SCROLLBACK = 128 << 10  # bytes of a detached session's output kept for the next attach
MAX_PER_USER = 16  # detached sessions (queued or running) one user may have: each holds descriptors
SIZE = (24, 80)  # a detached session's window until a client attaches with its own
SIZE_LOOK = 0.5  # seconds between looks at an attached client's window size
PENDING = 1 << 16  # bytes on their way to a side that does not take them, before the other is not read
# Bytes a second read of one session's terminal: a job that writes faster waits on its terminal (as
# on a slow one) rather than keep the daemon's loop busy copying for it.
RATE = 4 << 20


def _size(fd: int) -> bytes:
    return fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8)


class Kept:
    """One detached session's terminal, and the client attached to it (`peer`: 0 when none)."""

    __slots__ = ("job_id", "uid", "master", "back", "peer", "holder", "taken", "to_peer", "to_job", "ended", "timer",
                 "second", "read")

    def __init__(self, job_id: int, uid: int, master: int):
        self.job_id, self.uid, self.master = job_id, uid, master
        self.back = bytearray()
        self.peer: int | None = None  # the attached client's pty (slave end), raw
        self.holder = 0  # the attach holding it now (0: none); each attach gets the next number
        self.taken: asyncio.Event | None = None  # set when that attach is taken over, or the session ends
        self.to_peer, self.to_job = bytearray(), bytearray()
        self.ended = False  # the job's end hung up: nothing more will come
        self.timer: asyncio.TimerHandle | None = None
        self.second, self.read = 0.0, 0  # this second's start (loop time), bytes read in it (RATE)


class Terminals:
    """The detached sessions' terminals (module docstring)."""

    def __init__(self):
        self.kept: dict[int, Kept] = {}
        self._attaches = 0

    def note(self, job_id: int) -> str | None:
        """What listings say of it: attached or detached (None: not a detached session's job)."""
        k = self.kept.get(job_id)
        return None if k is None else "attached" if k.holder else "detached"

    def holds(self, job_id: int) -> bool:
        return job_id in self.kept

    def count(self, uid: int) -> int:
        return sum(1 for k in self.kept.values() if k.uid == uid)

    # keeping -------------------------------------------------------------------------------------
    def keep(self, job_id: int, uid: int, master: int, screen: bytes = b"") -> None:
        """Hold `master` (a session started detached) and read it from now on; `screen`: what it
        showed before (a container session's, from the engine's log, after a restart)."""
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", *SIZE, 0, 0))
        os.set_blocking(master, False)
        self.kept[job_id] = k = Kept(job_id, uid, master)
        k.back += screen[-SCROLLBACK:]
        asyncio.get_running_loop().add_reader(master, self._from_job, k)

    def _from_job(self, k: Kept) -> bool:
        """Read what the job wrote (False: nothing there now)."""
        try:
            data = os.read(k.master, 1 << 16)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno != errno.EIO:
                log.warning("job %d: its terminal could not be read: %s", k.job_id, e)
            data = b""
        loop = asyncio.get_running_loop()
        if not data:  # every holder of the job's end closed it: nothing more comes (it ended)
            k.ended = True
            loop.remove_reader(k.master)
            return False
        k.back += data
        if len(k.back) > 2 * SCROLLBACK:  # (cut now and then, not at each read: it moves what stays)
            del k.back[:-SCROLLBACK]
        now = loop.time()
        if now - k.second >= 1.0:
            k.second, k.read = now, 0
        k.read += len(data)
        if k.read > RATE:  # read again next second
            loop.remove_reader(k.master)
            loop.call_at(k.second + 1.0, self._again, k)
        if k.peer is not None:
            k.to_peer += data
            self._flush(k, k.peer, k.to_peer)
            if len(k.to_peer) > PENDING:  # a slow client: so is the job's terminal, as a real one would be
                loop.remove_reader(k.master)
        return True

    def _again(self, k: Kept) -> None:
        if self.kept.get(k.job_id) is k and not k.ended:
            asyncio.get_running_loop().add_reader(k.master, self._from_job, k)

    def _from_peer(self, k: Kept) -> None:
        try:
            data = os.read(k.peer, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client closed its end (detached, or it went)
            self._let_go(k)
            return
        self._look_at_size(k)
        k.to_job += data
        self._flush(k, k.master, k.to_job)
        if len(k.to_job) > PENDING:  # the job reads no input: the client's keys wait in its own buffers
            asyncio.get_running_loop().remove_reader(k.peer)

    def _flush(self, k: Kept, fd: int, buf: bytearray) -> None:
        """Write what `buf` holds to `fd` now, the rest when it can take it."""
        loop = asyncio.get_running_loop()
        try:
            n = os.write(fd, buf) if buf else 0
        except BlockingIOError:
            n = 0
        except OSError:
            n = len(buf)  # that side is gone: its own reader sees it
        del buf[:n]
        if buf:
            loop.add_writer(fd, self._flush, k, fd, buf)
        else:
            loop.remove_writer(fd)
            if fd == k.master and k.peer is not None:  # the job took it all: the client's keys again
                loop.add_reader(k.peer, self._from_peer, k)
            elif fd == k.peer and not k.ended and (k.read <= RATE or loop.time() - k.second >= 1.0):
                # the client took it all: the job's output again (unless RATE holds it: _again does)
                loop.add_reader(k.master, self._from_job, k)

    def _look_at_size(self, k: Kept) -> None:
        try:
            size = _size(k.peer)
            if size != _size(k.master) and size[:4] != b"\0\0\0\0":
                fcntl.ioctl(k.master, termios.TIOCSWINSZ, size)  # the job's foreground gets SIGWINCH
        except OSError:
            pass

    def _tick(self, k: Kept) -> None:
        if k.peer is not None:
            self._look_at_size(k)
            k.timer = asyncio.get_running_loop().call_later(SIZE_LOOK, self._tick, k)

    # attaching ---------------------------------------------------------------------------------
    def take(self, job_id: int) -> tuple[int, bytes, int, asyncio.Event]:
        """A new attach takes the terminal: (its number, the scrollback, the master end of the
        client's own terminal, set when it is taken over). The attach before it is let go."""
        k = self.kept[job_id]
        self._let_go(k)
        mine, peer = os.openpty()  # (non-inheritable)
        tty.setraw(peer, termios.TCSANOW)
        fcntl.ioctl(peer, termios.TIOCSWINSZ, _size(k.master))
        os.set_blocking(peer, False)
        self._attaches += 1
        k.holder, k.peer, k.taken = self._attaches, peer, asyncio.Event()
        asyncio.get_running_loop().add_reader(peer, self._from_peer, k)
        k.timer = asyncio.get_running_loop().call_later(SIZE_LOOK, self._tick, k)
        return k.holder, bytes(k.back[-SCROLLBACK:]), mine, k.taken

    def leave(self, job_id: int, holder: int) -> None:
        """The attach `holder` ended (its client went): the job runs on unattached."""
        k = self.kept.get(job_id)
        if k is not None and k.holder == holder:
            self._let_go(k)

    def _let_go(self, k: Kept) -> None:
        if k.peer is None:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(k.peer)
        loop.remove_writer(k.peer)
        if k.timer is not None:
            k.timer.cancel()
        os.close(k.peer)  # (the client's end reads EIO)
        k.peer, k.holder, k.timer = None, 0, None
        k.to_peer.clear()
        k.taken.set()
        if not k.ended and k.job_id in self.kept:  # (a slow client may have held its output back)
            loop.add_reader(k.master, self._from_job, k)

    # the end ------------------------------------------------------------------------------------
    def job_changed(self, prev: Job | None, job: Job) -> None:
        """The table's on_change: an ended session's terminals go."""
        if job.state in TERMINAL and job.id in self.kept:
            self.drop(job.id)

    def drop(self, job_id: int) -> None:
        k = self.kept.pop(job_id, None)
        if k is None:
            return
        while not k.ended and k.peer is not None and self._from_job(k):
            pass  # its last words, to the client attached (what it takes now)
        self._let_go(k)
        loop = asyncio.get_running_loop()
        if not k.ended:
            loop.remove_reader(k.master)
        loop.remove_writer(k.master)
        os.close(k.master)
