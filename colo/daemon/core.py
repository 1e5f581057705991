"""The daemon's state, its job table and its one scheduler loop.

Everything that changes a job's state happens on the event loop thread, through the store;
blocking work (Docker, NVML, waiting for exits) runs in worker threads and reports back here.
The daemon's work is split by what it does, one module each, combined here:
scheduler.py (the pass), lifecycle.py (launch, follow, cancel), recovery.py (finding jobs
again), sampling.py (NVML, usage, MPS health), learning.py (profiles), retention.py (removing
ended jobs).
"""
from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import json
import logging
import os
from pathlib import Path

from ..node import mps, native
from ..sched import policy
from ..node.cgroup import Cgroups
from ..config import Config
from ..node.gpu import GpuInfo, NoDriver, Nvml
from ..jobs import ACTIVE, TERMINAL, Job, Mode, State
from ..runtimes.base import StartError
from ..runtimes.process import ProcessRuntime
from ..store import Store
from . import pin
from .external import SlurmRuntime
from .learning import LearningMixin
from .patrol import PatrolMixin
from .lifecycle import LifecycleMixin, Live, blocking  # noqa: F401 - blocking: re-exported
from .recovery import RecoveryMixin
from .retention import RetentionMixin
from .sampling import SamplingMixin
from .scheduler import DecisionWriter, SchedulerMixin

log = logging.getLogger("colo")


class AlreadyRunning(RuntimeError):
    pass


class Changes:
    """Wakes whoever waits for any job to change (`wait`, `logs -f`). It holds no lock: an
    asyncio.Condition waited on with a timeout, by a thousand clients some of whom hung up, was
    left locked for good (Python 3.11), and every later wait and follow hung with it."""

    def __init__(self) -> None:
        self._now = asyncio.Event()

    def notify_all(self) -> None:
        now, self._now = self._now, asyncio.Event()
        now.set()

    async def wait(self, timeout: float) -> None:
        """Until the next change, or `timeout` seconds."""
        try:
            await asyncio.wait_for(self._now.wait(), timeout)
        except asyncio.TimeoutError:
            pass


