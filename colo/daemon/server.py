"""The Unix socket: one JSON request per line, caller identified by SO_PEERCRED."""
from __future__ import annotations

import asyncio
import grp
import logging
import os
import pwd
import re
import resource
import signal
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from .. import protocol
from ..config import Config
from ..runtimes.base import Unavailable
from ..store import StoreError
from . import heap, logflood
from .accept import Acceptor
from .api import ATTACHED, STREAMS, Api, ApiError
from . import reload, systemd
from .core import Daemon
from .passcost import held
from .slices import Pieces
from .validate import Caller, is_admin

log = logging.getLogger("colo")
# A connection must send its whole request line within this long of connecting, or it is closed:
# idle connections cost their user nothing and the daemon a descriptor each. Streams (wait, logs -f,
# sessions) have sent theirs and live as long as their client does.
REQUEST_TIMEOUT = 15.0
REPLY_TIMEOUT = 60.0  # a reply not taken in this long: the connection is dropped
BIG_REPLY = 1 << 20  # a reply this large (`ls --json` of thousands of jobs): the heap is trimmed after it
# Bytes of replies one user's connections may leave unread before their next requests are refused.
# A client that asks and never reads would otherwise have the daemon hold each reply (an `ls` of a
# queue of long commands is megabytes) for as long as it keeps the connection: a few hundred such
# connections took gigabytes of the root daemon's memory. A stream (logs -f) holds one event at most.
MAX_UNREAD = 64 << 20
UNREAD_FRESH = 0.5  # seconds a user's unread sum is reused: summing is O(their connections)
PRIVILEGE_FRESH = 10.0  # seconds whether a user is an admin is reused
# Unfinished requests: a request line of most ops is at most SMALL_LINE bytes; only the ops that
# carry a job's spec or a profile may take protocol.MAX_LINE. What one user's connections hold of
# requests not yet ended with their newline is at most MAX_PENDING together (1,000 connections each
# sending 1 MiB without its end took the daemon from 54 to 300 MiB, kept after they closed).
SMALL_LINE = 128 << 10
LARGE_OPS = frozenset({"submit", "session", "profile_put"})
MAX_PENDING = 8 << 20
# What asyncio buffers of a connection before it stops reading its socket (it pauses at twice this):
# the rest waits in the kernel, and each piece is counted against MAX_PENDING as it is taken.
READ_LIMIT = 16 << 10
# Descriptors kept for root and admins: other users' connections are refused past the limit less these.
RESERVED_FDS = 256
HALF_CLOSED_CHECK = 5.0  # seconds between looks at a half-closed stream's client
# Short blocking calls (Docker, NVML, starts and stops); waits for a job's exit have threads of
# their own (blocking.py). Threads are made only when needed.
WORKER_THREADS = 64
_OP = re.compile(rb'"op"\s*:\s*"([a-z_]{1,32})"')


