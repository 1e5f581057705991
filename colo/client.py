"""Talks to the daemon. The CLI and the TUI reach colo only through this module.

Light to import, as `colo submit` runs it on its short path (colo/cli/submitspec.py): the C socket
module (`_socket`: `socket` builds enums of every constant at import), protocol's own codec (no
`json`, no `re`), no pathlib or typing at run time.
"""
from __future__ import annotations

import _socket
import os
import sys
import time

from . import protocol
from .paths import SYSTEM_SOCKET, socket_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any, Iterator

    from .replies import AdminLogReply, GpusReply, JobSummary, TopReply  # the shapes the daemon sends (listing.py)


def _filters(users, states, names, refs) -> dict:
    return {k: list(v) for k, v in (("users", users), ("states", states), ("names", names), ("refs", refs)) if v}


class ClientError(RuntimeError):
    """One line for the user; `code` says what kind (not_found, forbidden, invalid, ...)."""

    def __init__(self, message: str, code: str = "error"):
        super().__init__(message)
        self.code = code


class DaemonUnavailable(ClientError):
    pass


class ConnectionLost(DaemonUnavailable):
    """The daemon went away while answering (it stopped, or was killed and may be restarting):
    the request may have been acted on."""


def _how_to_start(path: str) -> str:
    if path == SYSTEM_SOCKET:
        return "the system daemon starts with `sudo systemctl start colo` (a private one of yours: `colo daemon &` and COLO_SOCKET)"
    return "start it with `colo daemon --socket " + path + " &`, or unset COLO_SOCKET for the system daemon"


def _lines(s: _socket.socket) -> Iterator[bytes]:
    """The lines the daemon sends (each with its newline; the last without one if cut short).
    Parts are joined once a line is whole, so a reply of many MiB costs linear time."""
    parts: list[bytes] = []
    while True:
        chunk = s.recv(1 << 20)
        if not chunk:
            if parts:
                yield b"".join(parts)
            return
        start = 0
        while (i := chunk.find(b"\n", start)) >= 0:
            parts.append(chunk[start: i + 1])
            yield b"".join(parts)
            parts, start = [], i + 1
        if start < len(chunk):
            parts.append(chunk[start:])


def _folder_problem(path: str) -> str | None:
    """Why the socket's folder cannot be trusted (None if it can): it must belong to root or to you
    and be writable by no one else, or another user could put a socket of their own in its place."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return None  # no folder, no socket: connect says the daemon is not running
    except OSError as e:
        return f"cannot check its folder {folder}: {e.strerror}"
    me = os.geteuid()
    if st.st_uid not in (0, me):
        return f"its folder {folder} belongs to {_user(st.st_uid)}, not root or you"
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid not in (0, os.getegid())):
        return f"its folder {folder} is writable by other users (mode {st.st_mode & 0o7777:o})"
    return None


def _user(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def peer_of(s: _socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process that listens on the other end (SO_PEERCRED, set by the kernel)."""
    cred = s.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12)
    return int.from_bytes(cred[0:4], sys.byteorder), int.from_bytes(cred[4:8], sys.byteorder)


