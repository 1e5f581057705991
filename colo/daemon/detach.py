"""Detached sessions (`colo shell --detach`, `colo run --detach`, `colo attach`), as `docker run
-dit` and `docker attach`, or a tmux session, are.

A session started detached keeps its terminal's master end in the daemon instead of sending it
to a client, and the daemon reads all the job writes, always (up to `detach_read_rate` bytes a
second, RATE by default): into a scrollback of the last `detach_scrollback` bytes (SCROLLBACK;
older bytes are dropped), so a client that attaches later sees the last screen. `colo attach
JOB` (op `attach`, the job's owner only) gets the scrollback, then a terminal of its own (a new
pty pair: its master end to the client, SCM_RIGHTS, as a session's); the daemon copies the job's output to it as it comes, the
client's keys to the job, and the client's window size (looked at every SIZE_LOOK seconds while
attached, and whenever a key comes: nothing signals the daemon of it) to the job's terminal.
When that client goes (its detach key, a dropped connection, a killed client: its terminal
hangs up) the job runs on unattached. A second attach takes the terminal over; the first client's
stream ends saying so.

A session not started detached keeps its rule: its client going ends it (session.py).

A detached host session outlives a daemon restart, as a container session does (the engine keeps
that one's terminal): its terminal is handed at once to a holder, a process of its own (root's,
as the daemon; in a session of its own, with no controlling terminal; started with exactly three
descriptors: the master end, its listening socket and its first connection), which runs the same
Terminals for that one session (the scrollback, the rate, the attached client's terminal). Its
socket, `holders/JOB.sock` in the daemon's state folder (root's, 0700; the socket 0600), is its
record: a restarted daemon connects to every one there (`recover`; not to its own, of sessions
detached since it started), takes only a listener of its own user (SO_PEERCRED) that says it
holds that job's terminal, and the holder takes only a connection of its own user. Between the
two go small messages (SOCK_SEQPACKET, JSON): `take` (answered by the client's master end and
the scrollback in a memfd, SCM_RIGHTS, of which the daemon reads the last bytes), `leave`, `end`,
`set` (a reload's scrollback and rate), and the holder's `free` (its attached client went). No byte of a job's is parsed on that connection (keys and output flow between the
holder and the client's terminal; the scrollback is a memfd, read up to its size); the holder
copies them as the daemon would, never blocking. A holder that goes away (killed) ends its
session: the job is cancelled, saying so. The shell runs as before: the shim holds its end, as
the user, in the job's cgroup.

Owns, per detached session: the job's master end, the scrollback, the attached client's
terminal (the slave end of its pair) and what is on its way to either; or its holder's
connection. Calls `cancel` (the launcher's) for a session whose holder went away; the job's end
is the table's (job_changed closes the terminals). Runs on the event loop only.
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import tty
from pathlib import Path

from ..jobs import TERMINAL, Job

log = logging.getLogger("colo")
SCROLLBACK = 128 << 10  # bytes of a detached session's output kept for the next attach
SIZE = (24, 80)  # a detached session's window until a client attaches with its own
SIZE_LOOK = 0.5  # seconds between looks at an attached client's window size
PENDING = 1 << 16  # bytes on their way to a side that does not take them, before the other is not read
# Bytes a second read of one session's terminal: a job that writes faster waits on its terminal (as
# on a slow one) rather than keep the daemon's loop busy copying for it.
RATE = 4 << 20
MSG_MAX = 4096  # bytes of one message between the daemon and a holder
HOLDER_WAIT = 10.0  # seconds a holder has to answer (it reads nothing else)


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


class HolderError(OSError):
    """A detached host session's holder that cannot be started or does not answer: one line."""


class Held:
    """The daemon's side of one detached host session's holder: its connection (`sock`), the
    attach that holds the terminal now (`holder`, the holder's number for it: 0 when none) and
    what waits on the holder's answer to a take."""

    __slots__ = ("job_id", "uid", "sock", "pid", "child", "holder", "taken", "reply", "lock")

    def __init__(self, job_id: int, uid: int, sock: socket.socket, pid: int, child: subprocess.Popen | None,
                 holder: int = 0):
        self.job_id, self.uid, self.sock, self.pid, self.child = job_id, uid, sock, pid, child
        self.holder = holder
        self.taken: asyncio.Event | None = None
        self.reply: asyncio.Future | None = None
        self.lock = asyncio.Lock()  # one take at a time