def _room() -> int:
    """Connections other users may have open: the descriptor limit (read again each time: it can be
    changed from outside, prlimit) less those kept for root and admins and 64 for the daemon's own
    files and jobs' pipes."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (1 << 30) if soft == resource.RLIM_INFINITY else max(16, soft - RESERVED_FDS - 64)


class Connection(asyncio.StreamReaderProtocol):
    """A client's connection, as asyncio's streams serve it, less one reference cycle. Before Python
    3.12 asyncio's socket transport keeps a bound method of itself (`_read_ready_cb`; CPython
    gh-100348, fixed in 3.12): once the connection ends, the transport is garbage only the cyclic
    collector frees. The daemon moves what lives long out of the collector's sight (gc.freeze,
    passcost.settle), and with it the transports of the connections open at that moment
    (88 kept for good after 12,000 submits from 10 clients; and each `wait` or `logs -f` stream
    opened before a freeze). The cycle is broken here when the connection is
    lost: the transport has stopped reading by then, and reference counting frees it."""

    def connection_lost(self, exc: Exception | None) -> None:
        transport = self._transport
        super().connection_lost(exc)
        if getattr(transport, "_read_ready_cb", None) is not None:
            transport._read_ready_cb = None  # noqa: SLF001 - see above


class Refused(Exception):
    """A request not taken: one line to its client, then the connection is closed."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class Server:
    """Connections, and what each user's hold: their number, their streams, their unfinished
    requests' bytes and their unread replies' (all bounded; root and admins past the first two)."""

    def __init__(self, daemon: Daemon):
        self.d = daemon
        self.api = Api(daemon)
        self.conns: dict[int, set[asyncio.StreamWriter]] = {}  # uid -> its open connections' writers
        self.count: dict[int, int] = {}  # uid -> its connections open (counted from their accept)
        self.streams: dict[int, int] = {}  # uid -> its streams running
        self.pending: dict[int, int] = {}  # uid -> bytes of its requests read but not yet whole
        self.total = 0  # connections open
        self._unread: dict[int, tuple[float, int]] = {}
        self._privileged: dict[int, tuple[float, bool]] = {}
        self.refused = 0  # connections refused for a limit (hello detail, tests)
        self.acceptor = None  # accept.Acceptor, once serving

    def privileged(self, caller: Caller) -> bool:
        """Root, the daemon's own user and admins: served past the per-user bounds. An admin's
        membership is looked up again after PRIVILEGE_FRESH seconds, not for each refusal."""
        if caller.uid in (0, os.geteuid()):
            return True
        now = time.monotonic()
        at, yes = self._privileged.get(caller.uid, (-PRIVILEGE_FRESH, False))
        if now - at >= PRIVILEGE_FRESH:
            if len(self._privileged) > 4096:
                self._privileged.clear()
            yes = is_admin(caller, self.d.config.admin_group)
            self._privileged[caller.uid] = (now, yes)
        return yes

    def privileged_uid(self, uid: int) -> bool:
        try:
            gid = pwd.getpwuid(uid).pw_gid
        except KeyError:
            gid = -1
        return self.privileged(Caller(0, uid, gid))

    def unread(self, uid: int) -> int:
        """Bytes of replies that `uid`'s connections have not read yet (held by the daemon), as
        summed at most UNREAD_FRESH seconds ago."""
        now = time.monotonic()
        at, held = self._unread.get(uid, (0.0, 0))
        if now - at >= UNREAD_FRESH:
            held = sum(w.transport.get_write_buffer_size() for w in self.conns.get(uid, ()))
            self._unread[uid] = (now, held)
        return held

    def connected(self, conn: socket.socket) -> None:
        """The acceptor's hand-off. A connection past its user's bounds is told so and closed here,
        before asyncio makes anything for it (a flood of them costs an accept, a send and a close
        each); the others are served by handle()."""
        try:
            pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except OSError:
            conn.close()
            return
        caller = Caller(pid, uid, gid)
        why = self._refusal(caller)
        if why is not None:
            self.refused += 1
            try:
                conn.setblocking(False)
                conn.send(protocol.error(why, protocol.UNAVAILABLE))
            except OSError:
                pass
            conn.close()
            return
        self.count[uid] = self.count.get(uid, 0) + 1
        self.total += 1
        reader = asyncio.StreamReader(limit=READ_LIMIT)
        proto = Connection(reader, lambda r, w: self.handle(r, w, caller))
        asyncio.ensure_future(self._attach(conn, proto, uid))

    async def _attach(self, conn: socket.socket, proto: Connection, uid: int) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: proto, sock=conn)
        except OSError as e:
            log.warning("a new connection could not be set up: %s", e)
            conn.close()
            self._release(uid)

    def _release(self, uid: int) -> None:
        self.total -= 1
        n = self.count.get(uid, 1) - 1
        if n > 0:
            self.count[uid] = n
        else:
            self.count.pop(uid, None)

    def _refusal(self, caller: Caller) -> str | None:
        """Why a new connection of `caller` is not taken (one line), or None."""
        limit, n = self.d.config.max_connections_per_user, self.count.get(caller.uid, 0)
        over = limit and n >= limit
        if not (over or self.total >= _room()) or self.privileged(caller):
            return None
        if over:  # (by uid: a name would be looked up for each one refused)
            log.warning("uid %d has %d connections open: more refused (max_connections_per_user)", caller.uid, n)
            return (f"you have {n} connections to the colo daemon open, the most allowed (max_connections_per_user); "
                    "close some (unfinished `colo wait`, `logs -f`) and try again")
        log.warning("%d connections open, near the daemon's descriptor limit: uid %d refused", self.total, caller.uid)
        return "the colo daemon is near its descriptor limit; try again shortly"

    async def _request(self, reader: asyncio.StreamReader, caller: Caller) -> bytes:
        """The request line (or what came before EOF), read piece by piece so that its bytes are
        counted against its user's MAX_PENDING as they come, and bounded by its op's size."""
        uid, buf, limit = caller.uid, bytearray(), SMALL_LINE
        try:
            while True:
                try:
                    part = await reader.readuntil(b"\n")
                    done = True
                except asyncio.IncompleteReadError as e:  # the end of what it sends: that is the request
                    part, done = e.partial, True
                except asyncio.LimitOverrunError as e:
                    part, done = await reader.readexactly(e.consumed), False
                buf += part
                self.pending[uid] = self.pending.get(uid, 0) + len(part)
                if limit == SMALL_LINE and len(buf) > SMALL_LINE and (m := _OP.search(buf, 0, 256)) \
                        and m.group(1).decode() in LARGE_OPS:
                    limit = protocol.MAX_LINE
                if len(buf) > limit:
                    raise Refused(f"request larger than {limit} bytes" + (
                        "" if limit == protocol.MAX_LINE else
                        f" (only {', '.join(sorted(LARGE_OPS))} may send up to {protocol.MAX_LINE})"),
                        protocol.BAD_REQUEST)
                if self.pending[uid] > MAX_PENDING and caller.uid not in (0, os.geteuid()):
                    raise Refused(f"your connections hold {self.pending[uid] >> 20} MiB of unfinished requests, "
                                  f"the most allowed ({MAX_PENDING >> 20} MiB); finish or close them first",
                                  protocol.UNAVAILABLE)
                if done:
                    return bytes(buf)
        finally:
            left = self.pending.get(uid, 0) - len(buf)
            if left > 0:
                self.pending[uid] = left
            else:
                self.pending.pop(uid, None)
            if len(buf) >= heap.MMAP_AT:
                del buf
                heap.trim()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, caller: Caller) -> None:
        """One connection of `caller` (admitted by connected()): its request and the reply."""
        streaming = False
        mine = self.conns.setdefault(caller.uid, set())
        mine.add(writer)
        try:
            try:
                line = await asyncio.wait_for(self._request(reader, caller), REQUEST_TIMEOUT)
            except asyncio.TimeoutError:
                return
            if not line.strip():
                return
            try:
                op, args = protocol.parse_request(line)
            except protocol.ProtocolError as e:
                writer.write(protocol.error(str(e), e.code))
                return
            if len(line) > SMALL_LINE and op not in LARGE_OPS:  # (its first bytes named another op)
                raise Refused(f"request larger than {SMALL_LINE} bytes", protocol.BAD_REQUEST)
            del line
            if caller.uid != 0 and (held := self.unread(caller.uid)) > MAX_UNREAD:
                writer.write(protocol.error(
                    f"{held >> 20} MiB of replies to your earlier requests are still unread; read or close "
                    "those connections first", protocol.UNAVAILABLE))
                return
            try:
                fn = getattr(self.api, op)
                if op in STREAMS:
                    n, most = self.streams.get(caller.uid, 0), self.d.config.max_streams_per_user
                    if most and n >= most and not self.privileged(caller):
                        self.refused += 1
                        raise Refused(f"you have {n} streams (wait, logs -f, sessions) open, the most allowed "
                                      "(max_streams_per_user); end some and try again", protocol.UNAVAILABLE)
                    self.streams[caller.uid] = n + 1
                    streaming = True
                    await self._stream(fn(caller, args), reader, writer, op in ATTACHED)
                else:
                    result = await fn(caller, args)
                    if isinstance(result, Pieces):
                        size, reply = await self._pieces(op, result, writer), None
                    else:
                        reply = protocol.ok(result)
                        writer.write(reply)
                        size = len(reply)
                    del result, reply  # what is unsent, the transport holds: not a second copy while it drains
                    if size >= BIG_REPLY:
                        # what made it (a row for each of 50,000 jobs, most not kept) is free now, in
                        # pieces between the rows that are kept: given back (~11 MiB at 50,000 queued)
                        heap.trim(now=True)
            except ApiError as e:
                writer.write(protocol.error(str(e), e.code))
            except Unavailable as e:  # e.g. the Docker engine is restarting
                writer.write(protocol.error(f"{e}; try again when it answers", protocol.UNAVAILABLE))
            except StoreError as e:  # e.g. the state disk is full: nothing was stored
                log.error("op %s: %s", op, e)
                writer.write(protocol.error(str(e), protocol.UNAVAILABLE))
            except (ConnectionError, Refused):
                raise  # the client hung up: not the daemon's fault, see below
            except Exception as e:  # noqa: BLE001 - one bad request must not take the daemon down
                log.error("op %s failed: %s", op, e, exc_info=True)  # (logflood: one traceback a minute)
                writer.write(protocol.error(f"internal error: {e.__class__.__name__}: {e}", protocol.INTERNAL))
        except Refused as e:
            writer.write(protocol.error(str(e), e.code))
        except ConnectionError as e:  # BrokenPipe, ConnectionReset: a client that went away
            log.debug("client pid %s hung up (%s)", caller.pid, e.__class__.__name__)
        finally:
            try:
                if writer.transport.get_write_buffer_size():  # (else no task and timer for each one)
                    await asyncio.wait_for(writer.drain(), REPLY_TIMEOUT)
                writer.close()
            except asyncio.TimeoutError:  # it does not read: what it was sent is dropped with it
                writer.transport.abort()
            except (ConnectionError, BrokenPipeError, RuntimeError):
                writer.transport.abort()
            if streaming:
                n = self.streams.get(caller.uid, 1) - 1
                if n > 0:
                    self.streams[caller.uid] = n
                else:
                    self.streams.pop(caller.uid, None)
            mine.discard(writer)
            self._release(caller.uid)
            self._unread.pop(caller.uid, None)  # (what it held is gone: summed afresh next time)
            if not mine:
                self.conns.pop(caller.uid, None)

    async def _pieces(self, op: str, result: Pieces, writer: asyncio.StreamWriter) -> int:
        """A reply made a slice at a time (slices.py): each piece written as it comes, so that the
        daemon never holds the whole reply twice (made, then copied to the transport). What the
        client has not read yet, the transport holds, counted in its user's MAX_UNREAD as any
        other reply; waiting for the client to read would keep the reply's snapshot instead,
        uncounted, for as long as the client likes. A failure before the first piece is answered
        as any other; after it, the reply is cut off (the client sees the connection end
        mid-reply) and the failure logged. Returns the bytes written."""
        parts, size = result.parts, 0
        with held():  # (the snapshot and the rows made are walked by no collection meanwhile)
            try:
                async for piece in parts:
                    if not size:
                        writer.write(protocol.OK_HEAD)
                        size = len(protocol.OK_HEAD)
                    if writer.transport.is_closing():
                        raise ConnectionError("the client went away mid-reply")
                    writer.write(piece)
                    size += len(piece)
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as e:  # noqa: BLE001 - the reply is cut off; the daemon goes on
                if not size:
                    raise
                log.error("op %s failed mid-reply: %s", op, e, exc_info=True)
                writer.transport.abort()
                return size
            finally:
                await parts.aclose()  # (its snapshot is let go at once, whatever ended it)
        if not size:
            writer.write(protocol.OK_HEAD)
            size = len(protocol.OK_HEAD)
        writer.write(protocol.OK_END)
        c = result.clock
        c.end()
        size += len(protocol.OK_END)
        if c.slices > 1:
            log.debug("op %s: %d bytes in %d slices, the longest %.1f ms", op, size, c.slices, c.longest * 1000)
        return size

    async def _stream(self, events, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      attached: bool) -> None:
        """A stream lives as long as its client: the client sends nothing after its request, so
        anything read is its hang-up, which ends the stream at once (a session's `finally` cancels
        its job; a `wait` or `logs -f` stops), not at the next event written, which for a `wait`
        may be hours away. A failed write ends it too. The end of what a session's client sends
        is its hang-up; a `wait` or `logs` client may only have shut its sending side (see _gone)."""
        hangup = asyncio.ensure_future(reader.read(1) if attached else _gone(reader, writer))
        step = None
        try:
            while True:
                step = asyncio.ensure_future(events.__anext__())
                await asyncio.wait({step, hangup}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    return
                try:
                    ev = step.result()
                except StopAsyncIteration:
                    writer.write(protocol.ok(None))
                    return
                if "final" in ev:
                    writer.write(protocol.ok(ev["final"]))
                    return
                fd = ev.pop(protocol.PASS_FD, None)
                if fd is None:
                    writer.write(protocol.event(ev))
                    await writer.drain()
                    continue
                fds = fd if isinstance(fd, tuple) else (fd,)  # (a session's pipes: three)
                try:
                    await writer.drain()  # what went before it, in order
                    await _send_fd(writer, protocol.event(ev), fds)
                finally:
                    for fd in fds:
                        os.close(fd)  # the daemon keeps no copy: the client's is the only one
        finally:
            if hangup.done() and not hangup.cancelled():
                hangup.exception()  # (a reset connection: a hang-up like any other)
            hangup.cancel()
            if step is not None and not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            await events.aclose()


async def _gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Returns when the client of a `wait` or `logs` has gone. At the end of what it sends, an empty
    write tells a closed connection (EPIPE) from one whose client only shut its sending side and
    still reads (a script's `shutdown(SHUT_WR)`); the latter is asked again every few seconds."""
    if await reader.read(1):
        return
    fd = writer.get_extra_info("socket").fileno()
    while True:
        try:
            os.write(fd, b"")
        except OSError:
            return
        await asyncio.sleep(HALF_CLOSED_CHECK)


async def _send_fd(writer: asyncio.StreamWriter, data: bytes, fds: tuple[int, ...]) -> None:
    """`data` with `fds` on its first byte (SCM_RIGHTS). Through a duplicate of the connection's
    socket (asyncio's own does not send ancillary data); it shares the non-blocking file."""
    s = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))
    try:
        for _ in range(6000):  # a client that reads nothing for a minute is dropped (REPLY_TIMEOUT)
            try:
                sent = socket.send_fds(s, [data], list(fds))
                break
            except BlockingIOError:
                await asyncio.sleep(0.01)
        else:
            raise ConnectionError("the client does not read")
        if sent < len(data):
            writer.write(data[sent:])
    finally:
        s.close()


