"""The patrol: GPU memory as NVML sees it per process, reconciled with the jobs' budgets.

The interposer is the fence; this is the patrol. A process that bypasses the interposer (a
static binary, `env -u LD_PRELOAD`, a process that escaped its job) still shows in NVML's
per-process list. On every sample each such process is mapped to a job, by what only root can
make: the job's process tree or cgroup as its runtime lists it, or, for a process that appeared
since, the job's exact cgroup folder (colo's root-owned `job-<N>`, or the engine's own cgroup of
the container; colo/node/cgroup.py owner()), at its top or beneath it. A folder name matched
anywhere in the path, or a job id in the environment, can be made by any user (systemd delegates
a subtree to each), so neither counts: such a process is outside every budget.

- A job whose processes hold more than its budget (plus `context` per process for what the
  driver keeps per context) on one of its GPUs is reported. Its time over is counted over a
  sliding window (`patrol_window`, by default twice `patrol_grace`): once it has been over for
  `patrol_grace` seconds within the window it is killed (unless `patrol_kill` is off). A dip
  under the budget does not restart the count, so a job cannot outwait the patrol.
- Ended at the next sample, whatever the grace: a job holding memory on a GPU that is not its
  own, or over its budget on a GPU whose free memory is less than what the GPU's other jobs may
  still take within their budgets (their in-budget allocations would fail there).
- A process of a job that has just ended (NVML still lists it while the driver releases its
  memory) counts as neither for `patrol_grace` seconds after it was last seen in its job.
- Memory held by processes of no job, and what jobs hold past their budgets, is unbudgeted: it
  is taken from what plan() may give out on that GPU (GpuView.usable), so nobody is placed into
  memory that is in use, and `colo gpus` / `colo top` show it; each is logged once, with its
  owner's uid. With `patrol_kill_foreign` (on by default on a gated node) such a process, of any
  user but root, is killed (seen two samples running, so that a job's process that started
  between the runtime's listing and NVML's is not taken for one): on a gated node at once (it got
  past the gate, e.g. with a device descriptor a job handed out), elsewhere by the jobs' rules; by
  pid checked against its start time and uid through a pidfd (colo/node/procs.py). On a gated
  node the first sight of one also has every process outside colo's folders that holds the
  GPUs' files open killed (colo/node/gate.py descriptor_holders): a descriptor passed out of a
  job, held by a process that uses no GPU itself and hands it to short-lived ones.

Owns: `over` (running jobs over their budget now), the time each job and stray process was over
within the window, and `foreign` (processes of no job, last sample). What is unbudgeted it
reports to the GPUs (Gpus.unbudgeted). Its kills of jobs go through the launcher (`stop`), which
alone acts on jobs' processes; those of processes of no job it makes itself.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from ..config import Config
from ..jobs import ACTIVE, Job
from ..node import cgroup, gate, procs
from ..node.gpu import GpuInfo
from ..units import format_size
from .engines import Engines
from .gpus import Gpus
from .jobtable import JobTable

log = logging.getLogger("colo")


# Bytes per process that NVML shows beside what its budget counts: the CUDA context and the
# driver's own reserve. Measured on an H200 (docs/gpu.md): 518 MiB for the driver API, PyTorch's
# default allocator and CuPy, 550 MiB for JAX, 588 MiB for PyTorch's cudaMallocAsync backend;
# 512 MiB would have had the patrol kill a cudaMallocAsync job for holding its whole budget.
CONTEXT_ALLOWANCE = 768 * 1024**2


@dataclass
class Over:
    """A job over its budget now: the words for it, and why it must end at once (or None)."""
    text: str
    pids: set[int] = field(default_factory=set)
    at_once: str | None = None
    killing: bool = False


class Tally:
    """Seconds over, counted per sample, within a sliding window: a dip only stops the count."""

    def __init__(self) -> None:
        self.marks: deque[tuple[float, float]] = deque()  # (sample time, seconds counted then)
        self.seen = 0  # samples in a row it was over

    def add(self, now: float, dt: float) -> None:
        self.marks.append((now, dt))
        self.seen += 1

    def spent(self, now: float, window: float) -> float:
        while self.marks and self.marks[0][0] <= now - window:
            self.marks.popleft()
        return sum(dt for _, dt in self.marks)


@dataclass
class PatrolReport:
    by_job: dict[int, dict[str, int]]  # job -> GPU uuid -> bytes its processes hold
    pids: dict[int, set[int]]  # job -> its pids seen on a GPU
    foreign: list[dict]  # processes of no job: gpu, pid, used, uid
    unbudgeted: dict[str, int]  # GPU uuid -> bytes held outside any budget
    who: dict[int, tuple[int, int]] = field(default_factory=dict)  # foreign pid -> (start time, uid)
    sure: bool = True  # every running job's processes could be told (else no process is called a stray)


def uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


class Patrol:
    def __init__(self, config: Config, table: JobTable, gpus: Gpus, engines: Engines,
                 stop: Callable[[int, str, set[int]], Awaitable[bool]],
                 gate_spared: list[tuple[str, str]] | None = None):
        self.config = config
        self.table = table
        self.gpus = gpus
        self.engines = engines
        self.stop = stop  # (job id, by whom, its pids) -> False when it is still starting
        self.over: dict[int, Over] = {}  # running jobs over their budget now
        self.foreign: list[dict] = []  # processes on GPUs that belong to no job (last sample)
        self._tally: dict[int, Tally] = {}  # job -> its time over within the window
        self._strays: dict[tuple[int, int], Tally] = {}  # (pid, start) of a process of no job -> the same
        self._containers: dict[str, dict[str, str]] = {}  # container handle -> its cgroup (it never moves)
        self._last: float | None = None  # the previous check
        self._was: dict[int, tuple[int, float]] = {}  # pid -> (the job it was last seen in, when)
        # set by the daemon when the node's gate is up (colo/node/gate.py): the cgroup folders, as
        # /proc/PID/cgroup names them, where a process may hold the GPUs' files open
        self.gate_spared = gate_spared  # a gated node's folders spared by its gate (None: not gated)
        self._sweeping = False

    @property
    def window(self) -> float:
        return self.config.patrol_window or 2 * self.config.patrol_grace

    def map_processes(self, devices: list[GpuInfo], running: list[Job], tree: dict[int, list[int]],
                      own_pids) -> PatrolReport:
        """Which job each GPU process belongs to (blocking: reads /proc, may ask the engine; run in
        a thread). `tree`: job -> pids of its process tree (or container) as its runtime says;
        `own_pids()`: colo's own GPU processes (MPS servers)."""
        by_pid: dict[int, int] = {p: j for j, pids in tree.items() for p in pids}
        jobs = {j.id: j for j in running}
        by_job: dict[int, dict[str, int]] = {}
        pids: dict[int, set[int]] = {}
        foreign, unbudgeted, who = [], {}, {}
        own: set[int] | None = None
        owners: dict[tuple[str, str], int] | None = None
        sure = True
        for dev in devices:
            if dev.error:
                continue
            for p in dev.processes:
                job_id = by_pid.get(p.pid)
                if job_id is None:
                    own = own_pids() if own is None else own  # asked only when a process is not a job's
                    if p.pid in own:
                        continue
                    if owners is None:  # likewise: where each running job's cgroup is
                        owners, sure = self._owners(running)
                    job_id = cgroup.owner(cgroup.places(p.pid), owners)
                used = p.used or 0
                if job_id is None or job_id not in jobs:
                    ident = procs.identity(p.pid)
                    foreign.append({"gpu": dev.uuid, "pid": p.pid, "used": p.used,
                                    "uid": ident[1] if ident else None})
                    if ident:
                        who[p.pid] = ident
                    unbudgeted[dev.uuid] = unbudgeted.get(dev.uuid, 0) + used
                    continue
                per = by_job.setdefault(job_id, {})
                per[dev.uuid] = per.get(dev.uuid, 0) + used
                pids.setdefault(job_id, set()).add(p.pid)
        return PatrolReport(by_job, pids, foreign, unbudgeted, who, sure)

    def _owners(self, running: list[Job]) -> tuple[dict[tuple[str, str], int], bool]:
        """(hierarchy, exact cgroup path) -> job, for the running jobs whose runtime keeps them in a
        cgroup of their own; False when the engine could not say where one of them is."""
        out: dict[tuple[str, str], int] = {}
        sure = True
        handles = {j.handle for j in running if j.spec.image and j.handle}
        for h in list(self._containers):
            if h not in handles:
                del self._containers[h]
        for j in running:
            if not j.handle:
                continue
            paths = self._containers.get(j.handle) if j.spec.image else None
            if paths is None:
                try:
                    paths = self.engines.runtime_for(j).cgroup_paths(j.handle)
                except Exception as e:  # noqa: BLE001 - the engine away or erring, the job ending
                    log.debug("job %d: where its processes are is unknown now: %s", j.id, e)
                    sure = False
                    continue
                if j.spec.image and paths:
                    self._containers[j.handle] = paths
            for key, path in paths.items():
                out[(key, path)] = j.id
        return out, sure

    def _owed(self, report: PatrolReport) -> dict[str, dict[int, int]]:
        """GPU uuid -> {job placed there: bytes it may still take within its budget}."""
        out: dict[str, dict[int, int]] = {}
        for j in self.table.jobs_in(*ACTIVE):
            for uuid in j.gpus:
                held = report.by_job.get(j.id, {}).get(uuid, 0)
                out.setdefault(uuid, {})[j.id] = max(0, j.spec.gpu_mem - held)
        return out

    def check(self, report: PatrolReport, now: float) -> bool:
        """Compare with the budgets; report, and kill by the rules above. True when what is held
        outside any budget changed (what plan() may give out)."""
        cfg = self.config
        dt = cfg.sample_interval if self._last is None else max(0.0, min(now - self._last, 2 * cfg.sample_interval))
        self._last = now
        unbudgeted = dict(report.unbudgeted)
        self._spare_ended(report, unbudgeted, now)
        free = {d.uuid: d.total - d.used for d in self.gpus.devices if not d.error}
        owed = self._owed(report)

        def short(uuid: str, but: int | None = None) -> str | None:
            """Words for a GPU whose free memory is less than its jobs (but one) may still take."""
            want = sum(b for j, b in owed.get(uuid, {}).items() if j != but)
            if uuid in free and free[uuid] < want:
                return (f"{self.gpus.name_of(uuid)} has {format_size(max(0, free[uuid]))} free while its other jobs "
                        f"may still take {format_size(want)} within their budgets")
            return None

        over_now: dict[int, Over] = {}
        for job_id, per_gpu in report.by_job.items():
            job = self.table.open.get(job_id)
            if job is None or job.state not in ACTIVE:
                continue
            nproc = len(report.pids.get(job_id, ()))
            for uuid, used in per_gpu.items():
                mine = uuid in job.gpus
                budget = job.spec.gpu_mem if mine else 0
                if used <= budget + CONTEXT_ALLOWANCE * max(1, nproc):
                    continue
                unbudgeted[uuid] = unbudgeted.get(uuid, 0) + used - budget
                name = self.gpus.name_of(uuid)
                text = (f"its processes hold {format_size(used)} of GPU memory on {name} (NVML), "
                        f"over its budget of {format_size(budget)}")
                at_once = f"{name} is not one of its GPUs" if not mine else short(uuid, but=job_id)
                o = over_now.get(job_id)
                if o is None or (at_once and not o.at_once):
                    over_now[job_id] = Over(text, set(report.pids.get(job_id, ())), at_once)
        changed = self.gpus.note_unbudgeted(unbudgeted)
        self.foreign = report.foreign
        self._judge_jobs(over_now, now, dt)
        self._judge_strays(report, now, dt, short)
        return changed

    def _spare_ended(self, report: PatrolReport, unbudgeted: dict[str, int], now: float) -> None:
        """A process of a job that has just ended, still listed by NVML while the driver releases
        its memory, is neither outside any budget nor a stray until `patrol_grace` seconds after it
        was last seen in its job: counted as unbudgeted, it would keep the next job (one Slurm put
        into the shards just freed) off memory that is about to be free."""
        for job_id, pids in report.pids.items():
            for pid in pids:
                self._was[pid] = (job_id, now)
        for pid in [p for p, (_, at) in self._was.items() if now - at > self.config.patrol_grace]:
            del self._was[pid]
        ending = set()
        for f in report.foreign:
            was = self._was.get(f["pid"])
            job = self.table.open.get(was[0]) if was else None
            if was and (job is None or job.state not in ACTIVE):
                ending.add(f["pid"])
                left = unbudgeted.get(f["gpu"], 0) - (f["used"] or 0)
                if left > 0:
                    unbudgeted[f["gpu"]] = left
                else:
                    unbudgeted.pop(f["gpu"], None)
        if ending:
            report.foreign = [f for f in report.foreign if f["pid"] not in ending]

    def _judge_jobs(self, over_now: dict[int, Over], now: float, dt: float) -> None:
        cfg, window = self.config, self.window
        for job_id in list(self.over):
            if job_id not in over_now:
                o = self.over.pop(job_id)
                if not o.killing and job_id in self.table.open:
                    log.warning("job %d is back within its budget (its time over counts on for %g s)", job_id, window)
        for job_id in list(self._tally):
            t = self._tally[job_id]
            if job_id not in over_now:
                t.seen = 0
                if not t.spent(now, window) or job_id not in self.table.open:
                    del self._tally[job_id]
        for job_id, new in over_now.items():
            o = self.over.get(job_id)
            t = self._tally.setdefault(job_id, Tally())
            t.add(now, dt)
            spent = t.spent(now, window)
            if o is None:
                o = self.over[job_id] = new
                log.warning("job %d: %s; %s", job_id, new.text,
                            "left running (patrol_kill is off)" if not cfg.patrol_kill
                            else f"killed now: {new.at_once}" if new.at_once
                            else f"killed once over it for {cfg.patrol_grace:g} s within {window:g} s")
            else:
                o.text, o.pids, o.at_once = new.text, new.pids, new.at_once
            if cfg.patrol_kill and not o.killing and (o.at_once or spent >= cfg.patrol_grace):
                o.killing = True
                why = o.at_once or f"over it for {spent:.0f} s of the last {window:g} s"
                asyncio.get_running_loop().create_task(self._kill(job_id, o, why))

    def _judge_strays(self, report: PatrolReport, now: float, dt: float, short) -> None:
        """patrol_kill_foreign: the processes of no job, by the jobs' rules (root's are left)."""
        cfg, window = self.config, self.window
        seen: set[tuple[int, int]] = set()
        for f in report.foreign:
            ident = report.who.get(f["pid"])
            if ident is None or not f["used"]:
                continue
            key = (f["pid"], ident[0])
            if key in seen:  # the same process on a second GPU: counted once a sample
                continue
            seen.add(key)
            t = self._strays.get(key)
            if t is None:  # told once per process, with its owner
                if cfg.kill_foreign and ident[1] != 0 and self.gate_spared is not None and not self._sweeping:
                    self._sweeping = True  # who else holds the files it got past the gate with
                    asyncio.get_running_loop().create_task(self._sweep())
                t = self._strays[key] = Tally()
                log.warning("process %d (uid %d), in no job, holds %s on %s outside any budget%s", f["pid"], ident[1],
                            format_size(f["used"] or 0), self.gpus.name_of(f["gpu"]),
                            "" if ident[1] == 0 else "; it will be killed (patrol_kill_foreign)" if cfg.kill_foreign
                            else "; left running (patrol_kill_foreign is off)")
            t.add(now, dt)
            spent = t.spent(now, window)
            if not (cfg.kill_foreign and report.sure and ident[1] != 0 and t.seen >= 2):
                continue
            # on a gated node no process outside colo's jobs may use a GPU at all: it got past the gate
            why = ("the GPUs are gated to colo's jobs (gpu_group)" if cfg.gpu_group is not None else None) \
                or short(f["gpu"]) or (f"over it for {spent:.0f} s of the last {window:g} s"
                                       if spent >= cfg.patrol_grace else None)
            if why:
                asyncio.get_running_loop().create_task(self._kill_stray(f, ident, why))
        for key in list(self._strays):
            if key not in seen:
                t = self._strays[key]
                t.seen = 0
                if not t.spent(now, window):
                    del self._strays[key]

    def note(self, job_id: int) -> str | None:
        """Words for `colo show`/`ls`/`explain` about a job over its budget, or None."""
        o = self.over.get(job_id)
        if o is None:
            return None
        if o.killing or (o.at_once and self.config.patrol_kill):
            return f"over its budget: {o.text}; being killed by the patrol ({o.at_once or 'its time is up'})"
        if not self.config.patrol_kill:
            return f"over its budget: {o.text}; patrol_kill is off"
        t = self._tally.get(job_id)
        spent = t.spent(time.time(), self.window) if t else 0.0
        return (f"over its budget: {o.text}; killed in {max(0.0, self.config.patrol_grace - spent):.0f} s unless it "
                f"drops (over it for {spent:.0f} s of the last {self.window:g} s)")

    async def _kill(self, job_id: int, o: Over, why: str) -> None:
        job = self.table.open.get(job_id)
        if job is None or job.state not in ACTIVE:
            return
        by = f"the GPU memory patrol ({o.text}; {why})"
        log.error("job %d: %s; %s: killing it", job_id, o.text, why)
        if not await self.stop(job_id, by, o.pids):
            o.killing = False  # still starting: the next sample tries again

    async def _sweep(self) -> None:
        """A process of no job uses a GPU on a gated node: it got past the gate with a descriptor
        opened in a job (the kernel checks devices at open). Kill every process outside colo's
        folders that holds the GPUs' files open: that one, and whoever passes it descriptors
        without using a GPU itself (never seen in NVML's list)."""
        try:
            found = await asyncio.to_thread(gate.descriptor_holders, self.engines.gpu_nodes, self.gate_spared or [])
            for pid, start, uid in found:
                if await asyncio.to_thread(procs.kill_exact, pid, start, uid):
                    log.error("process %d (uid %d), in no job, held the GPUs' device files open on a gated node (a "
                              "descriptor from a job: the gate checks at open only): killed (patrol_kill_foreign)",
                              pid, uid)
        finally:
            self._sweeping = False

    async def _kill_stray(self, f: dict, ident: tuple[int, int], why: str) -> None:
        if await asyncio.to_thread(procs.kill_exact, f["pid"], *ident):
            log.error("process %d (uid %d), in no job, held %s on %s outside any budget; %s: killed "
                      "(patrol_kill_foreign)", f["pid"], ident[1], format_size(f["used"] or 0),
                      self.gpus.name_of(f["gpu"]), why)
