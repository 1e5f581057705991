"""Op `session`: a job on a terminal colo made for it, attached to its client (`colo shell`,
`colo run`), as Slurm's `srun --pty` and `machinectl shell` are.

The daemon makes the pty pair (/dev/ptmx: no path anyone named), queues the job as any other
(placed by the same policy, budgeted, contained, counted), hands the slave end to the launcher,
which passes it to the job's shim at start (the shim makes it the job's controlling terminal, as
the user), and sends the master end to the client over the socket (SCM_RIGHTS) at once, keeping
no copy: the client, the job's owner by construction (its SO_PEERCRED uid submitted it), is the
only holder. The daemon never relays a byte; Ctrl-C, Ctrl-Z and window sizes act on the pty
itself. The stream then says why the job waits and when it started, and ends with the job.

The session ends with its client: when the connection closes (the client hung up or was killed)
the job is cancelled, queued or running; and closing the master hangs the terminal up, which
sends SIGHUP to the job's session. When the job ends, its terminal closes (the client reads EIO).
"""
from __future__ import annotations

import os
from typing import Any, AsyncIterator

from .. import protocol
from ..jobs import TERMINAL, State
from .validate import Caller


class Refused(ValueError):
    """What a session may not ask for: one line."""


def check(raw: dict) -> None:
    """A session runs one host process on its terminal, once."""
    if raw.get("image") is not None:
        raise Refused("a session runs a host process: container sessions (--image) are not supported")
    if raw.get("array") is not None:
        raise Refused("a session is one job: --array does not apply")
    if raw.get("grow") or raw.get("retries"):
        raise Refused("a session runs once on its terminal: --grow and --retries do not apply")


async def attach(api, caller: Caller, raw: dict) -> AsyncIterator[dict[str, Any]]:
    """The stream of op `session` for `api` (the Api: submit, summary, reason, stop_later)."""
    d = api.d
    master, slave = os.openpty()  # (non-inheritable: no other child of the daemon gets them)
    try:
        job = await api.submit(caller, {"spec": {**raw, "interactive": True}}, tty=True)
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    job_id = job["id"]
    # No await since the job was stored: the scheduler has not seen it without its terminal.
    d.launcher.give_terminal(job_id, slave)
    try:
        yield {"job": job}
        if job["uid"] != caller.uid:  # the terminal goes to the job's owner (SO_PEERCRED) only
            raise PermissionError(f"job {job_id} is not uid {caller.uid}'s")
        ev, master = {"tty": True, protocol.PASS_FD: master}, None  # the server sends it and closes it
        yield ev
        said, started, told = None, False, None
        while True:
            j = d.table.job(job_id)
            if j.state in TERMINAL:
                yield {"final": api.summary(j)}
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
    finally:
        if master is not None:
            os.close(master)
        d.launcher.drop_terminal(job_id)
        # the client went away: so does its session (not the daemon stopping: the session runs on)
        if not d.stopping and d.table.job(job_id).state not in TERMINAL:
            api.stop_later(d.launcher.cancel(job_id, f"{caller.user} (the session's client hung up)"))