def _prepare_socket(config: Config) -> None:
    path = config.socket
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(path))
        except OSError:
            path.unlink()  # stale: its daemon is gone (the state lock already said so)
        else:
            raise RuntimeError(f"another daemon answers on {path}")
        finally:
            s.close()


FD_LIMIT = 1 << 16


def raise_fd_limit(want: int = FD_LIMIT) -> int:
    """One descriptor per client connection and per followed job: services start with a soft limit
    of 1024 (systemd), which a lab's worth of `colo logs -f` and idle clients can use up. Root may
    raise the hard limit too (up to the kernel's fs.nr_open). Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want and os.geteuid() == 0:
        try:
            nr_open = int(open("/proc/sys/fs/nr_open").read())
        except (OSError, ValueError):
            nr_open = hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, max(hard, min(want, nr_open))))
        except (OSError, ValueError):
            pass
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return FD_LIMIT if soft == resource.RLIM_INFINITY else soft


async def serve(config: Config, load: Callable[[], Config] | None = None) -> None:
    """load: reads the config again (SIGHUP), as it was read at start."""
    fd_limit = raise_fd_limit()
    heap.fix_thresholds()
    summary = logflood.install()
    daemon = Daemon(config)
    daemon.open()
    try:
        _prepare_socket(config)
        server = Server(daemon)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(config.socket))
        sock.listen(1024)  # bursts of clients wait here, not refused
        if config.socket_group:
            os.chown(config.socket, -1, grp.getgrnam(config.socket_group).gr_gid)
        os.chmod(config.socket, config.socket_mode)
        loop = asyncio.get_running_loop()
        server.acceptor = acceptor = Acceptor(sock, server.connected, server.privileged_uid)
        acceptor.start()
        loop.set_default_executor(ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="colo"))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        if load is not None:  # `systemctl reload colo`: what can change live (reload.py)
            loop.add_signal_handler(signal.SIGHUP, reload.reload, daemon, load)
        flush = loop.call_later(logflood.WINDOW, _every, loop, logflood.WINDOW, summary.flush)
        log.info("colo daemon listening on %s, state in %s (%d descriptors)", config.socket, config.state_dir,
                 fd_limit)
        systemd.notify("READY=1")  # the unit's Type=notify: `systemctl start` returns now, not before
        try:
            await daemon.run()
        finally:
            flush.cancel()
            acceptor.close()
            sock.close()
            try:
                config.socket.unlink()
            except FileNotFoundError:
                pass
    finally:
        daemon.close()


def _every(loop: asyncio.AbstractEventLoop, seconds: float, fn) -> None:
    fn()
    loop.call_later(seconds, _every, loop, seconds, fn)
