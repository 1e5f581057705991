"""The daemon's state and its one scheduler loop.

Everything that changes a job's state happens on the event loop thread, through the store;
blocking work (Docker, NVML, waiting for exits) runs in worker threads and reports back here.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import interposer, mps, native, policy, profiles
from ..config import Config
from ..gpu import GpuInfo, NoDriver, Nvml
from ..jobs import ACTIVE, TERMINAL, Job, Mode, State
from ..runtimes.base import Gone, Launch, StartError
from ..runtimes.process import ProcessRuntime
from ..store import Store
from .launchspec import build_launch

log = logging.getLogger("colo")


class AlreadyRunning(RuntimeError):
    pass


@dataclass
class Live:
    """What the daemon knows about an active job beyond the store."""
    task: asyncio.Task | None = None
    cancelled_by: str | None = None
    stopping: bool = False
    mps_uuid: str | None = None
    samples: list = field(default_factory=list)


class Daemon:
    def __init__(self, config: Config):
        self.config = config
        self.cfg_policy = policy.PolicyConfig(reserve=config.reserve, saturation=config.saturation,
                                              multi_user_mps=config.multi_user_mps, use_mps=config.use_mps)
        self._lock_fd: int | None = None
        self.store: Store | None = None
        self.nvml = Nvml(config.fakegpu_state)
        self.gpu_error: str | None = None
        self.devices: list[GpuInfo] = []
        self.runtimes: dict = {}
        self.native = native.native_dir()
        self.docker_error: str | None = None
        self.live: dict[int, Live] = {}
        self.wake_event: asyncio.Event | None = None
        self.changed: asyncio.Condition | None = None
        self.stopping = False
        self._decision_cache: dict[int, str] = {}
        self.mps: mps.MpsManager | None = None
        self.started_at = time.time()
        self.pass_count = 0
        self.profiles = profiles.ProfileStore(
            [*config.profile_dirs, config.state_dir / "profiles", profiles.shipped_dir()])
        self._profile_cache: dict[str, tuple[float, profiles.Profile | None]] = {}

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
        self.store = Store(c.db_path)
        self.native = native.publish(c.state_dir)
        self.runtimes["process"] = ProcessRuntime(shim=self.native / "colo-shim")
        try:
            self.devices = self.nvml.devices()
        except NoDriver as e:
            self.gpu_error = str(e)
            log.warning("%s", e)
        self._init_docker()
        self._init_mps()

    def _init_docker(self) -> None:
        try:
            from ..runtimes.docker import DockerRuntime

            rt = DockerRuntime.from_env()
            rt.client.ping()
            self.runtimes["docker"] = rt
        except Exception as e:  # noqa: BLE001 - any failure: container jobs are refused with this reason
            self.docker_error = f"Docker engine not reachable ({e.__class__.__name__}: {str(e)[:120]})"
            log.warning("%s; container jobs will be refused", self.docker_error)

    def _init_mps(self) -> None:
        control = (self.native / native.FAKEGPU_DIR / "nvidia-cuda-mps-control"
                   if self.config.fakegpu_state else "nvidia-cuda-mps-control")
        env = self.fake_env() if self.config.fakegpu_state else {}
        self.mps = mps.MpsManager(self.config.state_dir / "mps", control, env,
                                  multi_user=self.config.multi_user_mps, idle_stop_s=self.config.mps_idle_stop)

    def fake_env(self) -> dict[str, str]:
        lib = self.native / native.FAKEGPU_DIR
        return {"COLO_FAKEGPU_STATE": str(self.config.fakegpu_state), "LD_LIBRARY_PATH": str(lib)}

    def close(self) -> None:
        if "docker" in self.runtimes:
            self.runtimes["docker"].close()
        if self.mps is not None:
            self.mps.stop_all()
        if self.store is not None:
            self.store.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # helpers ----------------------------------------------------------------------------------
    def gpu_views(self) -> list[policy.GpuView]:
        states = self.mps.states() if self.mps else {}
        return [policy.GpuView(uuid=d.uuid, index=d.index, usable=max(0, d.total - self.config.reserve),
                               compute_mode=d.compute_mode, mps=states.get(d.uuid, "off"), name=d.name)
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

    def wake(self) -> None:
        if self.wake_event is not None:
            self.wake_event.set()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def transition(self, job_id: int, new: State, reason: str, **fields) -> Job:
        job = self.store.transition(job_id, new, reason, **fields)
        log.info("job %d -> %s: %s", job_id, new, reason)
        asyncio.get_running_loop().create_task(self.notify())
        return job

    # the scheduler ----------------------------------------------------------------------------
    async def run(self) -> None:
        self.wake_event = asyncio.Event()
        self.changed = asyncio.Condition()
        await self.recover()
        ticker = asyncio.create_task(self._tick())
        try:
            while not self.stopping:
                self.schedule_pass()
                try:
                    await asyncio.wait_for(self.wake_event.wait(), timeout=5.0)
                except asyncio.TimeoutError:
                    pass
                self.wake_event.clear()
        finally:
            ticker.cancel()

    def schedule_pass(self) -> list[policy.Decision]:
        """Reap nothing here (monitors do), check dependencies, plan, start."""
        self.pass_count += 1
        queued = self.store.jobs([State.QUEUED])
        if not queued:
            return []
        candidates, waits = self._eligible(queued)
        active = self.store.jobs(ACTIVE)
        now = time.time()
        placed = [policy.Placed(j.id, tuple(j.gpus), j.spec.gpu_mem, j.uid, str(j.mode or "timesliced"),
                                self.profile_of(j), now - (j.started_at or now)) for j in active if j.gpus]
        decisions = policy.plan(candidates, self.gpu_views(), placed, self.cfg_policy)
        self._record([*waits, *decisions])
        for d in decisions:
            if d.action == policy.START:
                self.start_job(d)
        return decisions

    def _eligible(self, queued: list[Job]) -> tuple[list[policy.Candidate], list[policy.Decision]]:
        cands, waits = [], []
        deps = {a for j in queued for a in j.spec.after}
        dep_state = {}
        for a in deps:
            try:
                dep_state[a] = self.store.get(a).state
            except KeyError:
                dep_state[a] = None
        for j in queued:
            failed = [a for a in j.spec.after if dep_state[a] in (State.FAILED, State.CANCELLED, State.LOST, None)]
            if failed:
                self.transition(j.id, State.FAILED, f"dependency failed: job {failed[0]} "
                                f"{dep_state[failed[0]] or 'does not exist'}")
                continue
            pending = [a for a in j.spec.after if dep_state[a] != State.SUCCEEDED]
            if pending:
                waits.append(policy.Decision(j.id, policy.WAIT, reason=f"waiting for job {pending[0]} to succeed"))
                continue
            if j.spec.gpus and self.gpu_error:
                waits.append(policy.Decision(j.id, policy.WAIT, reason=self.gpu_error))
                continue
            cands.append(policy.Candidate(j.id, j.spec.gpu_mem, j.spec.gpus, j.uid, j.spec.priority, j.id,
                                          self.profile_of(j) if j.spec.gpus else None))
        return cands, waits

    def _record(self, decisions: list[policy.Decision]) -> None:
        changed = [d for d in decisions if self._decision_cache.get(d.job_id) != d.reason]
        if changed:
            self.store.record_decisions((d.job_id, d.action, d.mode, list(d.gpus), d.reason, d.details)
                                        for d in changed)
            for d in changed:
                self._decision_cache[d.job_id] = d.reason

    def profile_name(self, job: Job) -> str:
        return job.spec.profile or profiles.key_for(job.spec.image, job.spec.argv)

    def profile_of(self, job: Job) -> "profiles.Profile | None":
        """The stored profile a job runs under; looked up at most every 10 s per name."""
        name = self.profile_name(job)
        hit = self._profile_cache.get(name)
        now = time.monotonic()
        if hit is None or now - hit[0] > 10:
            try:
                prof = self.profiles.get(name)
            except profiles.ProfileError as e:
                log.warning("profile %s unreadable: %s", name, e)
                prof = None
            hit = self._profile_cache[name] = (now, prof)
        return hit[1]

    def learn(self, job: Job) -> None:
        """A job that ran to its end teaches the profile it ran under (invariant: samples, not guesses)."""
        rows = self.store.samples(job.id)
        if len(rows) < 2 or not job.gpus:
            return
        t0 = rows[0][0]
        samples = {"times": [r[0] - t0 for r in rows], "sm": [r[1] or 0.0 for r in rows],
                   "mem": [r[2] or 0 for r in rows], "membw": [r[3] or 0.0 for r in rows]}
        gpu = next((d.name for d in self.devices if d.uuid == job.gpus[0]), "")
        runtime = (job.ended_at or time.time()) - (job.started_at or t0)
        try:
            self.profiles.learn(self.profile_name(job), samples, runtime=runtime, gpu=gpu)
            self._profile_cache.pop(self.profile_name(job), None)
        except (profiles.ProfileError, OSError) as e:
            log.warning("could not learn profile for job %d: %s", job.id, e)

    # launching and monitoring -----------------------------------------------------------------
    def start_job(self, d: policy.Decision) -> None:
        mode = Mode(d.mode) if d.mode else Mode.TIMESLICED
        job = self.transition(d.job_id, State.STARTING, d.reason, gpus=list(d.gpus), mode=mode,
                              attempts=self.store.get(d.job_id).attempts + 1)
        live = self.live.setdefault(job.id, Live())
        live.task = asyncio.get_running_loop().create_task(self._launch_and_follow(job, d))

    async def _launch_and_follow(self, job: Job, d: policy.Decision) -> None:
        try:
            rt = self.runtime_for(job)
            launch = await asyncio.to_thread(build_launch, self, job, d)
            handle = await asyncio.to_thread(rt.start, launch)
        except (StartError, interposer.LedgerError if hasattr(interposer, "LedgerError") else StartError,
                mps.MpsError, OSError) as e:
            self.transition(job.id, State.FAILED, f"failed to start: {e}")
            self._finish(job.id)
            return
        self.store.set_fields(job.id, handle=handle)
        live = self.live[job.id]
        if live.cancelled_by:
            self.transition(job.id, State.RUNNING, "started")
            await self._stop(job.id, handle)
        else:
            self.transition(job.id, State.RUNNING, f"started ({job.spec.runtime})")
        await self.follow(job.id, handle)

    async def follow(self, job_id: int, handle: str) -> None:
        job = self.store.get(job_id)
        rt = self.runtime_for(job)
        try:
            code = await asyncio.to_thread(rt.wait, handle)
        except Gone as e:
            self.transition(job_id, State.LOST, f"lost: {e}")
            self._finish(job_id, rt, handle)
            return
        except asyncio.CancelledError:
            return  # the daemon is stopping; the job runs on and is found again at restart
        job = self.record_exit(job_id, code)
        if job.state == State.SUCCEEDED:
            self.learn(job)
        self._finish(job_id, rt, handle)

    def record_exit(self, job_id: int, code: int) -> Job:
        live = self.live.get(job_id)
        refused = self._refused(job_id)
        note = f"; {refused} allocation(s) refused by its {interposer_budget_text(self.store.get(job_id))}" \
            if refused else ""
        if live and live.cancelled_by:
            return self.transition(job_id, State.CANCELLED, f"cancelled by {live.cancelled_by}", exit_code=code)
        if code == 0:
            return self.transition(job_id, State.SUCCEEDED, f"exited with code 0{note}", exit_code=0)
        return self.transition(job_id, State.FAILED, f"exited with code {code}{note}", exit_code=code)

    def _refused(self, job_id: int) -> int:
        try:
            return interposer.read_ledger(self.run_dir(job_id) / "ledger").refused
        except Exception:  # noqa: BLE001 - no ledger (CPU job) or unreadable: nothing to add
            return 0

    def _finish(self, job_id: int, rt=None, handle: str | None = None) -> None:
        self.live.pop(job_id, None)
        if rt is not None and handle:
            try:
                rt.cleanup(handle)
            except Exception as e:  # noqa: BLE001
                log.warning("cleanup of job %d: %s", job_id, e)
        shutil.rmtree(self.run_dir(job_id), ignore_errors=True)  # the ledger goes with the job
        self.wake()

    async def cancel(self, job_id: int, by: str) -> Job:
        job = self.store.get(job_id)
        if job.state in TERMINAL:
            return job
        if job.state == State.QUEUED:
            return self.transition(job_id, State.CANCELLED, f"cancelled by {by} before it started")
        live = self.live.setdefault(job_id, Live())
        live.cancelled_by = by
        if job.handle and not live.stopping:
            await self._stop(job_id, job.handle)
        return self.store.get(job_id)

    async def _stop(self, job_id: int, handle: str) -> None:
        live = self.live.setdefault(job_id, Live())
        live.stopping = True
        job = self.store.get(job_id)
        rt = self.runtime_for(job)

        def stop() -> None:
            rt.stop(handle, self.config.stop_grace)

        if job.mode == Mode.MPS and self.mps is not None and job.gpus:
            pids = await asyncio.to_thread(rt.pids, handle)
            # invariant 6: terminate_client for every client pid before any signal
            await asyncio.to_thread(self.mps.terminate_then, job.gpus[0], pids, stop)
        else:
            await asyncio.to_thread(stop)

    # recovery ---------------------------------------------------------------------------------
    async def recover(self) -> None:
        """Find every active job again: running on, finished while we were away, or lost."""
        found: dict[int, str] = {}
        if "docker" in self.runtimes:
            found = await asyncio.to_thread(self.runtimes["docker"].adopt)
        for job in self.store.jobs(ACTIVE):
            try:
                rt = self.runtime_for(job)
            except StartError as e:
                self.transition(job.id, State.LOST, f"lost: cannot follow it after a restart ({e})")
                continue
            handle = job.handle or found.get(job.id)
            if handle is None:
                if job.state == State.STARTING:
                    self.transition(job.id, State.QUEUED, "requeued: its start was cut short by a daemon restart")
                else:
                    self.transition(job.id, State.LOST, "lost: it vanished while colo was down")
                continue
            if hasattr(rt, "remember"):
                rt.remember(handle, self.run_dir(job.id))
            try:
                code = await asyncio.to_thread(rt.poll, handle)
            except Gone as e:
                self.transition(job.id, State.LOST, f"lost while colo was down: {e}")
                self._finish(job.id, rt, handle)
                continue
            if job.state == State.STARTING:
                self.store.set_fields(job.id, handle=handle)
                self.transition(job.id, State.RUNNING, "found again after a daemon restart")
            if code is not None:
                self.record_exit(job.id, code)
                self._finish(job.id, rt, handle)
                continue
            if hasattr(rt, "follow_logs"):
                rt.follow_logs(handle, self.log_path(job.id))
            live = self.live.setdefault(job.id, Live())
            live.task = asyncio.get_running_loop().create_task(self.follow(job.id, handle))
            log.info("job %d found again after restart (%s)", job.id, handle)
        known = {j.id for j in self.store.jobs(ACTIVE)}
        for job_id, handle in found.items():
            if job_id not in known:  # ended and recorded before, or not ours any more: tidy up
                await asyncio.to_thread(self.runtimes["docker"].cleanup, handle)

    # periodic work ----------------------------------------------------------------------------
    async def _tick(self) -> None:
        while not self.stopping:
            try:
                await self.sample()
            except Exception as e:  # noqa: BLE001 - a bad sample must not stop the daemon
                log.warning("sampling failed: %s", e)
            await asyncio.sleep(self.config.sample_interval)

    async def sample(self) -> None:
        if self.gpu_error is None:
            try:
                self.devices = await asyncio.to_thread(self.nvml.devices)
            except NoDriver as e:
                self.gpu_error = str(e)
        if self.mps is not None:
            for uuid, event, clients in await asyncio.to_thread(self.mps.check):
                self._mps_event(uuid, event, clients)
        rows = await asyncio.to_thread(self._usage_samples, self.store.jobs([State.RUNNING]))
        if rows:
            self.store.add_samples(rows)

    def _usage_samples(self, running: list[Job]) -> list[tuple]:
        """Per running GPU job: memory from its ledger, SM and bandwidth from NVML's per-process samples."""
        if self.gpu_error or not running:
            return []
        util: dict[int, tuple[int, int]] = {}
        for dev in self.devices:
            if any(dev.uuid in j.gpus for j in running):
                util.update(self.nvml.process_utilization(dev.index))
        now, rows = time.time(), []
        for j in running:
            if not j.gpus or not j.handle:
                continue
            u = self.usage(j)
            try:
                pids = self.runtime_for(j).pids(j.handle)
            except Exception:  # noqa: BLE001 - it may be ending right now
                pids = []
            sm = sum(util.get(p, (0, 0))[0] for p in pids) / 100.0
            bw = sum(util.get(p, (0, 0))[1] for p in pids) / 100.0
            rows.append((j.id, now, min(sm, 1.0), u["used"] if u else None, min(bw, 1.0)))
        return rows

    def _mps_event(self, uuid: str, event: str, clients: list[int]) -> None:
        log.warning("MPS on %s: %s", uuid, event)
        if event != "fault":
            return
        for job in self.store.jobs([State.RUNNING]):
            if job.mode == Mode.MPS and uuid in job.gpus:
                live = self.live.setdefault(job.id, Live())
                live.cancelled_by = None
                rt = self.runtime_for(job)
                if job.spec.retries > job.attempts - 1:
                    self.transition(job.id, State.QUEUED, "requeued after an MPS server fault")
                else:
                    self.transition(job.id, State.FAILED, "MPS server fault")
                if live.task:
                    live.task.cancel()
                handle = job.handle
                asyncio.get_running_loop().create_task(self._kill_after_fault(job.id, rt, handle))
        self.wake()

    async def _kill_after_fault(self, job_id: int, rt, handle: str) -> None:
        await asyncio.to_thread(rt.stop, handle, self.config.stop_grace)
        await asyncio.to_thread(rt.cleanup, handle)
        shutil.rmtree(self.run_dir(job_id), ignore_errors=True)
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


def interposer_budget_text(job: Job) -> str:
    from ..units import format_size

    return f"budget of {format_size(job.spec.gpu_mem)}"
