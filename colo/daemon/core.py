"""The daemon: its parts, composed, and the event loop that runs them (ARCHITECTURE.md).

Everything that changes a job's state happens on the event loop thread, through the job table;
blocking work (Docker, NVML, waiting for exits) runs in worker threads and reports back here.
Each part owns its state and says so in its docstring; they talk through the small interfaces
wired below, never through each other's fields:

  table      jobtable.JobTable   the open jobs and the one way a job changes state
  gpus       gpus.Gpus           NVML devices, memory outside budgets, MPS control daemons
  engines    engines.Engines     the runtimes (process, docker, slurm), the engine's presence
  learner    learner.Learner     profiles and what ends taught (policy.Learned per user)
  launcher   launcher.Launcher   starts, follows, cancels and stops jobs: the only part that acts
                                 on their processes
  scheduler  scheduler.Scheduler the queue, its passes (policy.plan) and the decisions
  patrol     patrol.Patrol       NVML per process against the budgets
  sampler    sampler.Sampler     each tick's readings (GPUs, usage, MPS health, the patrol's look)
  recovery   recovery.Recovery   finding jobs again (restart, the engine coming back)
  sessions   session.Watch       session jobs whose client it cannot see (after a restart)
  terminals  detach.Terminals    detached sessions' terminals and scrollback (colo attach); a host
                                 session's through a holder process of its own (outlives a restart)
  retention  retention.Retention removing ended jobs (colo clean, history_keep_days)
  metrics    metrics.Metrics     Prometheus figures, a snapshot of the others' state (opt-in)
  onend      onend.OnEnd         what a job asked to run as its owner when it ends (--on-end, mail)
  listing    listing.Listing     the rows `ls`, `top` and `gpus` send, and their caches
  admission  admission.Admission every check a job passes before it is stored
  suspender  suspend.Suspender   colo suspend/resume: GPU memory to host memory and back (colo-ckpt)
  drains     drain.Drains        colo drain/undrain: GPUs an admin took out of service (stored)

Every subscription (the table's on_change and on_edit, the learner's on_forget) is made in open().
"""
from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import logging
import os
import time

from ..config import Config
from ..jobs import ACTIVE, State
from ..node import gate, native
from ..node.cgroup import Cgroups
from ..sched import policy
from ..store import Store
from . import pin
from .admission import Admission
from .drain import Drains
from .engines import Engines, instance_id
from .external import SlurmRuntime
from .gpus import Gpus
from .jobtable import JobTable
from .launcher import Launcher
from .learner import Learner
from .listing import Listing
from .metrics import Metrics
from .onend import OnEnd
from .patrol import Patrol
from .recovery import Recovery
from .retention import Retention
from .sampler import Sampler
from .scheduler import Scheduler
from .detach import Terminals
from .session import Watch, renew
from .suspend import Suspender

log = logging.getLogger("colo")


class AlreadyRunning(RuntimeError):
    pass