class Terminals:
    """The detached sessions' terminals (module docstring). `holders`: the root-only folder of the
    holders' sockets (None: host sessions are kept here, as container sessions are, and end with
    the daemon); `cancel`: the launcher's, for a session whose holder went away."""

    def __init__(self, scrollback: int = SCROLLBACK, rate: int = RATE, holders: Path | None = None, cancel=None):
        self.scrollback, self.rate = scrollback, rate
        self.holders, self.cancel = holders, cancel
        self.kept: dict[int, Kept] = {}
        self.held: dict[int, Held] = {}
        self._attaches = 0
        self._tasks: set[asyncio.Task] = set()  # cancels and reaps under way (kept referenced)

    def configure(self, scrollback: int, rate: int) -> None:
        """New detach keys (a reload): for the sessions to come and those running, their holders
        told (`set`) as the daemon's own terminals read them at each use."""
        self.scrollback, self.rate = scrollback, rate
        for h in self.held.values():
            self._tell(h, {"op": "set", "scrollback": scrollback, "rate": rate})

    def note(self, job_id: int) -> str | None:
        """What listings say of it: attached or detached (None: not a detached session's job)."""
        k = self.kept.get(job_id) or self.held.get(job_id)
        return None if k is None else "attached" if k.holder else "detached"

    def holds(self, job_id: int) -> bool:
        return job_id in self.kept or job_id in self.held

    # keeping -------------------------------------------------------------------------------------
    def keep(self, job_id: int, uid: int, master: int, screen: bytes = b"") -> None:
        """Hold `master` (a session started detached) and read it from now on; `screen`: what it
        showed before (a container session's, from the engine's log, after a restart)."""
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", *SIZE, 0, 0))
        os.set_blocking(master, False)
        self.kept[job_id] = k = Kept(job_id, uid, master)
        k.back += screen[-self.scrollback:]
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
        if len(k.back) > 2 * self.scrollback:  # (cut now and then, not at each read: it moves what stays)
            del k.back[:-self.scrollback]
        now = loop.time()
        if now - k.second >= 1.0:
            k.second, k.read = now, 0
        k.read += len(data)
        if k.read > self.rate:  # read again next second
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
            elif fd == k.peer and not k.ended and (k.read <= self.rate or loop.time() - k.second >= 1.0):
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
    async def take(self, job_id: int) -> tuple[int, bytes, int, asyncio.Event]:
        """A new attach takes the terminal: (its number, the scrollback, the master end of the
        client's own terminal, set when it is taken over). The attach before it is let go."""
        if job_id in self.held:
            return await self._take_held(self.held[job_id])
        return self.take_here(job_id)

    def take_here(self, job_id: int) -> tuple[int, bytes, int, asyncio.Event]:
        """take() of a terminal this process reads itself."""
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
        return k.holder, bytes(k.back[-self.scrollback:]), mine, k.taken

    def leave(self, job_id: int, holder: int) -> None:
        """The attach `holder` ended (its client went): the job runs on unattached."""
        h = self.held.get(job_id)
        if h is not None:
            if h.holder == holder:
                self._tell(h, {"op": "leave", "n": holder})
            return
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
        if job.state in TERMINAL and (job.id in self.kept or job.id in self.held):
            self.drop(job.id)

    def drop(self, job_id: int) -> None:
        h = self.held.pop(job_id, None)
        if h is not None:  # the holder gives the attached client the job's last words, and ends
            self._tell(h, {"op": "end"})
            self._forget(h)
            return
        k = self.kept.pop(job_id, None)
        if k is None:
            return
        for _ in range(PENDING >> 12):  # its last words, to the client attached (what it takes now), at
            if k.ended or k.peer is None or not self._from_job(k):  # most a few reads: a process the job
                break                                                # left may write on
        self._let_go(k)
        loop = asyncio.get_running_loop()
        if not k.ended:
            loop.remove_reader(k.master)
        loop.remove_writer(k.master)
        os.close(k.master)

    # detached host sessions: a holder process each ---------------------------------------------
    def path(self, job_id: int) -> Path:
        """Where the holder of `job_id`'s terminal listens: its record, in the root-only folder."""
        assert self.holders is not None
        return self.holders / f"{job_id}.sock"

    def hold(self, job_id: int, uid: int, master: int) -> None:
        """Hand a detached host session's terminal (`master`, closed here once the holder has it)
        to a holder of its own (module docstring). HolderError: none could be started (`master`
        is still the caller's)."""
        path = self.path(job_id)
        listen = theirs = mine = None
        try:
            path.unlink(missing_ok=True)
            listen = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listen.bind(str(path))
            os.chmod(path, 0o600)  # (in a folder only root may enter: no one else can reach it anyway)
            listen.listen(4)
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            fds = (master, listen.fileno(), theirs.fileno())
            child = subprocess.Popen(
                [sys.executable, "-I", "-c", _HOLDER, _ROOT, str(job_id), *map(str, fds), str(self.scrollback),
                 str(self.rate)],
                pass_fds=fds, close_fds=True, start_new_session=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        except (OSError, subprocess.SubprocessError) as e:
            if mine is not None:
                mine.close()
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
            raise HolderError(f"job {job_id}: its terminal's holder could not be started: {e}") from None
        finally:
            for s in (listen, theirs):
                if s is not None:
                    s.close()
        os.close(master)  # the holder's only from now on
        mine.setblocking(False)
        h = self.held[job_id] = Held(job_id, uid, mine, child.pid, child)
        asyncio.get_running_loop().add_reader(mine.fileno(), self._from_holder, h)

    async def recover(self, open_jobs: dict[int, int]) -> None:
        """At the daemon's start, after recovery: the holders a daemon before it started, found
        again by their sockets (`open_jobs`: job -> uid). A holder of a job that ended meanwhile
        is told to end; an open job whose holder is gone is cancelled, saying so. The daemon
        serves requests already: a session detached since it started has a holder of its own
        (in `held`, its socket among the others), which is no earlier daemon's."""
        if self.holders is None:
            return
        try:
            names = os.listdir(self.holders)
        except OSError as e:
            log.warning("the holders of detached sessions' terminals cannot be looked for: %s", e)
            return
        # (taken with `held`, no await between: hold() binds a socket and enters it there in one step)
        theirs = {int(m.group(1)): name for name in names if (m := re.fullmatch(r"([0-9]{1,18})\.sock", name))}
        theirs = {job_id: name for job_id, name in theirs.items() if job_id not in self.held}
        found, lost = await asyncio.to_thread(self._find, theirs, set(open_jobs))
        loop = asyncio.get_running_loop()
        for job_id, sock, pid, holder in found:
            h = self.held[job_id] = Held(job_id, open_jobs[job_id], sock, pid, None, holder)
            loop.add_reader(sock.fileno(), self._from_holder, h)
            self._tell(h, {"op": "set", "scrollback": self.scrollback, "rate": self.rate})  # (this daemon's keys)
            log.info("job %d: its detached session's terminal is held again (holder pid %d)", job_id, pid)
        for job_id in lost:
            log.warning("job %d: its detached session's terminal holder went away while colo was restarting: "
                        "cancelled", job_id)
            self._cancel(job_id, "colo (the detached session's terminal holder went away while colo was restarting)")

    def _find(self, theirs: dict[int, str], open_ids: set[int]) -> tuple[list, list[int]]:
        """(blocking) Of the holders of `theirs` (job -> socket name), those that answer, as (job,
        connection, pid, attach holding it), and the open jobs whose holder does not."""
        found, lost = [], []
        for job_id, name in theirs.items():
            got = _connect(self.holders / name, job_id)
            if got is None or job_id not in open_ids:
                if got is not None:  # its job ended while no daemon ran: so does its holder
                    _say(got[0], {"op": "end"})
                    got[0].close()
                elif job_id in open_ids:
                    lost.append(job_id)
                try:
                    (self.holders / name).unlink()
                except OSError:
                    pass
                continue
            found.append((job_id, *got))
        return found, lost

    def _from_holder(self, h: Held) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(h.sock, MSG_MAX, 2)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds, flags = b"", [], 0
        if not data:
            for fd in fds:
                os.close(fd)
            self._gone(h)
            return
        try:
            ev = json.loads(data)
        except ValueError:
            ev = None
        ev = ev if isinstance(ev, dict) else {}
        took = ev.get("took")
        if (isinstance(took, int) and took > 0 and len(fds) == 2 and not flags & socket.MSG_CTRUNC
                and h.reply is not None and not h.reply.done()):
            h.reply.set_result((took, fds))
            return
        for fd in fds:  # (an answer no one waits for any more: its attach went)
            os.close(fd)
        if ev.get("free") and ev.get("free") == h.holder:  # its client went (detached, or dropped)
            h.holder = 0
            if h.taken is not None:
                h.taken.set()

    async def _take_held(self, h: Held) -> tuple[int, bytes, int, asyncio.Event]:
        async with h.lock:
            if self.held.get(h.job_id) is not h:
                raise HolderError(f"job {h.job_id}: its terminal's holder went away")
            h.reply = asyncio.get_running_loop().create_future()
            try:
                if not _say(h.sock, {"op": "take"}):
                    raise HolderError(f"job {h.job_id}: its terminal's holder does not answer")
                n, (mine, back) = await asyncio.wait_for(h.reply, HOLDER_WAIT)
            except asyncio.TimeoutError:
                raise HolderError(f"job {h.job_id}: its terminal's holder does not answer") from None
            finally:
                h.reply = None
        try:  # its last bytes: the holder's bound may be larger than this daemon's
            screen = os.pread(back, self.scrollback, max(0, os.fstat(back).st_size - self.scrollback))
        finally:
            os.close(back)
        if h.taken is not None:  # the attach before it is let go (the holder did so)
            h.taken.set()
        h.holder, h.taken = n, asyncio.Event()
        return n, screen, mine, h.taken

    def _gone(self, h: Held) -> None:
        """Its holder went away while this daemon ran: the session cannot go on."""
        if self.held.get(h.job_id) is not h:
            return
        del self.held[h.job_id]
        self._forget(h)
        log.warning("job %d: its detached session's terminal holder (pid %d) went away: cancelled", h.job_id, h.pid)
        self._cancel(h.job_id, "colo (the detached session's terminal holder went away)")

    def _forget(self, h: Held) -> None:
        asyncio.get_running_loop().remove_reader(h.sock.fileno())
        h.sock.close()
        if h.taken is not None:
            h.taken.set()
        if h.reply is not None and not h.reply.done():
            h.reply.set_exception(HolderError(f"job {h.job_id}: its terminal's holder went away"))
        try:
            self.path(h.job_id).unlink(missing_ok=True)
        except OSError:
            pass
        if h.child is not None:  # this daemon's child: reaped
            self._later(asyncio.to_thread(_reap, h.child))

    def _cancel(self, job_id: int, by: str) -> None:
        if self.cancel is not None:
            self._later(self.cancel(job_id, by))

    def _later(self, aw) -> None:
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("after a detached session's holder: %s", task.exception())

    def _tell(self, h: Held, ev: dict) -> None:
        if not _say(h.sock, ev):
            log.warning("job %d: its terminal's holder (pid %d) took no %s", h.job_id, h.pid, ev.get("op"))


def _say(sock: socket.socket, ev: dict, fds: list[int] = ()) -> bool:
    """One message on a holder's connection (never blocks: a side that reads nothing is broken)."""
    data = json.dumps(ev).encode()
    try:
        if fds:
            socket.send_fds(sock, [data], list(fds), socket.MSG_DONTWAIT)
        else:
            sock.send(data, socket.MSG_DONTWAIT)
        return True
    except OSError:
        return False


def _connect(path: Path, job_id: int) -> tuple[socket.socket, int, int] | None:
    """(blocking) A connection to the holder at `path` and its pid and attach, when it is this
    daemon's user's and holds `job_id`'s terminal; None when it is gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(HOLDER_WAIT)
    try:
        sock.connect(str(path))
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.geteuid():
            raise OSError(f"its listener is uid {uid}'s")
        hello = json.loads(sock.recv(MSG_MAX) or b"null")
        if not isinstance(hello, dict) or hello.get("hello") != job_id:
            raise OSError("it holds another job's terminal")
        holder = hello.get("holder")
    except (OSError, ValueError) as e:
        log.debug("job %d: its holder does not answer: %s", job_id, e)
        sock.close()
        return None
    sock.setblocking(False)
    return sock, pid, holder if isinstance(holder, int) and holder > 0 else 0


def _reap(child: subprocess.Popen) -> None:
    try:
        child.wait(HOLDER_WAIT)
    except subprocess.TimeoutExpired:  # told to end and did not: a holder of no session
        child.kill()
        child.wait()


# the holder ----------------------------------------------------------------------------------------
_ROOT = str(Path(__file__).resolve().parents[2])  # where this colo is imported from (the holder runs -I)
_HOLDER = "import sys; sys.path.insert(0, sys.argv[1]); from colo.daemon.detach import holder_main; " \
          "holder_main(sys.argv[2:])"


def holder_main(argv: list[str]) -> None:
    """The holder of one detached host session's terminal (root's, started by Terminals.hold, in a
    session of its own): JOB MASTER LISTEN CONTROL SCROLLBACK RATE, the three descriptors its own."""
    job_id, master, listen, control, scrollback, rate = map(int, argv)
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE, signal.SIGTTOU, signal.SIGTTIN):
        signal.signal(sig, signal.SIG_IGN)  # (no terminal is its controlling one; a daemon's stop is not its end)
    os.umask(0o077)
    logging.basicConfig(format=f"colo's holder of job {job_id}'s terminal: %(message)s", level=logging.WARNING)
    asyncio.run(_Holder(job_id, master, listen, control, scrollback, rate).run())


class _Holder:
    """Runs a Terminals of one session: the job's master end, its scrollback, the attached
    client's terminal, as the daemon would (above); answers the daemon's connection (one at a
    time: another is refused while it lives; a restarted daemon's comes after the last one's end)
    with what it asks: take, leave, end."""

    def __init__(self, job_id: int, master: int, listen: int, control: int, scrollback: int, rate: int):
        self.job_id, self.master = job_id, master
        self.listen = socket.socket(fileno=listen)
        self.first: socket.socket | None = socket.socket(fileno=control)
        self.conn: socket.socket | None = None
        self.terms = Terminals(scrollback, rate)
        self.tasks: set[asyncio.Task] = set()
        self.done: asyncio.Event | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.done = asyncio.Event()
        self.terms.keep(self.job_id, 0, self.master)
        self.listen.listen(4)  # (again, as this process: a connecting daemon's SO_PEERCRED names it, not the daemon)
        self.listen.setblocking(False)
        loop.add_reader(self.listen.fileno(), self._accept)
        self._serve(self.first)
        self.first = None
        await self.done.wait()

    def _accept(self) -> None:
        try:
            conn, _ = self.listen.accept()
        except OSError:
            return
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        except OSError:
            uid = -1
        if uid != os.geteuid():  # the daemon's user only (the folder lets no one else in: a second lock)
            conn.close()
            return
        if self.conn is not None:
            try:  # one daemon at a time: a live one keeps its connection, a dead one's (a restart) is over
                alive = self.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
            except BlockingIOError:
                alive = True
            except OSError:
                alive = False
            if alive:
                conn.close()
                return
            self._hang_up(self.conn)
        self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        self.conn = conn
        asyncio.get_running_loop().add_reader(conn.fileno(), self._from_daemon, conn)
        k = self.terms.kept.get(self.job_id)
        _say(conn, {"hello": self.job_id, "holder": k.holder if k is not None else 0})

    def _hang_up(self, conn: socket.socket) -> None:
        asyncio.get_running_loop().remove_reader(conn.fileno())
        conn.close()
        if self.conn is conn:
            self.conn = None

    def _from_daemon(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(MSG_MAX)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the daemon went (a restart): the next one connects again
            self._hang_up(conn)
            return
        try:
            ev = json.loads(data)
        except ValueError:
            return
        op = ev.get("op") if isinstance(ev, dict) else None
        if op == "take" and self.job_id in self.terms.kept:
            n, back, mine, taken = self.terms.take_here(self.job_id)
            memfd = os.memfd_create("colo-scrollback", os.MFD_CLOEXEC)
            try:
                view = memoryview(back)
                while view:
                    view = view[os.write(memfd, view):]
                _say(conn, {"took": n}, [mine, memfd])
            finally:
                os.close(mine)  # (sent, or not: its attach then ends at once)
                os.close(memfd)
            task = asyncio.ensure_future(self._freed(n, taken))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif op == "leave" and isinstance(ev.get("n"), int):
            self.terms.leave(self.job_id, ev["n"])
        elif op == "set" and all(isinstance(ev.get(k), int) and ev[k] > 0 for k in ("scrollback", "rate")):
            self.terms.scrollback, self.terms.rate = ev["scrollback"], ev["rate"]  # a reload's (read at each use)
        elif op == "end":  # the job ended: its last words to the client attached, and this holder goes
            self.terms.drop(self.job_id)
            self.done.set()

    async def _freed(self, n: int, taken: asyncio.Event) -> None:
        await taken.wait()
        if self.conn is not None:
            _say(self.conn, {"free": n})
