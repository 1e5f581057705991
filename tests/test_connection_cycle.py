"""A connection that ends is freed by reference counting alone (issue 41). The daemon moves what
lives long out of the cyclic collector's sight (gc.freeze after a pass, passcost.settle), and the
connections open at that moment with it: before Python 3.12 asyncio's socket transport holds a
bound method of itself, so each such transport, once its connection ended, was kept for good (86
after a queue of 50,000 filled by 10 clients). server.Connection breaks that cycle when the
connection is lost. A real socket and asyncio's own transport; colo's protocol class."""
from __future__ import annotations

import asyncio
import gc
import socket
import weakref

from colo.daemon.server import Connection


def test_a_connection_open_at_a_freeze_is_freed_when_it_ends():
    async def go() -> bool:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        served = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(await reader.readuntil(b"\n"))
            writer.close()
            served.set()

        transport, _ = await loop.connect_accepted_socket(lambda: Connection(asyncio.StreamReader(), handle),
                                                          sock=ours)
        gone = weakref.ref(transport)
        del transport
        gc.collect()
        gc.freeze()  # as the daemon does, with this connection open
        try:
            theirs.sendall(b"hello\n")
            await served.wait()
            assert theirs.recv(64) == b"hello\n"
            for _ in range(1000):  # the transport's connection_lost comes a few turns after its close
                if gone() is None:
                    return True
                await asyncio.sleep(0)
            return False
        finally:
            gc.unfreeze()
            theirs.close()

    assert asyncio.run(go()), "the ended connection's transport is still alive: only the collector could free it"