class Daemon:
    def __init__(self, config: Config):
        self.config = config
        self.stopping = False
        self._lock_fd: int | None = None
        self.store: Store | None = None
        self.cgroups: Cgroups | None = None

    def open(self) -> None:
        """Take the state dir (one daemon each), open the store and build the parts."""
        c = self.config
        c.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(c.state_dir, 0o711)  # process jobs reach their own run dir; nothing is listable
        self._lock_fd = os.open(c.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            raise AlreadyRunning(f"another colo daemon (pid {pid}) is using {c.state_dir}")
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
        for d in (c.jobs_dir, c.state_dir / "logs", c.state_dir / "profiles", c.state_dir / "holders"):
            d.mkdir(exist_ok=True)
            os.chmod(d, 0o711 if d == c.jobs_dir else 0o700)
        pin.sweep(c.state_dir / "mounts")  # staging left by a start cut short
        self.store = Store(c.db_path)
        self.table = JobTable(self.store)
        self.native = native_dir = native.publish(c.state_dir)  # what jobs load (interposer, shim)
        instance = instance_id(c.state_dir)
        self.cgroups = Cgroups.setup(instance)
        for what, why in self.cgroups.missing.items():
            log.warning("%s: %s", {"contain": "process jobs run without a cgroup of their own",
                                   "cpu": "--cpus is refused", "memory": "--mem is refused",
                                   "pids": "jobs' tasks are not bounded (--tasks, job_tasks)",
                                   "devices": "jobs are not held to their own GPUs' device files"}[what], why)
        self.gpus = Gpus(c, native_dir)
        self.engines = Engines(c, instance, native_dir, self.cgroups)
        gate_spared = None
        if self.engines.gpu_gid is not None:  # a gated node: shut to every cgroup but colo's jobs'
            ok, what = gate.setup(self.cgroups, self.engines.gpu_nodes, c.gpu_gate_at, c.gpu_gate_allow)
            (log.info if ok else log.error)("gate: %s", what)
            if ok:  # the users' MPS servers open the GPUs too: they start beneath the folder it allows
                self.gpus.mps.cgroup = gate.mps_folder(self.cgroups)
                if self.gpus.mps.cgroup is not None:  # (else MPS servers hold the files outside it)
                    gate_spared = gate.spared(self.cgroups, c.gpu_gate_allow)
        mps_here = self.gpus.open()  # always: the devices are read here, before the first request
        self.cfg_policy = dataclasses.replace(policy.config_of(c), use_mps=c.use_mps and mps_here)
        self.learner = Learner(c, self.table, self.gpus, self.cfg_policy)
        self.learner.load()
        # the launcher and the scheduler call each other: through `wake` and `start`, wired here
        self.launcher = Launcher(c, self.table, self.engines, self.gpus, native_dir, self.learner,
                                 wake=lambda full=True: self.scheduler.wake(full),
                                 renew=lambda job: renew(self.terminals, job))
        self.scheduler = Scheduler(c, self.cfg_policy, self.table, self.gpus, self.engines, self.learner,
                                   start=self.launcher.start, start_wait=self.launcher.start_wait)
        self.engines.add("slurm", SlurmRuntime(c, self.table))  # jobs Slurm started here (external.py)
        self.patrol = Patrol(c, self.table, self.gpus, self.engines, stop=self.launcher.stop_for_patrol,
                             gate_spared=gate_spared)
        self.drains = Drains(c, self.store, self.table, self.gpus, self.launcher, self.scheduler.wake,
                             suspend=lambda job, by: self.suspender.suspend(job, by))  # --now (built below)
        self.drains.load()  # before the first pass and scrape: nothing is placed on a GPU drained before the restart
        self.sampler = Sampler(c, self.table, self.gpus, self.engines, self.launcher, self.patrol,
                               wake=self.scheduler.wake, faulted=self.drains.faults)
        self.recovery = Recovery(c, self.table, self.engines, self.gpus, self.launcher, self.cgroups,
                                 wake=self.scheduler.wake)
        self.terminals = Terminals(c.detach_scrollback, c.detach_read_rate,
                                   holders=c.state_dir / "holders", cancel=self.launcher.cancel)
        self.sessions = Watch(self.table, self.engines, cancel=self.launcher.cancel, terminals=self.terminals)
        self.retention = Retention(c, self.table, self.launcher, wake=self.scheduler.wake)
        self.suspender = Suspender(c, self.table, self.gpus, native_dir, self.engines.runtime_for,
                                   lambda: self.sampler.stats, self.scheduler.placed, self.scheduler.wake,
                                   lambda: self.scheduler.decisions, self.sampler.usage)
        self.metrics = Metrics(c, self.table, self.gpus, self.sampler, self.patrol,
                               self.suspender.figures) if c.metrics_listen else None
        if self.metrics is not None:
            self.metrics.update()  # a scrape before the first tick has figures
            self.metrics.serve()
        nodes = self.engines.gpu_nodes
        self.onend = OnEnd(c, native_dir, self.cgroups, (lambda: nodes.deny_rules([])) if nodes is not None else None)
        self.listing = Listing(c, self.table, self.store, self.scheduler, self.gpus, self.patrol, self.sampler,
                               self.suspender, self.terminals.note)
        self.admission = Admission(c, self.store, self.gpus, self.engines, self.scheduler, native_dir,
                                   self.table.detached_count)
        # who hears of what, in this order: the table's watchers run after each change
        self.table.on_change.extend([self.launcher.job_changed, self.scheduler.queue_changed,
                                     *([self.metrics.job_changed] if self.metrics is not None else []),
                                     self.onend.job_changed, self.listing.queue_changed,
                                     self.terminals.job_changed])
        self.table.on_edit.extend([self.scheduler.queue_edited, self.listing.queue_changed])
        self.learner.on_forget.append(self.scheduler.profiles_forgotten)

    def stop(self) -> None:
        """Stop serving (op `shutdown`, a signal): the scheduler's loop ends, the jobs run on."""
        self.stopping = True
        self.wake()

    def wake(self) -> None:
        """Run the scheduler soon (a signal, a request that changed what it may start)."""
        self.scheduler.wake()

    async def run(self) -> None:
        await self.recovery.recover()
        # detached host sessions' terminal holders (detach.py), once recovery knows which jobs run on
        await self.terminals.recover({j.id: j.uid for j in self.table.jobs_in(*ACTIVE, State.QUEUED)})
        await self.suspender.recover()  # no job left locked by a suspend or resume cut short
        ticker = asyncio.create_task(self._tick())
        purge = asyncio.create_task(self.retention.purge())  # history_keep_days
        try:
            await self.scheduler.serve(lambda: self.stopping)
        finally:
            ticker.cancel()
            purge.cancel()
            self.launcher.stop_following()  # the jobs run on and are found again at the next start

    async def _tick(self) -> None:
        while not self.stopping:
            try:
                await self.recovery.watch_docker()
                await self.sampler.sample()
                await self.sessions.sweep()  # sessions whose client went away while colo restarted
                await self.suspender.resume_waiting()
                await self.suspender.reclaim()  # idle_jobs / idle_sessions / preempt = "suspend"
                if self.learner.tick(self.table.jobs_in(State.RUNNING), time.time()):
                    self.scheduler.wake()  # a provisional profile: its family may be placed beside it
                if self.metrics is not None:
                    self.metrics.update()
            except Exception as e:  # noqa: BLE001 - a bad sample must not stop the daemon
                log.warning("sampling failed: %s", e)
            await asyncio.sleep(self.config.sample_interval)

    def close(self) -> None:
        pin.sweep(self.config.state_dir / "mounts")  # a start cut short by the stop needs none
        for name in ("metrics", "engines", "gpus", "scheduler"):  # those open() got to build
            if (part := getattr(self, name, None)) is not None:
                part.close()
        if self.cgroups is not None:
            self.cgroups.close()
        if self.store is not None:
            self.store.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
