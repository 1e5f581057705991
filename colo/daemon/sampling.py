"""Periodic work: NVML readings, per-job usage samples, MPS health and faults."""
from __future__ import annotations

import asyncio
import logging
import shutil
import time

import psutil

from ..node import interposer, mps
from .. import logtimes
from ..node.gpu import GpuInfo, NoDriver
from ..jobs import ACTIVE, TERMINAL, Job, Mode, State
from ..runtimes.base import EngineError, Gone, Unavailable
from .learning import mps_server_shares
from .lifecycle import Live, blocking
from .patrol import _cgroup_job_of_pid

log = logging.getLogger("colo")


CGROUPS = _cgroup_job_of_pid is not None  # process jobs then have cgroups: their runtime lists those


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


class SamplingMixin:
    """Part of Daemon (colo/daemon/core.py); uses its state."""

    async def _tick(self) -> None:
        while not self.stopping:
            try:
                await self.sample()
            except Exception as e:  # noqa: BLE001 - a bad sample must not stop the daemon
                log.warning("sampling failed: %s", e)
            await asyncio.sleep(self.config.sample_interval)

    async def sample(self) -> None:
        await asyncio.to_thread(self._note_logs, self.jobs_in(*ACTIVE))
        await self._watch_docker()
        if self.gpu_error is None:
            try:
                devices = await asyncio.to_thread(self.nvml.devices)
            except NoDriver as e:
                self.gpu_error = str(e)
            else:
                self._note_gpu_errors(self.devices, devices)
                self.devices = devices
        if self.mps is not None and self.mps.available():
            report = await asyncio.to_thread(self.mps.check)
            for uuid, message in report.events:
                log.warning("MPS on %s: %s", uuid, message)
            for uuid, clients in report.faults.items():
                await self._mps_fault(uuid, set(clients))
            busy = {u for j in self.jobs_in(*ACTIVE) if j.mode == Mode.MPS for u in j.gpus}
            await asyncio.to_thread(self.mps.release_idle, time.time(), busy)
            states = self.mps.states()
            if states != getattr(self, "_mps_seen", None):  # e.g. a server left FAULT: MPS jobs may start
                self._mps_seen = states
                self.wake()
        running = self.jobs_in(State.RUNNING)
        rows = await asyncio.to_thread(self._usage_samples, running)
        if rows:
            self.store.add_samples(rows)
        if self.gpu_error is None:
            own = self.mps.own_pids if self.mps is not None else set  # colo's MPS servers
            tree = {j: st.get("pids", ()) for j, st in self.stats.items()}
            report = await asyncio.to_thread(self.map_processes, self.devices, running, tree, own)
            before = self.unbudgeted
            self.patrol(report, time.time())
            for job_id, per_gpu in report.by_job.items():
                if job_id in self.stats:
                    self.stats[job_id]["nvml_used"] = max(per_gpu.values())
            if self.unbudgeted != before:
                self.wake()  # what plan() may give out changed

    def _note_logs(self, active: list[Job]) -> None:
        """How far each live job's log has grown, with the time (colo logs --timestamps/--since)."""
        last = getattr(self, "_log_sizes", {})
        self._log_sizes = {j.id: logtimes.note(self.log_path(j.id), last.get(j.id, 0)) for j in active}

    def _note_gpu_errors(self, before: list[GpuInfo], after: list[GpuInfo]) -> None:
        """Say when the driver stops (or starts again) answering for a GPU. Its running jobs are
        left alone, keeping their budgets (they may well be running fine); nothing new goes there."""
        was = {d.uuid: d.error for d in before}
        for d in after:
            if d.error and not was.get(d.uuid):
                jobs = [j.id for j in self.jobs_in(*ACTIVE) if d.uuid in j.gpus]
                log.error("GPU%d (%s): %s; no new job is placed on it until it answers again%s", d.index, d.uuid,
                          d.error, f"; its jobs {', '.join(map(str, jobs))} are left running" if jobs else "")
            elif not d.error and was.get(d.uuid):
                log.warning("GPU%d (%s) answers again: jobs may be placed on it", d.index, d.uuid)
                self.wake()

    def _usage_samples(self, running: list[Job]) -> list[tuple]:
        """Per running GPU job: memory from its ledger, SM and bandwidth from NVML's per-process
        samples. Also kept as `stats` (with the job's pids), which `top` and `ls` read."""
        if self.gpu_error or not running:
            self.stats = {}
            return []
        util: dict[int, tuple[int, int]] = {}
        per_gpu: dict[str, dict[int, tuple[int, int]]] = {}
        for dev in self.devices:
            if dev.error is None and any(dev.uuid in j.gpus for j in running):
                util.update(per_gpu.setdefault(dev.uuid, self.nvml.process_utilization(dev.index)))
        # MPS work that NVML gives the server's pid, apportioned to its jobs (learning.py says how)
        on_mps = {j.id: tuple(j.gpus) for j in running if j.mode == Mode.MPS}
        shares = mps_server_shares(per_gpu, self.mps.own_pids(), on_mps) if on_mps and self.mps else {}
        now, rows, stats = time.time(), [], {}
        kids: dict[int, list[int]] | None = None
        for j in running:
            if not j.gpus or not j.handle:
                continue
            u = self.usage(j)
            try:
                rt = self.runtime_for(j)
                if rt.name == "process" and not CGROUPS:
                    # one parent map for every process job: psutil's children() reads all of /proc
                    # once per call (8 running jobs: 64 ms of CPU a sample, most of an idle daemon's)
                    kids = _children_map() if kids is None else kids
                    pids = _tree(j.handle, kids)
                else:
                    pids = rt.pids(j.handle)
            except Exception:  # noqa: BLE001 - it may be ending right now
                pids = []
            extra = shares.get(j.id, (0.0, 0.0))
            sm = min((sum(util.get(p, (0, 0))[0] for p in pids) + extra[0]) / 100.0, 1.0)
            bw = min((sum(util.get(p, (0, 0))[1] for p in pids) + extra[1]) / 100.0, 1.0)
            rows.append((j.id, now, sm, u["used"] if u else None, bw))
            stats[j.id] = {"pids": pids, "sm_util": round(sm * 100), **(u or {})}
        self.stats = stats  # replaced whole: readers on the loop thread never see half of it
        return rows

    async def _mps_fault(self, uuid: str, clients: set[int]) -> None:
        """A FAULT server: its clients' jobs fail (or are requeued when they allow retries); the
        policy sees the GPU's MPS state as "fault" and places no MPS job there until it recovers."""
        for job in self.jobs_in(State.RUNNING):
            if job.mode != Mode.MPS or uuid not in job.gpus or not job.handle:
                continue
            rt = self.runtime_for(job)
            try:
                pids = set(await asyncio.to_thread(rt.pids, job.handle))
            except (Gone, Unavailable, EngineError) as e:  # gone: its follower records the end
                log.warning("job %d: its processes are unknown (%s)", job.id, e)
                pids = set()
            if clients and not pids & clients:
                continue
            live = self.live.setdefault(job.id, Live())
            if live.task:
                live.task.cancel()
            # A requeued attempt must not start before this one has ended: this one's stop acts on
            # the cgroup job-<ID>, where the new attempt's processes would be (and be killed).
            self._ending.add(job.id)
            if job.attempts <= job.spec.retries:
                self._requeue(job.id, f"{mps.FAULT_REASON}; requeued (attempt {job.attempts} of {job.spec.retries + 1})")
            else:
                self.transition(job.id, State.FAILED, mps.FAULT_REASON)
            asyncio.get_running_loop().create_task(self._kill_after_fault(job.id, rt, job.handle))
        self.wake()

    async def _kill_after_fault(self, job_id: int, rt, handle: str) -> None:
        try:
            try:
                await asyncio.to_thread(rt.stop, handle, self.config.stop_grace)
                await blocking(rt.wait, handle)  # reaped, so its exit file or container is final
            except (Gone, Unavailable):
                pass
            except EngineError as e:  # the removal below stops it all the same
                log.warning("job %d: stopping its faulted attempt: %s", job_id, e)
            try:
                await asyncio.to_thread(rt.cleanup, handle)
            except (Unavailable, EngineError) as e:  # removed by the sweep, or tried again soon
                log.warning("cleanup of job %d: %s", job_id, e)
                if isinstance(e, EngineError):
                    self._remove_later(job_id, handle)
            if self.store.get(job_id).state in TERMINAL:  # a requeued job gets a fresh ledger when it starts
                shutil.rmtree(self.run_dir(job_id), ignore_errors=True)
        finally:
            self._ending.discard(job_id)  # a requeued job may start again
            self.wake()

    def usage(self, job: Job) -> dict | None:
        """Live memory use from the job's ledger (exact, kept by the interposer)."""
        if not job.gpus or job.state not in ACTIVE:
            return None
        try:
            led = interposer.read_ledger(self.run_dir(job.id) / "ledger")
        except Exception:  # noqa: BLE001 - not created yet, or already gone
            return None
        return {"used": sum(led.used.values()), "refused": led.refused, "budget": led.budget}