class Client:
    """trusted: after a connection, why this daemon was trusted (its pid, its user, its folder's owner)."""

    def __init__(self, sock: Path | str | None = None, timeout: float | None = 30.0):
        self.path = os.fspath(sock) if sock else socket_path()
        self.timeout = timeout
        self.trusted: dict | None = None

    def _untrusted(self, why: str) -> DaemonUnavailable:
        return DaemonUnavailable(f"refusing the daemon socket {self.path}: {why}; nothing was sent "
                                 "(a colo daemon runs as root, or as you for a private one)", "untrusted")

    def _connect(self, timeout: float | None) -> _socket.socket:
        problem = _folder_problem(self.path)
        if problem:
            raise self._untrusted(problem)
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        s.settimeout(timeout)
        deadline = time.monotonic() + (timeout if timeout is not None else 30.0)
        try:
            while True:
                try:
                    s.connect(self.path)
                    break
                except BlockingIOError:  # the daemon's accept backlog is full: it is busy, try again
                    if time.monotonic() > deadline:
                        s.close()
                        raise DaemonUnavailable(f"colo daemon at {self.path} is too busy to accept a "
                                                "connection; try again", "timeout") from None
                    time.sleep(0.01)
        except FileNotFoundError:
            s.close()
            raise DaemonUnavailable(f"colo daemon is not running (no socket at {self.path}); "
                                    + _how_to_start(self.path), "unavailable")
        except ConnectionRefusedError:
            s.close()
            raise DaemonUnavailable(f"colo daemon is not running (stale socket {self.path}); "
                                    + _how_to_start(self.path), "unavailable")
        except PermissionError:
            s.close()
            raise DaemonUnavailable(f"permission denied on {self.path}: ask an admin to add you to the "
                                    "group that may use colo", "forbidden")
        except OSError:
            s.close()
            raise
        # the proof of who answers, before a byte is sent: the listener's credentials, which the
        # kernel recorded when it called listen() and no one can forge
        pid, uid = peer_of(s)
        if uid not in (0, os.geteuid()):
            s.close()
            raise self._untrusted(f"it is served by {_user(uid)} (pid {pid}), not root or you")
        self.trusted = {"pid": pid, "uid": uid, "folder": os.path.dirname(os.path.abspath(self.path)),
                        "folder_uid": os.stat(os.path.dirname(os.path.abspath(self.path))).st_uid}
        return s

    def connect(self, timeout: float | None = None) -> _socket.socket:
        """A connected socket, for a caller that speaks the protocol itself (a session: colo/cli/attach.py)."""
        return self._connect(timeout)

    def _stream(self, op: str, timeout: float | None, **args: Any) -> Iterator[dict]:
        s = self._connect(timeout)
        try:
            s.sendall(protocol.request(op, **args))
            lines = _lines(s)
            while True:
                try:
                    line = next(lines, b"")
                except TimeoutError:
                    raise DaemonUnavailable(f"colo daemon did not answer within {timeout:.0f}s", "timeout")
                except OSError as e:
                    raise ConnectionLost(f"connection to colo daemon lost: {e}", "unavailable")
                if not line.endswith(b"\n"):
                    raise ConnectionLost("colo daemon closed the connection before answering "
                                            "(did it stop or restart?)", "unavailable")
                msg = protocol.loads(line)
                if msg.get("v") != protocol.VERSION:
                    raise ClientError(f"daemon speaks protocol {msg.get('v')}, this colo speaks "
                                      f"{protocol.VERSION}: use matching versions", protocol.VERSION_MISMATCH)
                yield msg
                if "ok" in msg:
                    return
        finally:
            s.close()

    def call(self, op: str, **args: Any) -> Any:
        return self._result(op, self.timeout, **args)

    def _result(self, op: str, timeout: float | None, **args: Any) -> Any:
        for msg in self._stream(op, timeout, **args):
            if "ok" in msg:
                if not msg["ok"]:
                    raise ClientError(msg.get("error", "unknown error"), msg.get("code", "error"))
                return msg["result"]
        raise DaemonUnavailable("no reply from colo daemon", "unavailable")

    def stream(self, op: str, **args: Any) -> Iterator[Any]:
        """Events of a streaming op; the final reply's result is returned via StopIteration.value."""
        for msg in self._stream(op, None, **args):
            if "event" in msg:
                yield msg["event"]
            elif not msg["ok"]:
                raise ClientError(msg.get("error", "unknown error"), msg.get("code", "error"))
            else:
                return msg["result"]

    # one method per op ------------------------------------------------------------------------
    def hello(self, detail: bool = False) -> dict:
        """Who the daemon is and who you are; detail: also what it runs on (`colo doctor`)."""
        return self.call("hello", detail=True) if detail else self.call("hello")

    def submit(self, spec: dict) -> JobSummary:
        return self.call("submit", spec=spec)

    def ls(self, all: bool = True, limit: int | None = None, users: list[str] | None = None,
           states: list[str] | None = None, names: list[str] | None = None,
           refs: list[str] | None = None) -> list[JobSummary]:
        """Every listed job's summary, oldest first: the open ones, or with `all` every one; only
        `states`, `users`, `names` and the jobs `refs` name (ids, names, arrays, ARRAY_INDEX) where
        given (filtered by the daemon); the newest `limit`."""
        return self.call("ls", all=all, limit=limit, **_filters(users, states, names, refs))

    def ls_fields(self, fields: list[str], all: bool = True, limit: int | None = None,
                  users: list[str] | None = None, states: list[str] | None = None,
                  names: list[str] | None = None, refs: list[str] | None = None, cut: int | None = None,
                  head: int | None = None, tasks: bool = True) -> dict:
        """The same jobs, only `fields` (protocol.LS_FIELDS) of each: {"fields", "rows", "left"}; texts
        cut to `cut` characters; with `head`, at most that many jobs (see Api.ls); tasks=False: an
        array's queued tasks in one row, whose id and array say which (12_[3-9])."""
        return self.call("ls", all=all, limit=limit, fields=fields, cut=cut, head=head,
                         **({} if tasks else {"tasks": False}), **_filters(users, states, names, refs))

    def show(self, job_id: int) -> dict:
        return self.call("show", id=job_id)

    def explain(self, job_id: int) -> dict:
        return self.call("explain", id=job_id)

    def cancel(self, job_id: int) -> dict:
        return self.call("cancel", id=job_id)

    def signal(self, job_id: int, signum: int | str) -> dict:
        """A signal (HUP INT QUIT USR1 USR2 TERM, by number or name: 2, INT, SIGINT) to a running job's
        main process (a container's too); it is not cancelled. ValueError for a name colo does not send."""
        return self.call("signal", id=job_id, signal=protocol.signal_number(signum))

    def hold(self, job_id: int) -> dict:
        return self.call("hold", id=job_id)

    def release(self, job_id: int) -> dict:
        return self.call("release", id=job_id)

    def pause(self, job_id: int) -> dict:
        """Freeze a running job (the cgroup freezer, docker pause); it keeps its budget."""
        return self.call("pause", id=job_id)

    def suspend(self, job_id: int) -> dict:
        """A running job's GPU memory to host memory (the driver's checkpoint); its budget freed."""
        return self.call("suspend", id=job_id)

    def resume(self, job_id: int) -> dict:
        return self.call("resume", id=job_id)

    def edit(self, job_id: int, **changes: Any) -> dict:
        """changes: gpu_mem (bytes), priority, name."""
        return self.call("edit", id=job_id, changes=changes)

    def requeue(self, job_id: int) -> dict:
        return self.call("requeue", id=job_id)

    def clean(self, refs: list[str] | None = None, before: float | None = None, users: list[str] | None = None,
              states: list[str] | None = None) -> dict:
        """Remove ended jobs: those `refs` name (ids, names, an array's id, ARRAY_INDEX; every one
        must have ended), or else the caller's own (or `users`'s: root and admins) in `states`
        that ended before `before`. {"removed": how many, "kept": how many matched but must stay}.
        No time limit: months of history take a while to remove (the daemon serves others meanwhile)."""
        return self._result("clean", None, refs=refs or None, before=before, users=users or None,
                            states=states or None)

    def gpus(self) -> GpusReply:
        return self.call("gpus")

    def drain(self, gpus: list[str], reason: str, now: bool = False) -> dict:
        """Take GPUs (indices or UUIDs) out of service (root and the admin group); now: requeue their jobs."""
        return self.call("drain", gpus=gpus, reason=reason, now=now)

    def undrain(self, gpus: list[str]) -> dict:
        return self.call("undrain", gpus=gpus)

    def admin_log(self, since: float | None = None, limit: int | None = None) -> AdminLogReply:
        """What root, the admin group and colo's own fault drains did (root and the admin group only):
        those at or after `since`, newest first, at most `limit`."""
        return self.call("admin_log", since=since, limit=limit)

    def top(self) -> TopReply:
        return self.call("top")

    def history(self, since: float | None = None, users: list[str] | None = None, limit: int | None = None,
                full: bool = False) -> dict:
        """Ended jobs (that ended at or after `since`, of `users`), oldest first, only the newest
        `limit`: {"jobs", "left": how many more matched}; specs in full with `full`."""
        return self.call("history", since=since, users=users or None, limit=limit, full=full or None)

    def report(self, since: float | None = None, users: list[str] | None = None) -> dict:
        return self.call("report", since=since, users=users or None)

    def logs(self, job_id: int, follow: bool = False, tail: int | None = None,
             since: float | None = None) -> Iterator[str]:
        gen = self.stream("logs", id=job_id, follow=follow, tail=tail, since=since)
        for ev in gen:
            yield ev["data"]

    def log_lines(self, job_id: int, follow: bool = False, tail: int | None = None,
                  since: float | None = None) -> Iterator[tuple[float | None, str]]:
        """(time colo first saw the line, text); None for the rest of a line begun earlier."""
        for ev in self.stream("logs", id=job_id, follow=follow, tail=tail, since=since, timestamps=True):
            for at, text in ev["lines"]:
                yield at, text

    def wait(self, job_ids: list[int]) -> list[dict]:
        gen = self.stream("wait", ids=job_ids)
        try:
            while True:
                next(gen)
        except StopIteration as stop:
            return stop.value

    def slurm(self, action: str, **args: Any) -> dict:
        """For colo's Slurm plugin (root only): attach | batch_exit | end."""
        return self.call("slurm", action=action, **args)

    def profiles(self, user: str | None = None) -> list[dict]:
        return self.call("profiles", user=user)

    def profile(self, name: str, user: str | None = None) -> dict:
        return self.call("profile", name=name, user=user)

    def profile_share(self, name: str, user: str | None = None) -> dict:
        return self.call("profile_share", name=name, user=user)

    def profile_put(self, text: str) -> dict:
        """A profile (its text, colo.profiles.dumps) becomes the caller's own copy in the daemon."""
        return self.call("profile_put", text=text)

    def shutdown(self) -> None:
        self.call("shutdown")
