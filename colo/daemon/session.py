"""Op `session`: a job on a terminal colo made for it, attached to its client (`colo shell`,
`colo run`), as Slurm's `srun --pty` and `machinectl shell` are.

The daemon makes the pty pair (/dev/ptmx: no path anyone named), queues the job as any other
(placed by the same policy, budgeted, contained, counted), hands the slave end to the launcher,
which passes it to the job's shim at start (the shim makes it the job's controlling terminal, as
the user), and sends the master end to the client over the socket (SCM_RIGHTS) at once, keeping
no copy: the client, the job's owner by construction (its SO_PEERCRED uid submitted it), is the
only holder. The daemon never relays a byte; Ctrl-C, Ctrl-Z and window sizes act on the pty
itself. The stream then says why the job waits and when it started, and ends with the job.

Fed from a pipe (`colo run` whose client has no terminal, as ssh without one and `docker run -i`;
op `session` with `pipe`), the job gets none: a host job runs on three pipes (its stdin, stdout,
stderr), whose other ends go to the client as the master would; a container's input and output
go over a socket (runtimes/ttyrelay.py). Nothing of a host job's bytes passes the daemon either.

The session ends with its client: when the connection closes (the client hung up or was killed)
the job is cancelled, queued or running; and closing the master hangs the terminal up, which
sends SIGHUP to the job's session. When the job ends, its terminal closes (the client reads EIO).

A daemon that restarted holds no connection of a session that runs on (its client keeps the
terminal and relays on). `Watch` looks at each such job at every tick: once its terminal has
hung up (the client, the master end's only holder, went away; the kernel then takes the
terminal from the job's session, whether or not it ignores SIGHUP), and still so HANGUP_GRACE
later, the job is cancelled as if its connection had closed.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import termios
import time
import tty
from typing import Any, AsyncIterator

from .. import protocol
from ..jobs import TERMINAL, State
from . import detach
from .validate import Caller

log = logging.getLogger("colo")
HANGUP_GRACE = 3.0  # seconds a session job's terminal stays hung up, seen twice, before it is cancelled


class Refused(ValueError):
    """What a session may not ask for: one line."""


def check(raw: dict) -> None:
    """A session runs one command (a host process, or a container's) on its terminal, once."""
    if raw.get("array") is not None:
        raise Refused("a session is one job: --array does not apply")
    if raw.get("grow") or raw.get("retries"):
        raise Refused("a session runs once on its terminal: --grow and --retries do not apply")


async def attach(api, caller: Caller, raw: dict) -> AsyncIterator[dict[str, Any]]:
    """The stream of op `session` for `api` (the Api: submit, summary, reason, stop_later). With
    `detach` in `raw`, the daemon keeps the terminal (detach.py) and the stream ends at once."""
    d = api.d
    raw = dict(raw)
    detached, pipe = raw.pop("detach", False), raw.pop("pipe", False)
    if detached not in (True, False) or pipe not in (True, False):
        raise Refused("detach and pipe must be true or false")
    if pipe and detached:
        raise Refused("pipe is for a session fed from a pipe, with its client: colo run")
    container = raw.get("image") is not None
    master, slave = (_wire() if container else _pipes()) if pipe else _pair(container)
    try:
        job = await api.submit(caller, {"spec": {**raw, "interactive": True}}, tty=True, detached=detached, pipe=pipe)
    except BaseException:
        _close(master, slave)
        raise
    job_id = job["id"]
    # No await since the job was stored: the scheduler has not seen it without its terminal.
    d.launcher.give_terminal(job_id, slave, kept=detached)
    if detached:  # the daemon holds it from now on: the client goes, the session stays
        _keep(d.terminals, job_id, job["uid"], master, raw.get("image") is not None)
        yield {"final": job}
        return
    d.sessions.attached.add(job_id)
    try:
        yield {"job": job}
        if job["uid"] != caller.uid:  # the terminal goes to the job's owner (SO_PEERCRED) only
            raise PermissionError(f"job {job_id} is not uid {caller.uid}'s")
        ev = {"tty": True, protocol.PASS_FD: master}
        if raw.get("image") is not None:
            ev["relay"] = True  # (the client copies its window size to it, not its modes)
        if pipe:  # a container's socket (its input; its stdout and stderr in the engine's frames), or a
            ev["pipe"] = True  # host job's pipes (its stdin, stdout, stderr)
        master = None  # the server sends it and closes it
        yield ev
        async for ev in _follow(api, job_id):
            yield ev
    finally:
        d.sessions.attached.discard(job_id)
        if master is not None:
            _close(master)
        d.launcher.drop_terminal(job_id)
        # the client went away: so does its session (not the daemon stopping: the session runs on)
        if not d.stopping and d.table.job(job_id).state not in TERMINAL:
            api.stop_later(d.launcher.cancel(job_id, f"{caller.user} (the session's client hung up)"))


def _pair(container: bool) -> tuple[int, int]:
    """A session's pty pair (master, slave): non-inheritable, so no other child of the daemon gets
    them; a container session's raw (the engine's terminal does what a terminal does: this one is a wire)."""
    master, slave = os.openpty()
    if container:
        tty.setraw(slave, termios.TCSANOW)
    return master, slave


def _wire() -> tuple[int, int]:
    """A container session's ends without a terminal (fed from a pipe, as `docker run -i`): a
    socket pair (the client's, the job's), non-inheritable."""
    client, job = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return client.detach(), job.detach()


def _pipes() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A host session's ends without a terminal (fed from a pipe, as ssh without one): three pipes,
    (the client's ends: stdin's writer, stdout's and stderr's readers; the job's: the others),
    non-inheritable. Pipes, not sockets: a job may open /dev/stdin."""
    ends = [os.pipe2(os.O_CLOEXEC) for _ in range(3)]
    return (ends[0][1], ends[1][0], ends[2][0]), (ends[0][0], ends[1][1], ends[2][1])


def _close(*ends: int | tuple[int, ...]) -> None:
    for end in ends:
        for fd in end if isinstance(end, tuple) else (end,):
            os.close(fd)


def _keep(terminals: detach.Terminals, job_id: int, uid: int, master: int, container: bool) -> None:
    """A detached session's master end, to `terminals` (closed by them)."""
    if not container and terminals.holders is not None:
        try:  # a host session's: its holder's (detach.py), so that it outlives a restart
            terminals.hold(job_id, uid, master)
            return
        except detach.HolderError as e:  # it runs on in the daemon's hands, as a container session's
            log.warning("%s: the daemon keeps it (it will not outlive a restart)", e)
    terminals.keep(job_id, uid, master)


def renew(terminals: detach.Terminals, job) -> int:
    """The launcher's, as a detached session's job starts without the terminal op `session` made
    (a daemon that stopped while it was queued took that one's slave end with it): a new pty pair,
    its master kept as at a detached session's start, its slave end returned (the job's). A holder a
    restarted daemon found again for it goes: no job can start on the terminal it holds."""
    terminals.drop(job.id)
    master, slave = _pair(job.spec.image is not None)
    try:
        _keep(terminals, job.id, job.uid, master, job.spec.image is not None)
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    return slave


async def reattach(api, caller: Caller, job) -> AsyncIterator[dict[str, Any]]:
    """The stream of op `attach` (`colo attach JOB`): a detached session's terminal taken over by
    its owner (detach.py), its scrollback first; the stream ends with the job, or when another
    attach takes the terminal (the session runs on)."""
    d = api.d
    if job.uid != caller.uid:  # not an admin either: what is typed there is the owner's
        raise PermissionError(f"job {job.id} is {job.user}'s: only its owner may attach to it")
    if job.state in TERMINAL:
        raise Refused(f"job {job.id} has ended ({job.state}): there is nothing to attach to")
    if not d.terminals.holds(job.id):
        raise Refused(f"job {job.id} is not a detached session: only a session started with --detach (colo shell "
                      "--detach, colo run --detach) can be attached to")
    try:
        holder, back, mine, taken = await d.terminals.take(job.id)
    except detach.HolderError as e:
        raise Refused(str(e)) from None
    try:
        yield {"job": api.summary(job)}
        ev, mine = {"tty": True, protocol.PASS_FD: mine, "relay": True, "detachable": True,
                    "replay": base64.b64encode(back).decode()}, None  # (the server sends it and closes it)
        yield ev
        async for ev in _follow(api, job.id, taken):
            yield ev
    finally:
        if mine is not None:
            os.close(mine)
        d.terminals.leave(job.id, holder)


async def _follow(api, job_id: int, taken: asyncio.Event | None = None) -> AsyncIterator[dict[str, Any]]:
    """A session's events until its job ends (its summary, last), or `taken` is set (an attach
    taken over: the summary with `detached`, the reason)."""
    d = api.d
    said, started, told = None, False, None
    while True:
        j = d.table.job(job_id)
        if j.state in TERMINAL:
            yield {"final": api.summary(j)}
            return
        if taken is not None and taken.is_set():
            yield {"final": {**api.summary(j), "detached": "another colo attach took its terminal over"}}
            return
        note = d.sampler.notices.get(job_id)  # the idle policy's word (docs/gating.md)
        if note is not None and note != told:
            told = note
            yield {"notice": note}
        if j.state == State.QUEUED:
            decided = api.reasons([j]).get(j.id)  # (not the store's "submitted by")
            why = api.reason(j, decided) if decided is not None or j.held_by else None
            if why and why != said:
                said = why
                yield {"waiting": why}
        elif j.state == State.RUNNING and not started:
            started = True
            yield {"started": {"gpus": j.gpus, "mode": str(j.mode) if j.mode else None}}
        await d.table.changed.wait(1.0)  # (a reason may change without a job changing)


class Watch:
    """Session jobs whose client this daemon cannot see. Owns `attached` (the jobs whose session
    stream this daemon serves: attach() adds and drops them) and when each unattached session's
    terminal was first seen hung up. Calls the engines (the job's terminal, as its runtime sees
    it) and `cancel` (the launcher's)."""

    def __init__(self, table, engines, cancel, terminals):
        self.table, self.engines, self.cancel, self.terminals = table, engines, cancel, terminals
        self.attached: set[int] = set()
        self._hung: dict[int, float] = {}  # job -> when its terminal was first seen hung up
        self._stops: set[asyncio.Task] = set()

    async def sweep(self, now: float | None = None) -> None:
        """Cancel the unattached session jobs whose terminal hung up HANGUP_GRACE ago or more."""
        now = time.monotonic() if now is None else now
        # (not a host session on pipes: they are its client's, whose going the job sees as a pipe's end)
        jobs = [j for j in self.table.jobs_in(State.RUNNING) if j.spec.tty and j.handle and j.id not in self.attached
                and not j.cancel_by and not self.terminals.holds(j.id) and not (j.spec.pipe and j.spec.image is None)]
        hung, found = await asyncio.to_thread(self._hung_up, jobs) if jobs else (set(), {})
        for i, (master, screen) in found.items():  # detached container sessions, after a restart
            log.info("job %d: its detached session's terminal is kept again", i)
            self.terminals.keep(i, self.table.job(i).uid, master, screen)
        self._hung = {i: self._hung.get(i, now) for i in hung}
        for i in [i for i, since in self._hung.items() if now - since >= HANGUP_GRACE]:
            del self._hung[i]
            log.info("job %d: its session's terminal hung up with no client attached: cancelled", i)
            task = asyncio.create_task(self.cancel(i, "colo (the session's client went away while colo was "
                                                      "restarting)"))
            self._stops.add(task)
            task.add_done_callback(self._stop_done)

    def _stop_done(self, task: asyncio.Task) -> None:
        self._stops.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("cancelling a session whose client went away failed: %s", task.exception())

    def _hung_up(self, jobs) -> tuple[set[int], dict[int, tuple[int, bytes]]]:
        """The jobs whose terminal hung up, and the detached container sessions whose terminal
        was taken again (job -> its new master, its last screen)."""
        out, found = set(), {}
        for j in jobs:
            try:
                rt = self.engines.runtime_for(j)
                if getattr(rt, "lost_terminal", None) and rt.lost_terminal(j.handle):
                    again = rt.reattach(j.handle, self.terminals.scrollback) if hasattr(rt, "reattach") else None
                    if again is not None:
                        found[j.id] = again
                    else:
                        out.add(j.id)
            except Exception as e:  # noqa: BLE001 - it may be ending right now; looked at again next tick
                log.debug("job %d: its terminal could not be looked at: %s", j.id, e)
        return out, found
