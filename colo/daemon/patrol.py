"""The patrol: GPU memory as NVML sees it per process, reconciled with the jobs' budgets.

The interposer is the fence; this is the patrol. A process that bypasses the interposer (a
static binary, `env -u LD_PRELOAD`, a process that escaped its job) still shows in NVML's
per-process list. On every sample each such process is mapped to a job: by the job's own cgroup
(colo/node/cgroup.py: every process job has one), by the container id in
/proc/PID/cgroup, by the process tree of a process job, or by the job id colo put in its
environment (believed only for a process of the job's own user: it can only blame its own job).
- a job whose processes hold more than its budget (plus `context` per process for what the
  driver keeps per context) on a GPU is reported, and killed after `patrol_grace` seconds unless
  `patrol_kill` is off;
- memory held by processes of no job, and what jobs hold past their budgets, is unbudgeted: it
  is taken from what plan() may give out on that GPU (GpuView.usable), so nobody is placed into
  memory that is in use, and `colo gpus` / `colo top` show it.

Owns: `over` (running jobs over their budget, since when) and `foreign` (processes of no job).
What is unbudgeted it reports to the GPUs (Gpus.unbudgeted). Its kills go through the launcher
(`stop`), which alone acts on jobs' processes.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from ..config import Config
from ..jobs import ACTIVE, Job
from ..node.cgroup import job_of_pid as _cgroup_job_of_pid
from ..node.gpu import GpuInfo
from ..units import format_size
from .gpus import Gpus
from .jobtable import JobTable

log = logging.getLogger("colo")


CONTEXT_ALLOWANCE = 512 * 1024**2  # bytes per process: a CUDA context, which no budget counts
_CONTAINER_ID = re.compile(rb"[0-9a-f]{64}")
_ENV_JOB = re.compile(rb"(?:^|\0)COLO_JOB_ID=(\d{1,19})(?:\0|$)")


@dataclass
class Over:
    """A job over its budget: since when, and the words for it."""
    since: float
    text: str
    pids: set[int] = field(default_factory=set)
    killing: bool = False


@dataclass
class PatrolReport:
    by_job: dict[int, dict[str, int]]  # job -> GPU uuid -> bytes its processes hold
    pids: dict[int, set[int]]  # job -> its pids seen on a GPU
    foreign: list[dict]  # processes of no job: gpu, pid, used, uid
    unbudgeted: dict[str, int]  # GPU uuid -> bytes held outside any budget


def _read(path: str, limit: int = 1 << 16) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return b""
    try:
        return os.read(fd, limit)
    except OSError:
        return b""
    finally:
        os.close(fd)


def uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


class Patrol:
    def __init__(self, config: Config, table: JobTable, gpus: Gpus, instance: str,
                 stop: Callable[[int, str, set[int]], Awaitable[bool]]):
        self.config = config
        self.table = table
        self.gpus = gpus
        self.instance = instance
        self.stop = stop  # (job id, by whom, its pids) -> False when it is still starting
        self.over: dict[int, Over] = {}  # running jobs over their budget
        self.foreign: list[dict] = []  # processes on GPUs that belong to no job (last sample)

    def map_processes(self, devices: list[GpuInfo], running: list[Job], tree: dict[int, list[int]],
                      own_pids) -> PatrolReport:
        """Which job each GPU process belongs to (blocking: reads /proc; run in a thread).
        `tree`: job -> pids of its process tree (or container) as its runtime says; `own_pids()`:
        colo's own GPU processes (MPS servers)."""
        by_pid: dict[int, int] = {p: j for j, pids in tree.items() for p in pids}
        jobs = {j.id: j for j in running}
        containers = {j.handle: j.id for j in running if j.spec.image and j.handle}
        instance = self.instance
        by_job: dict[int, dict[str, int]] = {}
        pids: dict[int, set[int]] = {}
        foreign, unbudgeted = [], {}
        own: set[int] | None = None
        for dev in devices:
            if dev.error:
                continue
            for p in dev.processes:
                job_id = by_pid.get(p.pid)
                if job_id is None:
                    own = own_pids() if own is None else own  # asked only when a process is not a job's
                    if p.pid in own:
                        continue
                if job_id is None:
                    try:
                        job_id = _cgroup_job_of_pid(p.pid, instance)
                    except Exception:  # noqa: BLE001 - gone, or not ours
                        job_id = None
                if job_id is None and containers:
                    m = _CONTAINER_ID.findall(_read(f"/proc/{p.pid}/cgroup"))
                    job_id = next((containers[c.decode()] for c in m if c.decode() in containers), None)
                if job_id is None:
                    m = _ENV_JOB.search(_read(f"/proc/{p.pid}/environ", 1 << 20))
                    cand = jobs.get(int(m.group(1))) if m else None
                    if cand is not None and not cand.spec.image and uid_of(p.pid) == cand.uid:
                        job_id = cand.id
                used = p.used or 0
                if job_id is None or job_id not in jobs:
                    foreign.append({"gpu": dev.uuid, "pid": p.pid, "used": p.used, "uid": uid_of(p.pid)})
                    unbudgeted[dev.uuid] = unbudgeted.get(dev.uuid, 0) + used
                    continue
                per = by_job.setdefault(job_id, {})
                per[dev.uuid] = per.get(dev.uuid, 0) + used
                pids.setdefault(job_id, set()).add(p.pid)
        return PatrolReport(by_job, pids, foreign, unbudgeted)

    def check(self, report: PatrolReport, now: float) -> bool:
        """Compare with the budgets; report, and kill after the grace period. True when what is
        held outside any budget changed (what plan() may give out)."""
        unbudgeted = dict(report.unbudgeted)
        over_now: dict[int, str] = {}
        for job_id, per_gpu in report.by_job.items():
            job = self.table.open.get(job_id)
            if job is None or job.state not in ACTIVE:
                continue
            nproc = len(report.pids.get(job_id, ()))
            allowed = job.spec.gpu_mem + CONTEXT_ALLOWANCE * max(1, nproc)
            for uuid, used in per_gpu.items():
                budget = job.spec.gpu_mem if uuid in job.gpus else 0
                limit = allowed if uuid in job.gpus else CONTEXT_ALLOWANCE * max(1, nproc)
                if used > limit:
                    unbudgeted[uuid] = unbudgeted.get(uuid, 0) + used - budget
                    name = self.gpus.name_of(uuid)
                    over_now[job_id] = (f"its processes hold {format_size(used)} of GPU memory on {name} (NVML), "
                                        f"over its budget of {format_size(budget)}"
                                        + ("" if uuid in job.gpus else f" ({name} is not one of its GPUs)"))
        changed = unbudgeted != self.gpus.unbudgeted
        self.gpus.unbudgeted = unbudgeted
        self.foreign = report.foreign
        for job_id in list(self.over):
            if job_id not in over_now:
                o = self.over.pop(job_id)
                if not o.killing and job_id in self.table.open:
                    log.warning("job %d is back within its budget", job_id)
        cfg = self.config
        for job_id, text in over_now.items():
            o = self.over.get(job_id)
            if o is None:
                o = self.over[job_id] = Over(now, text, set(report.pids.get(job_id, ())))
                log.warning("job %d: %s; %s", job_id, text,
                            f"killed in {cfg.patrol_grace:g} s unless it drops" if cfg.patrol_kill
                            else "left running (patrol_kill is off)")
            o.text, o.pids = text, set(report.pids.get(job_id, ()))
            if cfg.patrol_kill and not o.killing and now - o.since >= cfg.patrol_grace:
                o.killing = True
                asyncio.get_running_loop().create_task(self._kill(job_id, o))
        return changed

    def note(self, job_id: int) -> str | None:
        """Words for `colo show`/`ls`/`explain` about a job over its budget, or None."""
        o = self.over.get(job_id)
        if o is None:
            return None
        if o.killing:
            return f"over its budget: {o.text}; being killed by the patrol"
        left = self.config.patrol_grace - (time.time() - o.since)
        return (f"over its budget: {o.text}; " + (f"killed in {max(0, left):.0f} s unless it drops"
                                                   if self.config.patrol_kill else "patrol_kill is off"))

    async def _kill(self, job_id: int, o: Over) -> None:
        job = self.table.open.get(job_id)
        if job is None or job.state not in ACTIVE:
            return
        by = f"the GPU memory patrol ({o.text} for {time.time() - o.since:.0f} s)"
        log.error("job %d: %s: killing it", job_id, o.text)
        if not await self.stop(job_id, by, o.pids):
            o.killing = False  # still starting: the next sample tries again
