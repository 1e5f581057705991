"""The client's side of a session (`colo shell`, `colo run`), as `srun --pty` is.

It asks the daemon for a session (op `session`, colo/daemon/session.py), which queues the job and
sends back the master end of the job's terminal (SCM_RIGHTS) at once. While the job waits, the
terminal stays as it is (Ctrl-C here gives up: closing the connection cancels the job) and the
reasons it waits are shown. Once it starts, this terminal goes raw and bytes are copied both ways
between it and the job's terminal; keys such as Ctrl-C and Ctrl-Z are the job's terminal's to act
on, as a window size change is (copied to it on SIGWINCH). The job's terminal reads EIO when the
job has ended; its end (state, exit code) comes as the stream's final reply, and this terminal is
put back as it was.

`colo run` fed from a pipe (this client's stdin or stdout no terminal) gets no terminal, as
`docker run -i` and ssh without one: the daemon sends pipes instead (a host job's stdin, stdout
and stderr: three), or a socket (a container's input, and its stdout and stderr in the engine's
frames). This client's input goes to the job's as it comes, its end the input's end, and the job's
stdout and stderr come back apart, each written to its own here, byte for byte. Ctrl-C ends the
client, and so the job (cancelled).

When this terminal hangs up, the kernel's SIGHUP ends this client, and so the session (the
daemon cancels the job of a connection that closed). A client that was started with SIGHUP
ignored or blocked (inherited from whatever started it) would wait on: so a hang-up seen on the
terminal itself (a read of 0 bytes in raw mode, EIO, POLLHUP) ends it as SIGHUP would.
"""
from __future__ import annotations

import base64
import errno
import fcntl
import os
import select
import signal
import socket
import stat
import sys
import termios
import tty

from .. import protocol
from ..client import Client, ClientError, DaemonUnavailable
from ..textsafe import safe


def say(text: str) -> None:
    try:
        sys.stderr.write(f"colo: {safe(text)}\r\n" if _raw else f"colo: {safe(text)}\n")
        sys.stderr.flush()
    except OSError:  # a terminal that hung up (EIO): its hang-up is seen where the terminal is read
        pass


_raw = False  # this terminal is raw now (lines need their \r)


class _HungUp(Exception):
    """This terminal hung up."""


