"""What a command server's child does (colo/cli/fastserve.py): become the process the Python
script would have been, then run colo.cli.entry's command().

It takes the client's descriptors as 0, 1 and 2 and its directory, its umask, environment (and the
time zone in it), the signals it ignored and blocked, and its argv; makes sys.stdin, stdout and
stderr as the interpreter's start makes them (so isatty, buffering and encoding are a fresh
interpreter's); then, once it says STARTED (before that, any failure is the client's cue to run the
script itself), runs the command and ends as the interpreter would: SystemExit's code, a
traceback and 1, atexit hooks and threads, the flush of stdout.
"""
from __future__ import annotations

import io
import os
import signal
import struct
import sys

# The records both ways (native/client/colo.c's): two native int32s, a type and a value.
STARTED, EXITED, SIGNALLED, REFUSED, STALE, FORWARD = 1, 2, 3, 4, 5, 6
REC = struct.Struct("=ii")


def child(server, conn, fds: list[int], fields: list[bytes]) -> None:
    """In the forked child; never returns."""
    try:
        server.close_in_child()
        umask, ignored, blocked, nargs = (int(fields[3], 8), int(fields[4]), int(fields[5]), int(fields[6]))
        args = fields[7:7 + nargs]
        env = fields[7 + nargs:]
        for sig in range(1, 65):
            if ignored >> (sig - 1) & 1 and sig not in (signal.SIGKILL, signal.SIGSTOP):
                try:
                    signal.signal(sig, signal.SIG_IGN)
                except (OSError, ValueError):
                    pass  # (glibc's own real-time signals)
        signal.pthread_sigmask(signal.SIG_SETMASK, [s for s in range(1, 65) if blocked >> (s - 1) & 1
                                                    and s in signal.valid_signals()])
        for i, fd in enumerate(fds[:3]):
            os.dup2(fd, i)
        os.fchdir(fds[3])
        for fd in fds:
            os.close(fd)
        os.umask(umask)
        _environ(env, server.added)
        script = fields[2].decode()
        sys.argv = [os.path.join(os.path.dirname(script), "colo"), *map(os.fsdecode, args)]
        _stdio()
        import importlib

        importlib.invalidate_caches()  # a module added since the server's imports (same-second mtimes)
        conn.setblocking(True)
        conn.sendall(REC.pack(STARTED, os.getpid()))
        conn.close()
    except BaseException:
        os._exit(127)  # not started: the client runs the script instead
    _run()


def _environ(env: list[bytes], added: dict[bytes, bytes]) -> None:
    import time

    os.environb.clear()
    for e in env:
        k, sep, v = e.partition(b"=")
        if sep and k:
            os.environb[k] = v
    os.environb.update(added)  # what the interpreter's start adds (LC_CTYPE, coercing the C locale)
    time.tzset()


def _stdio() -> None:
    """As CPython's create_stdio: buffered unless -u (stdin always), the raw file named <stdout>,
    line-buffered on a terminal (stderr always), "\\n" newlines, the encoding and errors the server's
    own start chose (its locale variables are the client's: identity)."""
    unbuffered = sys.__stdout__.write_through  # (-u, PYTHONUNBUFFERED: as the server's own start saw them)
    made = []
    for fd, name, old in ((0, "<stdin>", sys.__stdin__), (1, "<stdout>", sys.__stdout__), (2, "<stderr>", sys.__stderr__)):
        write = fd != 0
        buffered = not (unbuffered and write)
        buf = io.open(fd, "wb" if write else "rb", -1 if buffered else 0, closefd=False)
        raw = buf.raw if buffered else buf
        raw.name = name
        tty = raw.isatty()
        s = io.TextIOWrapper(buf, old.encoding, old.errors, newline="\n",
                             line_buffering=not unbuffered and (tty or fd == 2), write_through=unbuffered)
        s.mode = "w" if write else "r"
        made.append(s)
    sys.stdin, sys.stdout, sys.stderr = made
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = made


def _run() -> None:
    """command(), then the interpreter's end, as `python colo-py ...` would have it."""
    code, by_sigint = 0, False
    try:
        from .entry import command

        command()
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            try:
                print(e.code, file=sys.stderr)
            except Exception:
                pass
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        by_sigint = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        pass
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            code = 120  # (as Py_FinalizeEx, when flushing stdout fails)
    if by_sigint:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)
