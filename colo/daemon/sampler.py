"""Periodic readings: NVML, per-job usage samples, MPS health, and the patrol's look.

Owns: `stats` (running jobs' last sample: pids, SM, memory from the ledger, what NVML saw), how
far each job's log had grown, and since when each job has held GPU memory with no GPU activity.
Each tick it refreshes the GPUs, hands MPS faults to the launcher, stores usage samples (learning
reads them at a job's end) and gives the patrol its report; it wakes the scheduler when what
plan() may give out changed. A job idle for `idle_after` is marked (stats' `idle_since`); an idle
interactive session is told so (`notices`, its log), and under idle_sessions = "end" cancelled
when still idle `idle_grace` later.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

import psutil

from typing import Callable

from .. import logtimes, report
from ..config import Config
from ..jobs import ACTIVE, Job, Mode, State
from ..node import interposer
from ..node.gpu import GpuInfo
from ..units import format_duration, format_size
from .engines import Engines
from .gpus import Gpus
from .jobtable import JobTable
from .launcher import Launcher
from .learner import mps_server_shares
from .patrol import Patrol

log = logging.getLogger("colo")


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for pid, ppid in psutil._ppid_map().items():
        out.setdefault(ppid, []).append(pid)
    return out


def _tree(handle: str, kids: dict[int, list[int]]) -> list[int]:
    """The pids of a process job's tree, as ProcessRuntime.pids gives them (its handle is
    "pid:create_time"; a reused pid is not the job)."""
    pid, _, created = handle.partition(":")
    try:
        root = psutil.Process(int(pid))
        if int(pid) <= 0 or abs(root.create_time() - float(created)) > 0.01:
            return []
    except (psutil.Error, ValueError):
        return []
    out, todo = [root.pid], [root.pid]
    while todo:
        for c in kids.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def idle_step(policy: str, interactive: bool, idle_since: float | None, told: float | None, now: float,
              grace: float) -> str | None:
    """What to do now about a running job: "tell" an idle session it is idle, "end" one told at
    least `grace` seconds ago that is idle still (policy "end"), or nothing (None)."""
    if idle_since is None or not interactive or policy == "off":
        return None
    if told is None:
        return "tell"
    return "end" if policy == "end" and now - told >= grace else None


class Sampler:
    def __init__(self, config: Config, table: JobTable, gpus: Gpus, engines: Engines, launcher: Launcher,
                 patrol: Patrol, wake: Callable[..., None], faulted=None):
        self.config = config
        self.faulted = faulted  # async (devices): drains what NVML reports failing (drain.Drains.faults)
        self.table = table
        self.gpus = gpus
        self.engines = engines
        self.launcher = launcher
        self.patrol = patrol
        self.wake = wake
        self.stats: dict[int, dict] = {}  # running jobs' last sample: pids, sm_util, used, refused, idle_since
        self._log_sizes: dict[int, int] = {}
        self._mps_seen: dict | None = None
        self._idle_from: dict[int, float] = {}  # job -> its first sample of the stretch it holds memory idle
        self._told: dict[int, float] = {}  # idle session -> when it was told it is idle
        # the latest thing an idle session was told, by job: a session's stream gives it to its
        # client, which writes it on the person's terminal (session.py, cli/attach.py)
        self.notices: dict[int, str] = {}

    async def sample(self) -> None:
        # Each hand-off to a worker thread wakes two threads and the loop: one is made only where
        # there is blocking work (jobs' logs, their samples, GPU processes to map), so that an idle
        # daemon's tick is one NVML read (docs/reliability.md, "What an idle daemon does").
        table, gpus = self.table, self.gpus
        active = table.jobs_in(*ACTIVE)
        if active or self._log_sizes:
            await asyncio.to_thread(self._note_logs, active)
        if gpus.error is None:
            devices = await asyncio.to_thread(gpus.refresh)
            if gpus.error is None:
                self._note_gpu_errors(gpus.adopt(devices), devices)
                if self.faulted is not None:
                    await self.faulted(devices)
        m = gpus.mps
        if m.available():
            report = await asyncio.to_thread(m.check)
            for uuid, message in report.events:
                log.warning("MPS on %s: %s", uuid, message)
            for uuid, clients in report.faults.items():
                await self.launcher.mps_fault(uuid, set(clients))
            busy = {u for j in table.jobs_in(*ACTIVE) if j.mode == Mode.MPS for u in j.gpus}
            await asyncio.to_thread(m.release_idle, time.time(), busy)
            states = m.states()
            if states != self._mps_seen:  # e.g. a server left FAULT: MPS jobs may start
                self._mps_seen = states
                self.wake()
        running = table.jobs_in(State.RUNNING)
        # nothing running (or no driver): nothing to read, stats emptied on the loop
        rows = await asyncio.to_thread(self._usage_samples, running) if running and gpus.error is None \
            else self._usage_samples(running)
        if rows:
            table.store.add_samples(rows)
        await self._idle_sessions(running, time.time())
        if gpus.error is None:
            tree = {j: st.get("pids", ()) for j, st in self.stats.items()}
            work = (gpus.devices, running, tree, m.own_pids)
            if any(d.processes for d in gpus.devices if not d.error):  # /proc, cgroups, the engine
                report = await asyncio.to_thread(self.patrol.map_processes, *work)
            else:  # no GPU process: an empty report, made without blocking
                report = self.patrol.map_processes(*work)
            changed = self.patrol.check(report, time.time())
            for job_id, per_gpu in report.by_job.items():
                if job_id in self.stats:
                    self.stats[job_id]["nvml_used"] = max(per_gpu.values())
            if changed:
                self.wake()  # what plan() may give out changed

    def _note_logs(self, active: list[Job]) -> None:
        """How far each live job's log has grown, with the time (colo logs --timestamps/--since)."""
        last = self._log_sizes
        self._log_sizes = {j.id: logtimes.note(self.config.log_path(j.id), last.get(j.id, 0)) for j in active}

    def _note_gpu_errors(self, before: list[GpuInfo], after: list[GpuInfo]) -> None:
        """Say when the driver stops (or starts again) answering for a GPU (`faulted` drains it and
        moves its jobs; without it nothing new goes there while it does not answer)."""
        was = {d.uuid: d.error for d in before}
        for d in after:
            if d.error and not was.get(d.uuid):
                log.error("GPU%d (%s): %s", d.index, d.uuid, d.error)
            elif not d.error and was.get(d.uuid):
                log.warning("GPU%d (%s) answers again%s", d.index, d.uuid,
                            " (it stays drained until colo undrain)" if self.faulted is not None else "")
                self.wake()

    def _usage_samples(self, running: list[Job]) -> list[tuple]:
        """Per running GPU job: memory from its ledger, SM and bandwidth from NVML's per-process
        samples. Also kept as `stats` (with the job's pids), which `top` and `ls` read."""
        if self.gpus.error or not running:
            self.stats = {}
            return []
        util: dict[int, tuple[int, int]] = {}
        per_gpu: dict[str, dict[int, tuple[int, int]]] = {}
        for dev in self.gpus.devices:
            if dev.error is None and any(dev.uuid in j.gpus for j in running):
                util.update(per_gpu.setdefault(dev.uuid, self.gpus.nvml.process_utilization(dev.index)))
        # MPS work that NVML gives the server's pid, apportioned to its jobs (learner.py says how)
        on_mps = {j.id: tuple(j.gpus) for j in running if j.mode == Mode.MPS}
        shares = mps_server_shares(per_gpu, self.gpus.mps.own_pids(), on_mps) if on_mps else {}
        now, rows, stats = time.time(), [], {}
        kids: dict[int, list[int]] | None = None
        for j in running:
            if not j.gpus or not j.handle:
                continue
            try:
                rt = self.engines.runtime_for(j)
                if rt.name == "process" and rt.cgroups is None:  # else it lists its cgroup
                    # one parent map for every process job: psutil's children() reads all of /proc
                    # once per call (8 running jobs: 64 ms of CPU a sample, most of an idle daemon's)
                    kids = _children_map() if kids is None else kids
                    pids = _tree(j.handle, kids)
                else:
                    pids = rt.pids(j.handle)
            except Exception:  # noqa: BLE001 - it may be ending right now
                pids = []
            u = self.usage(j, pids)
            extra = shares.get(j.id, (0.0, 0.0))
            sm = min((sum(util.get(p, (0, 0))[0] for p in pids) + extra[0]) / 100.0, 1.0)
            bw = min((sum(util.get(p, (0, 0))[1] for p in pids) + extra[1]) / 100.0, 1.0)
            rows.append((j.id, now, sm, u["used"] if u else None, bw))
            stats[j.id] = {"pids": pids, "sm_util": round(sm * 100), **(u or {})}
            if report.held_idle(sm, u["used"] if u else None):
                since = self._idle_from.setdefault(j.id, now)
                if self.config.idle_after and now - since >= self.config.idle_after:
                    stats[j.id]["idle_since"] = since
            else:
                self._idle_from.pop(j.id, None)
        for gone in set(self._idle_from) - set(stats):
            del self._idle_from[gone]
        self.stats = stats  # replaced whole: readers on the loop thread never see half of it
        return rows

    def idle_note(self, job_id: int, now: float | None = None) -> str | None:
        """What listings say of a job marked idle ("idle 35m: holds 2GiB, no GPU activity"), or None."""
        st = self.stats.get(job_id) or {}
        since = st.get("idle_since")
        if since is None:
            return None
        return (f"idle {format_duration((now or time.time()) - since)}: holds {format_size(st.get('used') or 0)}, "
                "no GPU activity")

    async def _idle_sessions(self, running: list[Job], now: float) -> None:
        """An interactive session marked idle is told so; under "end", cancelled once it stayed
        idle idle_grace after that. Batch jobs are only marked (they may be between phases)."""
        cfg = self.config
        for j in running:
            since = (self.stats.get(j.id) or {}).get("idle_since")
            step = idle_step(cfg.idle_sessions, j.spec.interactive, since, self._told.get(j.id),
                             now, cfg.idle_grace)
            if step is None:
                if since is None:
                    self._told.pop(j.id, None)  # busy again: told afresh next time
            elif step == "tell":
                self._told[j.id] = now
                end = (f"; it ends in {format_duration(cfg.idle_grace)} unless the GPU is used"
                       if cfg.idle_sessions == "end" else "")
                await self._tell(j, f"this session holds {format_size(self.stats[j.id].get('used') or 0)} of GPU "
                                    f"memory and has not used the GPU for {format_duration(now - since)}{end}")
            else:
                self._told.pop(j.id, None)
                await self.launcher.cancel(j.id, f"colo (idle {format_duration(now - since)} holding GPU memory, "
                                                 "idle_sessions = end)")
        for gone in set(self._told) - {j.id for j in running}:
            del self._told[gone]
        for gone in set(self.notices) - {j.id for j in running}:
            del self.notices[gone]

    async def _tell(self, job: Job, text: str) -> None:
        """A session on a terminal (colo shell, colo run) is told through its stream; one with no
        terminal of ours (a notebook's kernel) by a line in its log, a process job's log being
        the shim's, appended to (a container's is its follower's: only logged here)."""
        self.notices[job.id] = text
        if job.spec.tty:
            return
        if job.spec.runtime != "process":
            log.warning("job %d: %s", job.id, text)
            return

        def append() -> None:
            fd = os.open(self.config.log_path(job.id), os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, f"\n[colo: {text}]\n".encode())
            finally:
                os.close(fd)
        try:
            await asyncio.to_thread(append)
        except OSError as e:  # telling is best effort: the mark stays
            log.warning("job %d: could not tell it is idle: %s", job.id, e)

    def usage(self, job: Job, pids: list[int] | None = None) -> dict | None:
        """Live memory use from the job's ledger (exact, kept by the interposer). `pids`: the job's
        processes as its runtime lists them: the ledger is then read by them, not by its locks
        (interposer.read_ledger says why)."""
        if not job.gpus or job.state not in ACTIVE:
            return None
        known = interposer.ns_pids(pids) if pids is not None else None
        try:
            led = interposer.read_ledger(self.config.run_dir(job.id) / "ledger", pids=known)
        except Exception:  # noqa: BLE001 - not created yet, or already gone
            return None
        return {"used": sum(led.used.values()), "refused": led.refused, "budget": led.budget}