def _hang_up() -> None:
    """End as SIGHUP ends a process, whatever this one inherited for it (ignored, blocked)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    os.kill(os.getpid(), signal.SIGHUP)
    os._exit(128 + signal.SIGHUP)  # (not reached)


class _Conn:
    """The session's connection: the daemon's messages, and the descriptor that comes with one."""

    def __init__(self, sock) -> None:
        self.sock, self.buf, self.fds = sock, b"", []

    def fill(self) -> bool:
        """Read what is there; False at the end (the daemon closed the connection)."""
        data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
        self.fds += fds
        self.buf += data
        return bool(data)

    def messages(self):
        while (i := self.buf.find(b"\n")) >= 0:
            line, self.buf = self.buf[:i + 1], self.buf[i + 1:]
            msg = protocol.loads(line)
            if "ok" in msg and not msg["ok"]:
                raise ClientError(msg.get("error", "unknown error"), msg.get("code", "error"))
            yield msg

    def next(self, term: int | None = None) -> dict:
        """The next message, waiting for it (and watching terminal `term` for a hang-up)."""
        while True:
            for msg in self.messages():
                return msg
            if term is not None:
                p = select.poll()
                p.register(self.sock, select.POLLIN)
                p.register(term, 0)  # (hang-ups and errors only: typed keys stay for the job)
                while not (ready := dict(p.poll())).get(self.sock.fileno()):
                    if ready.get(term):
                        raise _HungUp()
            if not self.fill():
                raise DaemonUnavailable("colo daemon closed the connection (did it stop or restart?)", "unavailable")


def _terminal(fds: list[int]) -> int:
    """The job's terminal from what the daemon sent: a pty master (/dev/ptmx), nothing else. The
    connection's peer was proven root (or you) before a byte went (colo/client.py); this also keeps
    a descriptor of another kind (a file, a socket) from being written every keystroke."""
    master = fds.pop(0)
    for extra in fds:  # never more than one is meant: none is kept open
        os.close(extra)
    fds.clear()
    st = os.fstat(master)
    if not (stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (5, 2)):
        os.close(master)
        raise ClientError("the daemon sent a descriptor that is not a terminal's master: refused")
    return master


def _wire(fds: list[int]) -> list[int]:
    """A session's ends without a terminal (fed from a pipe), from what the daemon sent: a
    container's socket, or a host job's three pipes (the end that writes its stdin, those that read
    its stdout and stderr); nothing else."""
    ends = fds[:3] if len(fds) >= 3 else fds[:1]
    for extra in fds[len(ends):]:
        os.close(extra)
    fds.clear()
    modes = [(os.fstat(fd).st_mode, fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) for fd in ends]
    if not (len(ends) == 1 and stat.S_ISSOCK(modes[0][0])
            or len(ends) == 3 and all(stat.S_ISFIFO(m) for m, _ in modes)
            and [a for _, a in modes] == [os.O_WRONLY, os.O_RDONLY, os.O_RDONLY]):
        for fd in ends:
            os.close(fd)
        raise ClientError("the daemon sent descriptors that are neither a socket nor a session's pipes: refused")
    return ends


def _copy_size(src: int, dst: int) -> None:
    try:
        fcntl.ioctl(dst, termios.TIOCSWINSZ, fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        pass


def _prepare(master: int, stdout_tty: bool) -> None:
    """The job's terminal as this one (stdin: a session fed from a pipe has none) is: its modes
    and size."""
    attrs = termios.tcgetattr(0)
    _copy_size(0, master)
    if not stdout_tty:  # (colo shell > file) a file gets the job's lines as written, without \r
        attrs[1] &= ~termios.OPOST
    termios.tcsetattr(master, termios.TCSANOW, attrs)


DETACH_KEYS = "ctrl-\\,d"  # a detached session's client leaves it running on these keys (COLO_DETACH_KEYS)


def detach_keys(text: str) -> bytes:
    """Keys as docker's --detach-keys writes them ("ctrl-p,ctrl-q", "ctrl-\\,d") as the bytes a
    terminal sends; ValueError for anything else."""
    out = bytearray()
    for part in text.split(","):
        if len(part) == 1 and 32 < ord(part) < 127:
            out.append(ord(part))
        elif part.lower().startswith("ctrl-") and len(part) == 6 and part[5].upper() in "@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_":
            out.append(ord(part[5].upper()) ^ 0x40)
        else:
            raise ValueError(f"malformed detach keys {text!r}: keys such as ctrl-\\,d or ctrl-p,ctrl-q (a letter, or "
                             "ctrl- and one of @, A-Z, [, \\, ], ^, _), comma-separated")
    return bytes(out)


def run(client: Client, spec: dict | None = None, job: int | None = None, keys: bytes = b"") -> int:
    """Queue `spec` as a session, or take over detached session `job` (op `attach`, whose detach
    key is `keys`), wait for its start, then be its terminal until it ends (its exit code) or until
    it is detached from (0)."""
    stdin_tty, stdout_tty = os.isatty(0), os.isatty(1)
    sock = client.connect(None)
    conn = _Conn(sock)
    master, wire, job_id, replay, detachable = None, None, job, b"", False
    try:
        sock.sendall(protocol.request("session", spec=spec) if job is None else protocol.request("attach", id=job))
        waited = False
        while True:  # until it starts (or ends first)
            msg = conn.next(0 if stdin_tty else None)
            if "ok" in msg:  # it ended before the stream said it started: what it wrote is still there
                if wire is not None:
                    _piped(wire, conn, msg["result"])
                elif master is not None:
                    _relay(master, conn, stdin_tty, stdout_tty, msg["result"], replay)
                return _ended(msg["result"])
            ev = msg.get("event") or {}
            if "job" in ev:
                job_id = ev["job"]["id"]
            elif ev.get("tty"):
                if not conn.fds:
                    raise ClientError("the daemon sent no terminal")
                if ev.get("pipe"):
                    wire = _wire(conn.fds)
                    continue
                master = _terminal(conn.fds)
                replay, detachable = base64.b64decode(ev.get("replay") or ""), bool(ev.get("detachable"))
                if not ev.get("relay"):
                    _prepare(master, stdout_tty)
                elif stdin_tty:  # a container's: its terminal (the engine's) has the modes, this one the size
                    _copy_size(0, master)
            elif "waiting" in ev:
                say(f"job {job_id} waits: {ev['waiting']}")
                waited = True
            elif "started" in ev:
                if waited:
                    say(f"job {job_id} started")
                break
        if wire is not None:
            end = _piped(wire, conn)
        elif master is None:
            raise ClientError("the daemon sent no terminal")
        else:
            end = _relay(master, conn, stdin_tty, stdout_tty, None, replay, keys if detachable else b"")
        if end is not None and end.get("detached"):  # the session runs on
            say(f"detached from job {job_id} ({end['detached']}): colo attach {job_id} takes it again")
            return 0
        if end is None:
            say(f"the daemon went away; how job {job_id} ended is not known here: colo show {job_id}")
            return 1
        return _ended(end)
    except KeyboardInterrupt:  # Ctrl-C while it waits: the connection closes, the daemon cancels it
        if job_id is not None:
            say(f"job {job_id} cancelled")
        return 130
    except _HungUp:  # the connection and the job's terminal close below: the daemon cancels the job
        pass
    finally:
        sock.close()
        for fd in [master, *(wire or ())]:
            if fd is not None and fd >= 0:
                os.close(fd)
        for fd in conn.fds:
            os.close(fd)
    _hang_up()  # (only a hang-up gets here: every other way out returns above)
    return 128 + signal.SIGHUP


def _ended(job: dict) -> int:
    """A line where the job did not simply exit (cancelled, failed to start, killed); its code."""
    code = job.get("exit_code")
    if job.get("state") != "succeeded" and (code is None or code > 128):
        say(f"job {job['id']} {job['state']}: {job.get('reason') or ''}")
    return code if code is not None else 1


def _relay(master: int, conn: _Conn, stdin_tty: bool, stdout_tty: bool, end: dict | None = None,
           replay: bytes = b"", keys: bytes = b"") -> dict | None:
    """Copy between this terminal and the job's until the job's closes and its end is known (`end`,
    when it already is): the job's summary, or None when the daemon went away (the job runs on: its
    terminal is here). `replay` is written first (a detached session's scrollback); typing `keys`
    detaches ({"detached": ...})."""
    global _raw
    old = termios.tcgetattr(0) if stdin_tty else None
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    # SIGWINCH (a new size) and SIGINT (^C for the job) come as their numbers on wake_r
    handlers = {s: signal.signal(s, lambda n, _f: None) for s in (signal.SIGWINCH, signal.SIGINT)}
    prev_wakeup = signal.set_wakeup_fd(wake_w)
    os.set_blocking(master, False)
    pending = b""  # typed, not yet taken by the job's terminal
    master_open, stdin_open, daemon_open = True, True, True
    matched = 0  # how many of the detach keys were typed last (held back until they differ)
    try:
        if old is not None:
            tty.setraw(0, termios.TCSANOW)
            _raw = True
        if replay:
            _write_all(1, replay)
        while master_open or (end is None and daemon_open):
            rl = [wake_r]
            if master_open:
                rl.append(master)
                if stdin_open and len(pending) < 1 << 16:
                    rl.append(0)
            if end is None and daemon_open:
                rl.append(conn.sock)
            wl = [master] if pending and master_open else []
            # once the job's end is known its terminal has closed, or closes at once (the shim kills
            # what held it before it says how the job ended): not waited for long
            r, w, _ = select.select(rl, wl, [], 1.0 if end is not None else None)
            if end is not None and not r and not w:
                break
            if wake_r in r:
                for n in os.read(wake_r, 512):
                    if n == signal.SIGWINCH and old is not None:
                        _copy_size(0, master)
                    elif n == signal.SIGINT:  # from outside (kill -INT): the job's terminal's ^C
                        pending += bytes([termios.tcgetattr(master)[6][termios.VINTR][0]])
            if master in r:
                try:
                    data = os.read(master, 1 << 16)
                except BlockingIOError:
                    data = None
                except OSError as e:
                    if e.errno != errno.EIO:
                        raise
                    data = b""
                if data == b"":
                    master_open = False  # every holder of the job's terminal has gone
                elif data:
                    try:
                        _write_all(1, data)
                    except OSError as e:
                        if e.errno == errno.EIO and stdout_tty:
                            raise _HungUp() from None
                        raise
            if 0 in r:
                try:
                    data = os.read(0, 1 << 16)
                except OSError as e:
                    if e.errno == errno.EIO and old is not None:
                        raise _HungUp() from None
                    raise
                if not data and old is not None:  # raw mode: only a hang-up reads as the end
                    raise _HungUp()
                if data and keys:
                    data, matched, detached = _detach_scan(data, keys, matched)
                    if detached:
                        return {"detached": "you detached"}
                    pending += data
                elif data:
                    pending += data
                else:
                    stdin_open = False
                    if not stdin_tty:  # the end of piped input: end-of-file on the job's terminal
                        pending += b"\x04" if pending.endswith(b"\n") or not pending else b"\x04\x04"
            if master in w:
                try:
                    pending = pending[os.write(master, pending):]
                except BlockingIOError:
                    pass
                except OSError:
                    pending = b""
            if conn.sock in r:
                daemon_open = conn.fill()
                for msg in conn.messages():
                    if "ok" in msg:
                        end = msg["result"]
                    elif "notice" in (msg.get("event") or {}):  # colo's word to the person (idle policy)
                        say(msg["event"]["notice"])
    finally:
        signal.set_wakeup_fd(prev_wakeup)
        for s, h in handlers.items():
            signal.signal(s, h)
        os.close(wake_r)
        os.close(wake_w)
        if old is not None:
            try:
                termios.tcsetattr(0, termios.TCSADRAIN, old)
            except termios.error:  # it hung up: nothing to put back
                pass
            _raw = False
    return end


def _piped(wire: list[int], conn: _Conn, end: dict | None = None) -> dict | None:
    """Copy this client's input to the job's, its end as the end of it, and the job's stdout and
    stderr to this client's, until that output ends and the job's end is known (as _relay).
    `wire`: a host job's three pipes (its stdin's writer, its stdout's and stderr's readers), or a
    container's socket, both ways, its output in the engine's frames (8 bytes: 1 stdout, 2 stderr,
    then the length, big endian)."""
    to_job, framed = wire[0], len(wire) == 1
    outs = dict(zip(wire[1:], (1, 2))) if not framed else {wire[0]: 0}  # job's output -> this client's fd (0: framed)
    for fd in wire:
        os.set_blocking(fd, False)
    pending, frames = b"", b""  # input not yet sent; output not yet a whole frame
    in_open, daemon_open = True, True
    broken: set[int] = set()  # this client's outputs that were closed (a reader that went): not written

    def write(fd: int, data: bytes) -> None:
        if fd not in broken:
            try:
                _write_all(fd, data)
            except BrokenPipeError:
                broken.add(fd)

    while outs or (end is None and daemon_open):
        rl = list(outs) + ([0] if in_open and len(pending) < 1 << 16 else [])
        if end is None and daemon_open:
            rl.append(conn.sock)
        r, w, _ = select.select(rl, [to_job] if pending else [], [], 1.0 if end is not None else None)
        if end is not None and not r and not w:
            break
        if 0 in r:
            data = os.read(0, 1 << 16)
            pending += data
            in_open = bool(data)
        if to_job in w:
            try:
                pending = pending[os.write(to_job, pending):]
            except BlockingIOError:
                pass
            except OSError:  # the job's input is gone (it ended, or closed it): the rest is dropped
                pending, in_open = b"", False
        if not in_open and not pending and in_open is not None:
            in_open = None  # (sent once)
            _end_input(wire)
        for fd in [fd for fd in outs if fd in r]:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                del outs[fd]
            elif not framed:
                write(outs[fd], data)
            else:
                frames += data
                while len(frames) >= 8 and len(frames) >= 8 + (size := int.from_bytes(frames[4:8], "big")):
                    write(2 if frames[0] == 2 else 1, frames[8:8 + size])
                    frames = frames[8 + size:]
        if conn.sock in r:
            daemon_open = conn.fill()
            for msg in conn.messages():
                if "ok" in msg:
                    end = msg["result"]
                elif "notice" in (msg.get("event") or {}):
                    say(msg["event"]["notice"])
    return end


def _end_input(wire: list[int]) -> None:
    """End-of-file on the job's input: a container's socket shut for writing, a host job's pipe closed."""
    if len(wire) == 3:
        os.close(wire[0])
        wire[0] = -1  # (closed: not closed again)
        return
    sock = socket.socket(fileno=os.dup(wire[0]))
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        sock.close()


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            select.select([], [fd], [])


def _detach_scan(data: bytes, keys: bytes, matched: int) -> tuple[bytes, int, bool]:
    """`data` typed, less what may be the detach keys (`matched` of them typed before): (what goes
    to the job, how many keys are matched now, whether all were)."""
    out = bytearray()
    for b in data:
        if b == keys[matched]:
            matched += 1
            if matched == len(keys):
                return bytes(out), 0, True
            continue
        out += keys[:matched]  # not the keys after all: what was held back goes on
        matched = 1 if b == keys[0] else 0
        if not matched:
            out.append(b)
    return bytes(out), matched, False
