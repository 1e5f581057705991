"""Talks to the daemon. The CLI and the TUI reach colo only through this module.

Light to import, as `colo submit` runs it on its short path (colo/cli/submitspec.py): the C socket
module (`_socket`: `socket` builds enums of every constant at import), protocol's own codec (no
`json`, no `re`), no pathlib or typing at run time.
"""
from __future__ import annotations

import _socket
import os
import time

from . import protocol
from .paths import socket_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any, Iterator

    from .replies import GpusReply, JobSummary, TopReply  # the shapes the daemon sends (listing.py)


def _filters(users, states, names, refs) -> dict:
    return {k: list(v) for k, v in (("users", users), ("states", states), ("names", names), ("refs", refs)) if v}


class ClientError(RuntimeError):
    """One line for the user; `code` says what kind (not_found, forbidden, invalid, ...)."""

    def __init__(self, message: str, code: str = "error"):
        super().__init__(message)
        self.code = code


class DaemonUnavailable(ClientError):
    pass


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


class Client:
    def __init__(self, sock: Path | str | None = None, timeout: float | None = 30.0):
        self.path = os.fspath(sock) if sock else socket_path()
        self.timeout = timeout

    def _connect(self, timeout: float | None) -> _socket.socket:
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
                                    "start it with `colo daemon &` or `systemctl start colo`", "unavailable")
        except ConnectionRefusedError:
            s.close()
            raise DaemonUnavailable(f"colo daemon is not running (stale socket {self.path}); "
                                    "start it with `colo daemon &`", "unavailable")
        except PermissionError:
            s.close()
            raise DaemonUnavailable(f"permission denied on {self.path}: ask an admin to add you to the "
                                    "group that may use colo", "forbidden")
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
                    raise DaemonUnavailable(f"connection to colo daemon lost: {e}", "unavailable")
                if not line.endswith(b"\n"):
                    raise DaemonUnavailable("colo daemon closed the connection before answering "
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
