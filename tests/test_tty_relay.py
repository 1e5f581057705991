"""colo/runtimes/ttyrelay.py without an engine: a socket pair stands for the container's attach
stream."""
from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
import termios
import threading

import pytest

from colo.runtimes import ttyrelay


def _read_until(fd: int, want: bytes, timeout: float) -> bytes:
    got = b""
    while want not in got:
        r, _, _ = select.select([fd], [], [], timeout)
        if not r:
            break
        got += os.read(fd, 4096)
    return got


@pytest.mark.slow  # two 1 s looks that nothing crossed
def test_the_containers_bytes_do_not_wait_for_a_slow_resize_and_keys_do():
    """The engine's resize can take long on a busy node (a session's first one included): the
    container's first line reaches its terminal meanwhile; keys typed wait for the size, as on a
    terminal (`stty size` typed after a resize says the new one)."""
    master, slave = os.openpty()
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 90, 0, 0))
    engine, ours = socket.socketpair()
    engine.settimeout(60)
    asked, gates, seen = [], [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]

    def resize(rows: int, cols: int) -> None:
        asked.append((rows, cols))
        seen[len(asked) - 1].set()
        gates[len(asked) - 1].wait(60)

    relay = ttyrelay.Relay("t", slave, ours, resize)
    relay.start()
    try:
        engine.sendall(b"session-42\r\n")
        assert b"session-42" in _read_until(master, b"session-42", 60)
        assert seen[0].wait(60) and asked == [(30, 90)]  # (the sizer's call, still under way)
        os.write(master, b"a")
        assert not select.select([engine], [], [], 1.0)[0]  # the key waits for the size
        gates[0].set()
        assert engine.recv(16) == b"a"
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
        os.write(master, b"b")  # typed after the window changed: it reaches the container after the size
        assert seen[1].wait(60) and asked == [(30, 90), (40, 100)]
        assert not select.select([engine], [], [], 1.0)[0]
        engine.sendall(b"more\r\n")  # the container's bytes flow all the same
        assert b"more" in _read_until(master, b"more", 60)
        gates[1].set()
        assert engine.recv(16) == b"b"
    finally:
        for g in gates:
            g.set()
        engine.close()  # the container's stream ends: the relay ends, and closes its ends
        relay.join(60)
        os.close(master)
    assert not relay.is_alive()


def test_a_refused_resize_is_tried_again():
    master, slave = os.openpty()
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    engine, ours = socket.socketpair()
    asked, twice = [], threading.Event()

    def resize(rows: int, cols: int) -> None:
        asked.append((rows, cols))
        if len(asked) == 1:
            raise RuntimeError("the engine refused it")
        twice.set()

    relay = ttyrelay.Relay("t", slave, ours, resize)
    relay.start()
    try:
        assert twice.wait(60)  # at the next look (SIZE_LOOK)
        assert asked == [(24, 80), (24, 80)]
    finally:
        engine.close()
        relay.join(60)
        os.close(master)
