"""The per-user command server behind the compiled `colo` (native/client/colo.c; docs/fastcli.md).

As Mercurial's chg: a Python process of this user with the hot commands' modules imported once,
which forks a child per request; the child takes the client's stdin, stdout, stderr and current
directory (passed as descriptors), its environment, umask, signal dispositions and argv, and runs
colo.cli.entry's command() as the script would (colo/cli/fastrun.py). The exit status goes back to
the client, which exits with it.

It serves only what a fresh interpreter of its own kind would do alike: a client whose identity
(the script, uid, gids, limits, niceness, the variables Python reads at start: `identity`) equals
the one it started with, of its own uid (SO_PEERCRED), while nothing it imported changed on disk
(`Snapshot`: an editable install's edit takes effect at the next call). Otherwise it answers
REFUSED or STALE (then exits), before anything ran, and the client runs the Python script itself.
It exits after IDLE seconds with nothing to do.
"""
from __future__ import annotations

import fcntl
import os
import resource
import selectors
import signal
import socket
import stat
import struct
import sys
import time

from .fastrun import EXITED, FORWARD, REC, REFUSED, SIGNALLED, STALE, child

# Five minutes: a person's bursts of commands (and a `watch colo ls`) keep it, a day's idle hours do
# not hold ~11 MiB of RSS per user; a restart costs one call at the Python path's speed.
IDLE = 300.0
HOT = ("ls", "show", "cancel", "submit", "logs", "wait", "explain", "history", "gpus")  # the client's list (native/client/colo.c)
MAGIC = b"COLOFAST1"
MAX_REQUEST = 8 << 20  # argv and environment together stay under the kernel's (ARG_MAX) by far


def identity(script: str, environ: dict[bytes, bytes]) -> bytes:
    """The client's `identity()` text of this process as it started (`environ`: the environment it
    was started with)."""
    rl = []
    for r in range(16):  # Linux's RLIMIT_CPU (0) to RLIMIT_RTTIME (15)
        soft, hard = resource.getrlimit(r)
        rl.append(f"{'inf' if soft == resource.RLIM_INFINITY else soft}:{'inf' if hard == resource.RLIM_INFINITY else hard},")
    text = (f"script={script}\nuid={os.getuid()}\ngid={os.getgid()}\ngroups={','.join(map(str, sorted(os.getgroups())))}"
            f"\nnice={os.getpriority(os.PRIO_PROCESS, 0)}\nlimits={''.join(rl)}").encode()
    env = sorted(k + b"=" + v for k, v in environ.items()
                 if k.startswith((b"PYTHON", b"LC_")) or k in (b"LANG", b"LANGUAGE", b"HOME"))
    return text + b"".join(b"\nenv=" + e for e in env)


def start_environ() -> dict[bytes, bytes]:
    """The environment this process was started with (Python's start may have added to os.environ:
    LC_CTYPE, when it coerces the C locale)."""
    with open("/proc/self/environ", "rb") as f:
        return dict(e.partition(b"=")[::2] for e in f.read().split(b"\0") if b"=" in e)


class Snapshot:
    """What this process's code came from: every imported module's file, sys.path's folders (a
    package installed or removed), the interpreter and the script, as stat() saw them."""

    def __init__(self, script: str):
        paths = {script, sys.executable, os.path.realpath(sys.executable)}
        paths.update(p for p in sys.path if p)
        site = sys.modules.get("site")
        if site is not None and getattr(site, "USER_SITE", None):
            paths.add(site.USER_SITE)
        for m in list(sys.modules.values()):
            f = getattr(m, "__file__", None)
            if isinstance(f, str):
                paths.add(f)
        self.paths = sorted(paths)
        self.seen = self._look()

    def _look(self) -> list:
        out = []
        for p in self.paths:
            try:
                st = os.stat(p)
                out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
            except OSError:
                out.append(None)
        return out

    def stale(self) -> bool:
        return self._look() != self.seen

    def touched_since(self, t_ns: int) -> bool:
        """Whether a file changed after t_ns (and not in the future: a skewed clock's): while this
        process imported it, so which version it holds is unknown."""
        now = time.time_ns()
        return any(s is not None and t_ns <= s[3] <= now for s in self.seen)