class Daemon(SchedulerMixin, LifecycleMixin, RecoveryMixin, SamplingMixin, PatrolMixin, LearningMixin,
             RetentionMixin):
    def __init__(self, config: Config):
        self.config = config
        self.cfg_policy = policy.PolicyConfig(reserve=config.reserve, saturation=config.saturation,
                                              bw_saturation=config.bw_saturation, min_gain=config.min_gain,
                                              hold_after=config.hold_after, slowdown_bound=config.slowdown_bound,
                                              unprofiled_share=config.unprofiled_share,
                                              multi_user_mps=config.multi_user_mps, use_mps=config.use_mps,
                                              lend=config.lend)
        self._lock_fd: int | None = None
        self.store: Store | None = None
        self.nvml = Nvml(config.fakegpu_state)
        self.gpu_error: str | None = None
        self.devices: list[GpuInfo] = []
        self.runtimes: dict = {}
        self.native = native.native_dir()
        self.docker_error: str | None = None
        self._docker_retry_at = 0.0
        self.live: dict[int, Live] = {}
        self.wake_event: asyncio.Event | None = None
        self.changed: Changes | None = None
        self.stopping = False
        self.open_jobs: dict[int, Job] = {}  # queued and active jobs: the store's rows, mirrored
        self.decisions: dict[int, policy.Decision] = {}  # the latest decision per open job
        self._cands: dict[int, policy.Candidate] = {}
        self.stats: dict[int, dict] = {}  # running jobs' last sample: pids, sm_util, used, refused
        self._writer: DecisionWriter | None = None
        self.mps: mps.MpsManager | None = None
        self.cgroups: Cgroups | None = None
        self._init_profiles()  # per-user learned, shared, configured, shipped (learning.py)
        self._init_scheduler()
        self._init_patrol()
        self._init_recovery()
        # what ends of jobs taught, per user: one user's runs never change how another's are placed
        self.learned: dict[int, policy.Learned] = {}  # stored too: load_learned() at open

    # start-up ---------------------------------------------------------------------------------
    def open(self) -> None:
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
        for d in (c.jobs_dir, c.state_dir / "logs", c.state_dir / "profiles"):
            d.mkdir(exist_ok=True)
            os.chmod(d, 0o711 if d == c.jobs_dir else 0o700)
        pin.sweep(c.state_dir / "mounts")  # staging left by a start cut short
        self.store = Store(c.db_path)
        self.load_learned()
        self.open_jobs = {j.id: j for j in self.store.jobs([State.QUEUED, *ACTIVE])}
        self._writer = DecisionWriter(c.db_path)
        self.native = native.publish(c.state_dir)
        self.cgroups = Cgroups.setup(self.instance_id())
        for what, why in self.cgroups.missing.items():
            log.warning("%s: %s", {"contain": "process jobs run without a cgroup of their own",
                                   "cpu": "--cpus is refused", "memory": "--mem is refused"}[what], why)
        self.runtimes["process"] = ProcessRuntime(shim=self.native / "colo-shim", cgroups=self.cgroups,
                                                  log_cap=c.log_cap, reserve=c.log_reserve)
        self.runtimes["slurm"] = SlurmRuntime(self)  # jobs Slurm started here (external.py)
        try:
            self.devices = self.nvml.devices()
        except NoDriver as e:
            self.gpu_error = str(e)
            log.warning("%s", e)
        self._init_docker()
        self._init_mps()
        self._check_compute_modes()
        self._load_counts()

    def _init_docker(self) -> None:
        try:
            from ..runtimes.docker import DockerRuntime

            rt = DockerRuntime.from_env(instance=self.instance_id())
            rt.client.ping()
            rt.log_cap, rt.log_reserve = self.config.log_cap, self.config.log_reserve
            self.runtimes["docker"] = rt
        except Exception as e:  # noqa: BLE001 - any failure: container jobs are refused with this reason
            first = self.docker_error is None
            self.docker_error = f"Docker engine not reachable ({e.__class__.__name__}: {str(e)[:120]})"
            if first:
                log.warning("%s; container jobs are refused until it answers", self.docker_error)

    def _check_compute_modes(self) -> None:
        """Invariant 4: mixing MPS and time-sliced jobs needs DEFAULT mode; say so, or set it."""
        available = self.mps.available()
        if not available:
            self.cfg_policy = dataclasses.replace(self.cfg_policy, use_mps=False)
        changed = False
        for dev in self.devices:
            def set_default(i=dev.index) -> None:
                self.nvml.set_compute_mode(i, "default")

            _, msg = mps.ensure_default_mode(dev.compute_mode, self.config.set_default_compute_mode, set_default,
                                             available, f"GPU{dev.index}")
            if msg:
                log.warning("%s", msg)
                changed = True
        if changed:
            self.devices = self.nvml.devices()

    def instance_id(self) -> str:
        """This daemon's name on shared engines (Docker labels), kept in its state dir."""
        import uuid

        path = self.config.state_dir / "instance"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            ident = uuid.uuid4().hex[:16]
            path.write_text(ident + "\n")
            return ident

    def _init_mps(self) -> None:
        control = (self.native / native.FAKEGPU_DIR / "nvidia-cuda-mps-control"
                   if self.config.fakegpu_state else "nvidia-cuda-mps-control")
        env = self.fake_env() if self.config.fakegpu_state else {}
        self.mps = mps.MpsManager(self.config.state_dir / "mps", control, env,
                                  multi_user=self.config.multi_user_mps, idle_stop_s=self.config.mps_idle_stop)

    def mps_users(self) -> dict[str, set[int]]:
        """GPU uuid -> the uids of its starting and running MPS jobs: with root, the only ones that
        may reach its MPS control daemon (docs/mps.md "Who may reach the daemon")."""
        users: dict[str, set[int]] = {}
        open_jobs = self.open_jobs
        # ids copied in one step: build_launch asks from a worker thread while the loop changes them
        for i in list(self._active if self._queued_n is not None else open_jobs):
            j = open_jobs.get(i)
            if j is not None and j.state in ACTIVE and j.mode == Mode.MPS and j.gpus:
                users.setdefault(j.gpus[0], set()).add(j.uid)
        return users

    def revoke_mps_access(self) -> None:
        """After a job ended and was reaped: uids left without MPS jobs on a GPU lose access."""
        if self.mps is None or not self.mps.available():
            return
        users = self.mps_users()
        for dev in self.devices:
            try:
                self.mps.keep_only(dev.uuid, users.get(dev.uuid, set()))
            except mps.MpsError as e:
                log.error("%s", e)

    def fake_env(self) -> dict[str, str]:
        lib = self.native / native.FAKEGPU_DIR
        return {"COLO_FAKEGPU_STATE": str(self.config.fakegpu_state), "LD_LIBRARY_PATH": str(lib)}

    def close(self) -> None:
        pin.sweep(self.config.state_dir / "mounts")  # a start cut short by the stop needs none
        if "docker" in self.runtimes:
            self.runtimes["docker"].close()
        if self.cgroups is not None:
            self.cgroups.close()
        if self.mps is not None:
            self.mps.stop_unused()  # MPS servers of running jobs stay up and are adopted at restart
        if self._writer is not None:
            self._writer.close()
        if self.store is not None:
            self.store.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # helpers ----------------------------------------------------------------------------------
    def gpu_views(self, in_use: bool = False) -> list[policy.GpuView]:
        """in_use: less the memory the patrol saw held outside any budget (what plan() may give)."""
        states = self.mps.states() if self.mps else {}
        less = self.unbudgeted if in_use else {}
        return [policy.GpuView(uuid=d.uuid, index=d.index,
                               usable=max(0, d.total - self.config.reserve - less.get(d.uuid, 0)),
                               compute_mode=d.compute_mode, mps=states.get(d.uuid, "off"), name=d.name, error=d.error)
                for d in self.devices]

    def run_dir(self, job_id: int) -> Path:
        return self.config.jobs_dir / str(job_id)

    def log_path(self, job_id: int) -> Path:
        return self.config.state_dir / "logs" / f"{job_id}.log"

    def runtime_for(self, job: Job):
        rt = self.runtimes.get(job.spec.runtime)
        if rt is None:
            raise StartError(self.docker_error or f"no {job.spec.runtime} runtime")
        return rt

    def docker_away(self) -> str | None:
        """Why container jobs cannot start now (no engine at start-up, or it went away), or None."""
        rt = self.runtimes.get("docker")
        return self.docker_error if rt is None else rt.down

    def wake(self, full: bool = True) -> None:
        """Run the scheduler soon; full=False: only new jobs need planning."""
        if full:
            self._full = True
        if self.wake_event is not None:
            self.wake_event.set()

    async def notify(self) -> None:
        self.changed.notify_all()

    def add_job(self, spec, uid: int, gid: int, user: str, reason: str | None = None) -> Job:
        job = self.store.add_job(spec, uid, gid, user, reason=reason)
        self.open_jobs[job.id] = job
        self._queue_changed(None, job)
        self.wake(full=False)
        return job

    def add_array(self, spec, indices: list[int], limit: int | None, uid: int, gid: int, user: str) -> list[Job]:
        """The tasks of `colo submit --array`, stored at once (store.add_array)."""
        jobs = self.store.add_array(spec, indices, limit, uid, gid, user)
        for job in jobs:
            self.open_jobs[job.id] = job
            self._queue_changed(None, job)
        self.wake(full=False)
        return jobs

    def change_queued(self, job_id: int, reason: str, **changes) -> Job:
        """A queued job's spec or hold changed (colo edit/hold/release): stored, mirrored, re-filed."""
        prev = self.open_jobs[job_id]
        job = self.store.change_queued(job_id, reason, **changes)
        self.open_jobs[job_id] = job
        self._queue_edited(prev, job)
        log.info("job %d: %s", job_id, reason)
        self.wake()
        asyncio.get_running_loop().create_task(self.notify())
        return job

    def transition(self, job_id: int, new: State, reason: str, **fields) -> Job:
        """The one way a job changes state: checked and stored by the store, mirrored here."""
        prev = self.open_jobs.get(job_id)
        if new == State.QUEUED and "spec" not in fields and prev is not None and prev.spec.asked_mem is not None:
            # back in the queue it asks for what its submitter asked: a lend is for one start only
            fields["spec"] = json.dumps(prev.spec.as_asked().to_dict())
        job = self.store.transition(job_id, new, reason, **fields)
        self._queue_changed(prev, job)
        self._cands.pop(job_id, None)
        if job.state in TERMINAL:
            self.open_jobs.pop(job_id, None)
            self.decisions.pop(job_id, None)
            self._start_retry.pop(job_id, None)  # e.g. cancelled while it waited to start again
        else:
            self.open_jobs[job_id] = job
        log.info("job %d -> %s: %s", job_id, new, reason)
        asyncio.get_running_loop().create_task(self.notify())
        return job

    def set_fields(self, job_id: int, **fields) -> Job:
        self.store.set_fields(job_id, **fields)
        job = self.store.get(job_id)
        if job_id in self.open_jobs:
            self.open_jobs[job_id] = job
        return job

    def job(self, job_id: int) -> Job:
        return self.open_jobs.get(job_id) or self.store.get(job_id)

    def jobs_in(self, *states: State) -> list[Job]:
        if ACTIVE.issuperset(states) and self._queued_n is not None:
            return self.active_jobs(*states)  # a few, kept apart from the queue (10,000 long)
        return [j for j in self.open_jobs.values() if j.state in states]

    def explain(self, job_id: int) -> dict | None:
        d = self.decisions.get(job_id)
        if d is None:
            return self.store.decision(job_id)
        reason = d.reason
        job = self.open_jobs.get(job_id)
        if d.action == policy.WAIT and job is not None and (note := self.fair_note(job)):
            reason = f"{reason}; {note}"
        return {"action": d.action, "mode": d.mode, "gpus": list(d.gpus), "reason": reason, "details": d.details}

    async def run(self) -> None:
        self.wake_event = asyncio.Event()
        self.changed = Changes()
        await self.recover()
        ticker = asyncio.create_task(self._tick())
        purge = asyncio.create_task(self._purge())  # history_keep_days (retention.py)
        try:
            while not self.stopping:
                self.schedule_pass()
                try:
                    await asyncio.wait_for(self.wake_event.wait(), timeout=self.pass_due_in())
                except asyncio.TimeoutError:
                    pass
                self.wake_event.clear()
                await asyncio.sleep(0.005)  # a burst of submits lands in one pass
        finally:
            ticker.cancel()
            purge.cancel()
