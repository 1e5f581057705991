"""The Unix socket: one JSON request per line, caller identified by SO_PEERCRED."""
from __future__ import annotations

import asyncio
import grp
import logging
import os
import resource
import signal
import socket
import struct
import traceback
from concurrent.futures import ThreadPoolExecutor

from .. import protocol
from ..config import Config
from ..runtimes.base import Unavailable
from ..store import StoreError
from .api import ATTACHED, STREAMS, Api, ApiError
from . import systemd
from .core import Daemon
from .validate import Caller

log = logging.getLogger("colo")
IDLE_TIMEOUT = 60.0  # a connection that sends no request in this long is closed
REPLY_TIMEOUT = 60.0  # a reply not taken in this long: the connection is dropped
# Bytes of replies one user's connections may leave unread before their next requests are refused.
# A client that asks and never reads would otherwise have the daemon hold each reply (an `ls` of a
# queue of long commands is megabytes) for as long as it keeps the connection: a few hundred such
# connections took gigabytes of the root daemon's memory. A stream (logs -f) holds one event at most.
MAX_UNREAD = 64 << 20
# Short blocking calls (Docker, NVML, starts and stops); waits for a job's exit have threads of
# their own (core.blocking). Threads are made only when needed.
WORKER_THREADS = 64


def peer(writer: asyncio.StreamWriter) -> Caller:
    sock = writer.get_extra_info("socket")
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return Caller(pid, uid, gid)


class Server:
    def __init__(self, daemon: Daemon):
        self.d = daemon
        self.api = Api(daemon)
        self.conns: dict[int, set[asyncio.StreamWriter]] = {}  # uid -> its open connections

    def unread(self, uid: int) -> int:
        """Bytes of replies that `uid`'s connections have not read yet (held by the daemon)."""
        return sum(w.transport.get_write_buffer_size() for w in self.conns.get(uid, ()))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        caller = None
        try:
            caller = peer(writer)
            self.conns.setdefault(caller.uid, set()).add(writer)
            try:
                line = await asyncio.wait_for(reader.readline(), IDLE_TIMEOUT)
            except (asyncio.LimitOverrunError, ValueError):
                writer.write(protocol.error(f"request larger than {protocol.MAX_LINE} bytes", protocol.BAD_REQUEST))
                return
            except asyncio.TimeoutError:
                return
            if not line.strip():
                return
            try:
                op, args = protocol.parse_request(line)
            except protocol.ProtocolError as e:
                writer.write(protocol.error(str(e), e.code))
                return
            if (held := self.unread(caller.uid)) > MAX_UNREAD:
                writer.write(protocol.error(
                    f"{held >> 20} MiB of replies to your earlier requests are still unread; read or close "
                    "those connections first", protocol.UNAVAILABLE))
                return
            try:
                fn = getattr(self.api, op)
                if op in ATTACHED:
                    await self._attached(fn(caller, args), reader, writer)
                elif op in STREAMS:
                    async for ev in fn(caller, args):
                        if "final" in ev:
                            writer.write(protocol.ok(ev["final"]))
                            break
                        writer.write(protocol.event(ev))
                        await writer.drain()
                    else:
                        writer.write(protocol.ok(None))
                else:
                    writer.write(protocol.ok(await fn(caller, args)))
            except ApiError as e:
                writer.write(protocol.error(str(e), e.code))
            except Unavailable as e:  # e.g. the Docker engine is restarting
                writer.write(protocol.error(f"{e}; try again when it answers", protocol.UNAVAILABLE))
            except StoreError as e:  # e.g. the state disk is full: nothing was stored
                log.error("op %s: %s", op, e)
                writer.write(protocol.error(str(e), protocol.UNAVAILABLE))
            except ConnectionError:
                raise  # the client hung up: not the daemon's fault, see below
            except Exception as e:  # noqa: BLE001 - one bad request must not take the daemon down
                log.error("op %s failed: %s", op, traceback.format_exc())
                writer.write(protocol.error(f"internal error: {e.__class__.__name__}: {e}", protocol.INTERNAL))
        except ConnectionError as e:  # BrokenPipe, ConnectionReset: a client that went away
            log.debug("client pid %s hung up (%s)", caller.pid if caller else "?", e.__class__.__name__)
        finally:
            try:
                await asyncio.wait_for(writer.drain(), REPLY_TIMEOUT)
                writer.close()
            except asyncio.TimeoutError:  # it does not read: what it was sent is dropped with it
                writer.transport.abort()
            except (ConnectionError, BrokenPipeError, RuntimeError):
                pass
            if caller is not None:
                mine = self.conns.get(caller.uid)
                if mine is not None:
                    mine.discard(writer)
                    if not mine:
                        del self.conns[caller.uid]

    async def _attached(self, events, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A stream that lives as long as its client (a session): the client sends nothing after its
        request, so anything read, or the end of what it sends, is its hang-up, which ends the stream
        at once (its `finally` cancels the session's job), not at the next event written."""
        hangup = asyncio.ensure_future(reader.read(1))
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
                try:
                    await writer.drain()  # what went before it, in order
                    await _send_fd(writer, protocol.event(ev), fd)
                finally:
                    os.close(fd)  # the daemon keeps no copy: the client's is the only one
        finally:
            if hangup.done() and not hangup.cancelled():
                hangup.exception()  # (a reset connection: a hang-up like any other)
            hangup.cancel()
            if step is not None and not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            await events.aclose()


async def _send_fd(writer: asyncio.StreamWriter, data: bytes, fd: int) -> None:
    """`data` with `fd` on its first byte (SCM_RIGHTS). Through a duplicate of the connection's
    socket (asyncio's own does not send ancillary data); it shares the non-blocking file."""
    s = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))
    try:
        for _ in range(6000):  # a client that reads nothing for a minute is dropped (REPLY_TIMEOUT)
            try:
                sent = socket.send_fds(s, [data], [fd])
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


def _raise_fd_limit(want: int = 1 << 16) -> None:
    """One descriptor per client connection and per followed job: services start with a soft limit
    of 1024 (systemd), which a lab's worth of `colo logs -f` and idle clients can use up."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def serve(config: Config) -> None:
    _raise_fd_limit()
    daemon = Daemon(config)
    daemon.open()
    try:
        _prepare_socket(config)
        server = Server(daemon)
        srv = await asyncio.start_unix_server(server.handle, path=str(config.socket), limit=protocol.MAX_LINE,
                                              backlog=1024)  # bursts of clients wait here, not refused
        if config.socket_group:
            os.chown(config.socket, -1, grp.getgrnam(config.socket_group).gr_gid)
        os.chmod(config.socket, config.socket_mode)
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="colo"))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        log.info("colo daemon listening on %s, state in %s", config.socket, config.state_dir)
        systemd.notify("READY=1")  # the unit's Type=notify: `systemctl start` returns now, not before
        try:
            await daemon.run()
        finally:
            srv.close()
            try:
                config.socket.unlink()
            except FileNotFoundError:
                pass
    finally:
        daemon.close()