def _own_dir(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def preload() -> None:
    """What the hot commands run, imported once here rather than in every child."""
    import json  # noqa: F401 (--json)

    from . import argv, entry, out  # noqa: F401
    from .options import BY_NAME

    for name in HOT:
        module = BY_NAME[name].run.partition(":")[0]
        __import__(module)


def serve(script: str, sock_path: str) -> None:
    """Serve at sock_path (in a directory only this user may enter) until idle; one server per
    socket (a lock beside it). Returns when it will not serve."""
    os.chdir("/")
    if not all(os.path.isabs(p) for p in sys.path) or not hasattr(os, "pidfd_open"):
        return  # a relative sys.path entry is read from each caller's directory; no pidfd: no watch
    if not _own_dir(os.path.dirname(sock_path)):
        return
    t0 = time.time_ns() - 2_000_000_000  # (a coarse file system's mtime granularity)
    env0 = start_environ()
    added = {k: v for k, v in os.environb.items() if env0.get(k) != v}
    me = identity(script, env0)
    preload()
    snap = Snapshot(script)
    if snap.touched_since(t0):
        return  # an edit while we loaded: the next call starts a server on the new code
    lock = os.open(sock_path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another server has it
    try:
        os.unlink(sock_path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    listener.setblocking(False)
    server = Server(listener, me, script, added, snap)
    server.path, server.ino, server.lock = sock_path, os.stat(sock_path).st_ino, lock
    server.run()
    server.retire()


class Server:
    def __init__(self, listener: socket.socket, me: bytes, script: str, added: dict, snap: Snapshot):
        self.listener, self.me, self.script, self.added, self.snap = listener, me, script, added, snap
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, ("listen", None))
        self.children: dict[socket.socket, tuple[int, int]] = {}  # connection: (pid, pidfd)
        self.path, self.ino, self.lock = "", 0, -1
        self.retired = False

    def retire(self) -> None:
        """Take no more requests: the socket gone (if still ours), so the next client starts another."""
        if self.retired:
            return
        self.retired = True
        self.sel.unregister(self.listener)
        try:
            if os.stat(self.path).st_ino == self.ino:
                os.unlink(self.path)
        except OSError:
            pass
        self.listener.close()

    def run(self) -> None:
        """Until idle (or stale) with no command running."""
        last = time.monotonic()
        while not (self.retired and not self.children):
            events = self.sel.select(None if self.children else max(0.0, last + IDLE - time.monotonic()))
            if not events and not self.children:
                return
            for key, _ in events:
                what, conn = key.data
                if what == "listen":
                    self._accept()
                elif what == "conn":
                    self._from_client(conn)
                else:
                    self._reap(conn)
            last = time.monotonic()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        fds: list[int] = []
        try:
            pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():
                return conn.close()
            conn.settimeout(10)  # a client of our own that stalls delays only our own commands
            fields, fds = _read_request(conn)
            if fields is None or fields[1] != self.me or fields[2] != self.script.encode():
                return self._answer(conn, REFUSED)
            if self.snap.stale():
                self.retire()  # (the children running end as they would)
                return self._answer(conn, STALE)
            pid = os.fork()
            if pid == 0:
                child(self, conn, fds, fields)  # never returns
            pidfd = os.pidfd_open(pid)
        except OSError:
            return self._answer(conn, REFUSED)
        finally:
            for fd in fds:
                os.close(fd)
        conn.setblocking(False)
        self.children[conn] = (pid, pidfd)
        self.sel.register(conn, selectors.EVENT_READ, ("conn", conn))
        self.sel.register(pidfd, selectors.EVENT_READ, ("child", conn))

    def _answer(self, conn: socket.socket, what: int, value: int = 0) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(10)
            conn.sendall(REC.pack(what, value))
        except OSError:
            pass
        conn.close()

    def _from_client(self, conn: socket.socket) -> None:
        """A signal to pass on, or the client gone (then so is its command: killed)."""
        _pid, pidfd = self.children[conn]
        try:
            data = conn.recv(REC.size * 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(conn)
            _signal(pidfd, signal.SIGKILL)
            return
        for i in range(0, len(data) - REC.size + 1, REC.size):  # (records are 8 bytes: never split here)
            what, sig = REC.unpack_from(data, i)
            if what == FORWARD and 0 < sig < signal.NSIG:
                _signal(pidfd, sig)

    def _reap(self, conn: socket.socket) -> None:
        pid, pidfd = self.children.pop(conn)
        self.sel.unregister(pidfd)
        try:
            self.sel.unregister(conn)
        except KeyError:
            pass  # (the client went first)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            self._answer(conn, SIGNALLED, os.WTERMSIG(status))
        else:
            self._answer(conn, EXITED, os.waitstatus_to_exitcode(status))

    def close_in_child(self) -> None:
        """What a child must not keep: the listener, the selector, other clients and children."""
        self.sel.close()
        os.close(self.lock)  # (a long command must not keep the next server from its socket)
        if not self.retired:
            self.listener.close()
        for c, (_pid, pidfd) in self.children.items():
            c.close()
            os.close(pidfd)


def _signal(pidfd: int, sig: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except OSError:
        pass  # ended already


def _read_request(conn: socket.socket) -> tuple[list[bytes] | None, list[int]]:
    """The request's NUL-ended fields and the four descriptors (stdin, stdout, stderr, cwd)."""
    fds: list[int] = []
    msg, anc, flags, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(4 * 8))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"{len(data) // 4}i", data[:len(data) - len(data) % 4]))
    if flags & socket.MSG_CTRUNC or len(fds) != 4 or len(msg) < 4:
        return None, fds
    (size,) = struct.unpack("=I", msg[:4])
    if size > MAX_REQUEST:
        return None, fds
    parts = [msg[4:]]
    got = len(msg) - 4
    while got < size:
        chunk = conn.recv(min(1 << 20, size - got))
        if not chunk:
            return None, fds
        parts.append(chunk)
        got += len(chunk)
    fields = b"".join(parts).split(b"\0")
    if got != size or fields[-1] != b"" or len(fields) < 8 or fields[0] != MAGIC:
        return None, fds
    return fields[:-1], fds
