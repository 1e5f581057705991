"""`colo drain` and `colo undrain`: an admin takes GPUs out of service and puts them back.

Owns nothing of its own: a drain is a row in the store (so that it outlasts a restart) and the
Gpus part's `drained` map, which views() hands plan(); plan() places no new job on a drained GPU
and tells waiting jobs why ("GPU 0 drained by root: driver update"). Running jobs finish there,
unless the drain says --now: then each is suspended where it can be (`suspend`, the Suspender's:
its GPU memory to host memory, its CPU side running on; it is restored there once the GPU is
undrained and it makes a CUDA call or is resumed), else (an MPS client, --no-suspend, what the
driver cannot checkpoint, no CUDA process) queued again under its id (Launcher.requeue_running)
to start on another GPU. The reply says which, per job. Left running, and named in the reply:
Slurm's jobs (Slurm's to move), suspended ones (a suspend or resume may be under way; their memory
is in host memory) and jobs still starting. Each drain and undrain goes into the admin log
(`colo history --admin`), colo's own as "colo".

Faults drain by themselves (`faults`, at each sample): a GPU NVML stops answering for ("GPU is
lost": fallen off the bus) or that says it is failing (a critical Xid event, uncorrectable ECC
errors: colo/node/gpu.py reads them) is drained "by colo" with that reason, and its jobs are
requeued (never suspended: a failing GPU is no place to restore them), each told in its log. Nothing is ever undrained here: an admin's
`colo undrain` puts it back, and holds until the GPU reports a new fault.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

from .. import protocol
from ..jobs import State
from .errors import ApiError
from .suspend import SuspendRefused
from .validate import Caller, is_admin

if TYPE_CHECKING:
    from ..config import Config
    from ..jobs import Job
    from ..node.gpu import GpuInfo
    from ..store import Store
    from .gpus import Gpus
    from .jobtable import JobTable
    from .launcher import Launcher

log = logging.getLogger("colo")

FAULT_BY = "colo"  # who drained a GPU that failed


def drained_text(by: str, reason: str) -> str:
    return f"drained by {by}: {reason}"


class Drains:
    def __init__(self, config: "Config", store: "Store", table: "JobTable", gpus: "Gpus", launcher: "Launcher",
                 wake, suspend=None):
        self.config, self.store, self.table, self.gpus, self.launcher, self.wake = (
            config, store, table, gpus, launcher, wake)
        self._suspend = suspend  # (job, by) -> the job suspended (Suspender.suspend); SuspendRefused if not
        self._faults: dict[str, str] = {}  # uuid -> the fault that last drained it (each drains once)

    def load(self) -> None:
        """The drains stored before this start, back in force (a GPU no longer seen stays drained)."""
        for uuid, d in self.store.drains().items():
            self.gpus.set_drained(uuid, drained_text(d["by"], d["reason"]))
            log.info("GPU %d (%s) is %s", d["index"], uuid, drained_text(d["by"], d["reason"]))

    def _admin(self, caller: Caller, verb: str) -> None:
        if not is_admin(caller, self.config.admin_group):
            raise ApiError(f"only root and the admin group may {verb} GPUs", protocol.FORBIDDEN)

    def _resolve(self, refs: list[str], stored: dict[str, dict] | None = None) -> list[tuple[str, int]]:
        """(uuid, index) for each GPU named by its index or its UUID; `stored`: drained GPUs
        the driver no longer shows may be named by their UUID too."""
        if not refs:
            raise ApiError("name the GPUs, by index or UUID (colo gpus shows both)", protocol.BAD_REQUEST)
        out: list[tuple[str, int]] = []
        for ref in refs:
            dev = next((d for d in self.gpus.devices if (str(d.index) == ref.strip() or d.uuid == ref)), None)
            if dev is not None:
                got = (dev.uuid, dev.index)
            elif stored and ref in stored:
                got = (ref, stored[ref]["index"])
            else:
                here = ", ".join(f"{d.index} ({d.uuid})" for d in self.gpus.devices) or "none"
                raise ApiError(f"no GPU {ref!r} on this node: give an index or UUID (here: {here})",
                               protocol.NOT_FOUND)
            if got not in out:
                out.append(got)
        return out

    async def drain(self, caller: Caller, args: dict) -> dict:
        self._admin(caller, "drain")
        reason = (args.get("reason") or "").strip()
        if not reason:
            raise ApiError("drain needs --reason: why the GPU is out of service (shown to waiting jobs)",
                           protocol.BAD_REQUEST)
        gpus = self._resolve(args.get("gpus") or [])
        text = drained_text(caller.user, reason)
        moved: list[dict] = []  # what --now did with each running job: suspended or requeued, and why
        left: list[dict] = []  # jobs --now does not move, and why
        for uuid, index in gpus:
            self.store.set_drain(uuid, index, caller.user, reason)  # stored first: it outlasts a crash from here
            self.gpus.set_drained(uuid, text)
            log.info("GPU %d (%s) %s", index, uuid, text)
        if args.get("now"):
            moved, left = await self._move_off(gpus, text, " (--now)", suspend_by=caller.user)
        for uuid, index in gpus:
            self.store.log_admin(caller.user, "drain", f"GPU {index} ({uuid})", reason + _now_said(moved, left))
        self.wake()
        return {"gpus": [{"index": i, "uuid": u, "drained": text} for u, i in gpus],
                "requeued": [m["id"] for m in moved if m["did"] == "requeued"],
                "suspended": [m["id"] for m in moved if m["did"] == "suspended"], "moved": moved, "left": left}

    async def _off_by_suspend(self, job: "Job", by: str, said: str) -> str | None:
        """Suspend a job --now moves off its GPU; None if done, else why not (it is requeued then)."""
        if self._suspend is None:
            return "suspend is not available here"
        if job.spec.no_suspend:
            return "submitted with --no-suspend"
        try:
            await self._suspend(job, by)
        except SuspendRefused as e:
            return str(e)
        await self._tell(job, said)
        return None

    async def _move_off(self, gpus: list[tuple[str, int]], text: str, how: str,
                        suspend_by: str | None = None) -> tuple[list[dict], list[dict]]:
        """Move the jobs running on `gpus` off them, each told in its log: suspended there (when
        `suspend_by` is given and it can be), else requeued. What was done with each
        ({id, did, why}), and those left there ({id, why})."""
        out = {u for u, _ in gpus}
        moved: list[dict] = []
        left: list[dict] = []
        for job in self.table.jobs_in(State.STARTING, State.RUNNING):
            if not out & set(job.gpus):
                continue
            why = ("Slurm's job: Slurm moves it" if job.spec.slurm_job is not None
                   else "suspended: its memory is in host memory (colo cancel, or resume it)" if job.suspended
                   else "still starting" if job.state != State.RUNNING or not job.handle else None)
            if why:
                left.append({"id": job.id, "why": why})
                continue
            names = ", ".join(f"GPU {i}" for u, i in gpus if u in job.gpus)
            not_suspended = None
            if suspend_by is not None:
                not_suspended = await self._off_by_suspend(
                    job, suspend_by, f"suspended: {names} {text}{how}; restored there once it is undrained")
                if not_suspended is None:
                    moved.append({"id": job.id, "did": "suspended", "why": ""})
                    continue
                job = self.table.job(job.id)  # the suspend's attempt awaited: as it is now
                if job.state != State.RUNNING:
                    continue
            said = f"requeued: {names} {text}{how}"
            await self._tell(job, said)
            await self.launcher.requeue_running(job, said)
            moved.append({"id": job.id, "did": "requeued", "why": f"not suspended: {not_suspended}" if not_suspended
                          else ""})
        return moved, left

    async def _tell(self, job: "Job", text: str) -> None:
        """A line in a process job's log (the shim's, appended to; a container's log is its
        engine's: the job's reason says it there)."""
        if job.spec.runtime != "process":
            return

        def append() -> None:
            fd = os.open(self.config.log_path(job.id), os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, f"\n[colo: {text}]\n".encode())
            finally:
                os.close(fd)
        try:
            await asyncio.to_thread(append)
        except OSError as e:  # telling is best effort: its reason says it too
            log.warning("job %d: could not write to its log: %s", job.id, e)

    async def faults(self, devices: list["GpuInfo"]) -> None:
        """Drain each GPU that newly reports a fault (lost, in error, Xid, ECC), with that reason,
        and requeue its jobs. A fault drains once: after `colo undrain` the GPU stays in service
        until its fault changes (a new Xid, more ECC errors, lost again after it answered)."""
        for d in devices:
            why = d.error or d.fault
            if why == self._faults.get(d.uuid):
                continue
            if why is None:  # it answers and reports nothing: a later fault drains it again
                self._faults.pop(d.uuid, None)
                continue
            self._faults[d.uuid] = why
            text = drained_text(FAULT_BY, why)
            self.store.set_drain(d.uuid, d.index, FAULT_BY, why)
            self.gpus.set_drained(d.uuid, text)
            moved, left = await self._move_off([(d.uuid, d.index)], text, "")
            requeued = [m["id"] for m in moved]
            self.store.log_admin(FAULT_BY, "drain", f"GPU {d.index} ({d.uuid})", why + _now_said(moved, left))
            log.error("GPU %d (%s) %s; requeued: %s%s (colo undrain %d puts it back)", d.index, d.uuid, text,
                      ", ".join(map(str, requeued)) or "no job",
                      "".join(f"; job {j['id']} left there: {j['why']}" for j in left), d.index)
            self.wake()

    async def undrain(self, caller: Caller, args: dict) -> dict:
        self._admin(caller, "undrain")
        stored = self.store.drains()
        gpus = self._resolve(args.get("gpus") or [], stored)
        out = []
        for uuid, index in gpus:
            was = self.store.undrain(uuid)
            self.gpus.set_drained(uuid, None)
            if was:
                log.info("GPU %d (%s) undrained by %s", index, uuid, caller.user)
                self.store.log_admin(caller.user, "undrain", f"GPU {index} ({uuid})", "")
            out.append({"index": index, "uuid": uuid, "was_drained": was})
        self.wake()
        return {"gpus": out}


def _now_said(moved: list[dict], left: list[dict]) -> str:
    """What a drain did with the jobs running there, for the admin log ("" when it moved none)."""
    parts = [f"{did} {', '.join(str(m['id']) for m in moved if m['did'] == did)}" for did in ("suspended", "requeued")
             if any(m["did"] == did for m in moved)]
    parts += [f"left {', '.join(str(j['id']) for j in left)}"] if left else []
    return f"; jobs {'; '.join(parts)}" if parts else ""
