"""The daemon's state and its one scheduler loop.

Everything that changes a job's state happens on the event loop thread, through the store;
blocking work (Docker, NVML, waiting for exits) runs in worker threads and reports back here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .. import interposer, mps, native, policy, profiles
from ..config import Config
from ..gpu import GpuInfo, NoDriver, Nvml
from ..jobs import ACTIVE, TERMINAL, Job, Mode, State
from ..runtimes.base import Gone, StartError, Unavailable
from ..runtimes.process import ProcessRuntime
from ..store import Store, StoreError
from ..units import format_size
from .launchspec import build_launch

log = logging.getLogger("colo")
DOCKER_RETRY = 5.0  # seconds between looks for an engine that was not there at start-up


class AlreadyRunning(RuntimeError):
    pass


async def blocking(fn, *args):
    """Run a call that blocks for a job's whole life (waiting for its exit) on a thread of its
    own. The thread is a daemon thread, so stopping colo never waits for it: the job runs on and
    is found again at the next start. (The shared worker pool would hold shutdown until every
    job had ended, and cap the number of jobs that can run at once.)"""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is closed: colo stopped while the job ran

    threading.Thread(target=run, name=f"colo-wait-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await fut


@dataclass
class Live:
    """What the daemon knows about an active job beyond the store."""
    task: asyncio.Task | None = None
    stopping: bool = False


class Daemon:
    def __init__(self, config: Config):
        self.config = config
        self.cfg_policy = policy.PolicyConfig(reserve=config.reserve, saturation=config.saturation,
                                              bw_saturation=config.bw_saturation, min_gain=config.min_gain,
                                              hold_after=config.hold_after,
                                              multi_user_mps=config.multi_user_mps, use_mps=config.use_mps)
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
        self.changed: asyncio.Condition | None = None
        self.stopping = False
        self.open_jobs: dict[int, Job] = {}  # queued and active jobs: the store's rows, mirrored
        self.decisions: dict[int, policy.Decision] = {}  # the latest decision per open job
        self._cands: dict[int, policy.Candidate] = {}
        self.stats: dict[int, dict] = {}  # running jobs' last sample: pids, sm_util, used, refused
        self._ended: dict[int, Job] | None = None  # ended jobs never change: read once, then kept
        self._writer: DecisionWriter | None = None
        self.mps: mps.MpsManager | None = None
        # learned profiles are written to (and win from) the state dir; then the configured ones
        self.profiles = profiles.ProfileStore(
            [config.state_dir / "profiles", *config.profile_dirs, profiles.shipped_dir()])
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
        self.open_jobs = {j.id: j for j in self.store.jobs([State.QUEUED, *ACTIVE])}
        self._writer = DecisionWriter(c.db_path)
        self.native = native.publish(c.state_dir)
        self.runtimes["process"] = ProcessRuntime(shim=self.native / "colo-shim")
        try:
            self.devices = self.nvml.devices()
        except NoDriver as e:
            self.gpu_error = str(e)
            log.warning("%s", e)
        self._init_docker()
        self._init_mps()
        self._check_compute_modes()

    def _init_docker(self) -> None:
        try:
            from ..runtimes.docker import DockerRuntime

            rt = DockerRuntime.from_env(instance=self.instance_id())
            rt.client.ping()
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

    def fake_env(self) -> dict[str, str]:
        lib = self.native / native.FAKEGPU_DIR
        return {"COLO_FAKEGPU_STATE": str(self.config.fakegpu_state), "LD_LIBRARY_PATH": str(lib)}

    def close(self) -> None:
        if "docker" in self.runtimes:
            self.runtimes["docker"].close()
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
    def gpu_views(self) -> list[policy.GpuView]:
        states = self.mps.states() if self.mps else {}
        return [policy.GpuView(uuid=d.uuid, index=d.index, usable=max(0, d.total - self.config.reserve),
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

    def wake(self) -> None:
        if self.wake_event is not None:
            self.wake_event.set()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def add_job(self, spec, uid: int, gid: int, user: str) -> Job:
        job = self.store.add_job(spec, uid, gid, user)
        self.open_jobs[job.id] = job
        self.wake()
        return job

    def transition(self, job_id: int, new: State, reason: str, **fields) -> Job:
        """The one way a job changes state: checked and stored by the store, mirrored here."""
        job = self.store.transition(job_id, new, reason, **fields)
        self._cands.pop(job_id, None)
        if job.state in TERMINAL:
            self.open_jobs.pop(job_id, None)
            self.decisions.pop(job_id, None)
            if self._ended is not None:
                self._ended[job_id] = job
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

    def all_jobs(self) -> list[Job]:
        if self._ended is None:
            self._ended = {j.id: j for j in self.store.jobs(TERMINAL)}
        return sorted([*self._ended.values(), *self.open_jobs.values()], key=lambda j: j.id)

    def jobs_in(self, *states: State) -> list[Job]:
        return [j for j in self.open_jobs.values() if j.state in states]

    def explain(self, job_id: int) -> dict | None:
        d = self.decisions.get(job_id)
        if d is None:
            return self.store.decision(job_id)
        return {"action": d.action, "mode": d.mode, "gpus": list(d.gpus), "reason": d.reason, "details": d.details}

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
        """Check dependencies, plan, start. Exits are reaped by the monitors, not here."""
        queued = self.jobs_in(State.QUEUED)
        if not queued:
            return []
        candidates, waits = self._eligible(queued)
        now = time.time()
        placed = [policy.Placed(j.id, tuple(j.gpus), j.spec.gpu_mem, j.uid, str(j.mode or "timesliced"),
                                self.profile_of(j), now - (j.started_at or now))
                  for j in self.jobs_in(*ACTIVE) if j.gpus]
        decisions = policy.plan(candidates, self.gpu_views(), placed, self.cfg_policy, now=now)
        self._record(waits)
        self._record(decisions)
        for d in decisions:
            if d.action == policy.START:
                self.start_job(d)
        return decisions

    def _eligible(self, queued: list[Job]) -> tuple[list[policy.Candidate], list[policy.Decision]]:
        cands, waits = [], []
        for j in queued:
            if j.spec.after:
                deps = {a: self._state_of(a) for a in j.spec.after}
                failed = [a for a, st in deps.items() if st in (State.FAILED, State.CANCELLED, State.LOST, None)]
                if failed:
                    self.transition(j.id, State.FAILED, f"dependency failed: job {failed[0]} "
                                    f"{deps[failed[0]] or 'does not exist'}")
                    continue
                pending = [a for a, st in deps.items() if st != State.SUCCEEDED]
                if pending:
                    waits.append(policy.Decision(j.id, policy.WAIT, reason=f"waiting for job {pending[0]} to succeed"))
                    continue
            if j.spec.gpus and self.gpu_error:
                waits.append(policy.Decision(j.id, policy.WAIT, reason=self.gpu_error))
                continue
            if j.spec.runtime == "docker" and (why := self.docker_away()):
                waits.append(policy.Decision(j.id, policy.WAIT, reason=f"waiting for the Docker engine: {why}"))
                continue
            c = self._cands.get(j.id)
            last = self.decisions.get(j.id)
            held = tuple(last.details.get("held", ())) if last is not None else ()
            if c is not None and c.held != held:
                c = self._cands[j.id] = dataclasses.replace(c, held=held)
            if c is None:
                c = self._cands[j.id] = policy.Candidate(j.id, j.spec.gpu_mem, j.spec.gpus, j.uid, j.spec.priority,
                                                         j.id, self.profile_of(j) if j.spec.gpus else None,
                                                         queued_at=j.submitted_at, held=held)
            cands.append(c)
        return cands, waits

    def _state_of(self, job_id: int) -> State | None:
        try:
            return self.job(job_id).state
        except KeyError:
            return None

    def _record(self, decisions: list[policy.Decision]) -> None:
        """Keep the latest decision per job; START decisions are stored at once, the (many, often
        re-worded) WAIT ones by a writer thread, so a pass over 10,000 queued jobs stays short."""
        now = time.time()
        starts, waits = [], []
        for d in decisions:
            old = self.decisions.get(d.job_id)
            if old is not None and old.reason == d.reason and old.action == d.action:
                continue
            self.decisions[d.job_id] = d
            row = (d.job_id, d.action, d.mode, list(d.gpus), d.reason, d.details)
            (starts if d.action == policy.START else waits).append(row)
        if starts:
            self.store.record_decisions(starts, now)
        if waits:
            self._writer.put(waits, now)

    def profile_name(self, job: Job) -> str:
        return job.spec.profile or profiles.key_for(job.spec.image, job.spec.argv)

    def profile_of(self, job: Job) -> "profiles.Profile | None":
        """The stored profile a job runs under; files are read again at most every 60 s."""
        name = self.profile_name(job)
        hit = self._profile_cache.get(name)
        now = time.monotonic()
        if hit is None or now - hit[0] > 60:
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
            self._cands.clear()  # queued jobs of that profile plan with what was just learned
        except (profiles.ProfileError, OSError) as e:
            log.warning("could not learn profile for job %d: %s", job.id, e)

    # launching and monitoring -----------------------------------------------------------------
    def start_job(self, d: policy.Decision) -> None:
        mode = Mode(d.mode) if d.mode else Mode.TIMESLICED
        job = self.transition(d.job_id, State.STARTING, d.reason, gpus=list(d.gpus), mode=mode,
                              attempts=self.job(d.job_id).attempts + 1)
        live = self.live.setdefault(job.id, Live())
        live.task = asyncio.get_running_loop().create_task(self._launch_and_follow(job, d))

    async def _launch_and_follow(self, job: Job, d: policy.Decision) -> None:
        try:
            rt = self.runtime_for(job)
            launch = await asyncio.to_thread(build_launch, self, job, d)
            handle = await asyncio.to_thread(rt.start, launch)
        except asyncio.CancelledError:
            raise
        except Unavailable as e:  # the engine went away: not the job's fault, it starts when it is back
            why = f"requeued: {e} as it started"
            await self._durably(lambda: self._requeue(job.id, why))
            self._finish(job.id)
            return
        except Exception as e:  # noqa: BLE001 - whatever it was, the job must not stay "starting"
            reason = str(e) if isinstance(e, (StartError, mps.MpsError, OSError)) else f"{e.__class__.__name__}: {e}"
            await self._durably(lambda: self.transition(job.id, State.FAILED, f"failed to start: {reason}"))
            self._finish(job.id)
            return
        await self._durably(lambda: self.set_fields(job.id, handle=handle))
        await self._durably(lambda: self.transition(job.id, State.RUNNING, f"started ({job.spec.runtime})"))
        if self.job(job.id).cancel_by:  # cancelled while it was starting
            await self._finish_cancel(job.id, handle)
        await self.follow(job.id, handle)

    async def _durably(self, write):
        """A store write that must happen (a job's end, its start): retried while the disk is full."""
        delay = 0.5
        while True:
            try:
                return write()
            except StoreError as e:
                log.error("cannot record to the store (%s); retrying in %.0fs", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def follow(self, job_id: int, handle: str) -> None:
        job = self.job(job_id)
        rt = self.runtime_for(job)
        try:
            code = await blocking(rt.wait, handle)
        except Unavailable:
            return  # colo is stopping while the engine is away: found again at the next start
        except Gone as e:
            by = self.job(job_id).cancel_by
            reason = f"cancelled by {by} ({e})" if by else f"lost: {e}"
            await self._durably(lambda: self.transition(job_id, State.CANCELLED if by else State.LOST, reason))
            self._finish(job_id, rt, handle)
            return
        except asyncio.CancelledError:
            return  # the daemon is stopping; the job runs on and is found again at restart
        job = await self._durably(lambda: self.record_exit(job_id, code))
        if job.state == State.SUCCEEDED:
            self.learn(job)
        self._finish(job_id, rt, handle)

    def record_exit(self, job_id: int, code: int) -> Job:
        refused = self._refused(job_id)
        note = (f"; {refused} allocation(s) refused by its budget of {format_size(self.job(job_id).spec.gpu_mem)}"
                if refused else "")
        job = self.job(job_id)
        if job.handle and job.spec.runtime in self.runtimes:
            extra = self.runtimes[job.spec.runtime].exit_note(job.handle)
            note += f"; {extra}" if extra else ""
        if job.cancel_by:
            return self.transition(job_id, State.CANCELLED, f"cancelled by {job.cancel_by}", exit_code=code)
        if code == 0:
            return self.transition(job_id, State.SUCCEEDED, f"exited with code 0{note}", exit_code=0)
        return self.transition(job_id, State.FAILED, f"exited with code {_code_text(code)}{note}", exit_code=code)

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
        job = self.job(job_id)
        if job.state in TERMINAL:
            return job
        if job.state == State.QUEUED:
            return self.transition(job_id, State.CANCELLED, f"cancelled by {by} before it started")
        self.set_fields(job_id, cancel_by=by)  # first, so that a crash from here on still ends in a cancel
        if job.handle:  # else it is starting: stopped as soon as it has a handle
            await self._finish_cancel(job_id, job.handle)
        return self.job(job_id)

    def _requeue(self, job_id: int, reason: str) -> Job:
        """Back to the queue, unless a cancel was asked for meanwhile."""
        job = self.job(job_id)
        if job.cancel_by:
            return self.transition(job_id, State.CANCELLED, f"cancelled by {job.cancel_by} before it started")
        return self.transition(job_id, State.QUEUED, reason)

    async def _finish_cancel(self, job_id: int, handle: str) -> None:
        """Stop a job whose cancel is stored (once at a time). An engine that is away is left to
        _watch_docker, which calls this again when it answers."""
        live = self.live.setdefault(job_id, Live())
        if live.stopping:
            return
        try:
            await self._stop(job_id, handle)
        except Unavailable:
            live.stopping = False
        except Exception:
            live.stopping = False  # a later cancel may try again
            raise

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
        if self.mps is not None and self.mps.available():
            for d in self.devices:
                await asyncio.to_thread(self.mps.adopt, d.uuid, d.index)
        await self._recover(self.jobs_in(*ACTIVE))

    async def _recover(self, jobs: list[Job]) -> None:
        found: dict[int, str] = {}
        if "docker" in self.runtimes:
            found = await asyncio.to_thread(self.runtimes["docker"].adopt)
        for job in jobs:
            if job.spec.runtime == "docker" and "docker" not in self.runtimes:
                # The engine is not there (yet): the job may well run on. It keeps its budget and
                # is found again when the engine answers (see sample).
                log.warning("job %d: %s; followed again when it answers", job.id, self.docker_error)
                continue
            try:
                rt = self.runtime_for(job)
            except StartError as e:
                self.transition(job.id, State.LOST, f"lost: cannot follow it after a restart ({e})")
                continue
            handle = job.handle or found.get(job.id) or self._unrecorded_process(job)
            if handle is None:
                if job.state == State.STARTING:
                    self._requeue(job.id, "requeued: its start was cut short by a daemon restart")
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
                self.set_fields(job.id, handle=handle)
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
            if job.cancel_by:  # the daemon stopped in the middle of cancelling it: finish that
                asyncio.get_running_loop().create_task(self._finish_cancel(job.id, handle))
        if "docker" in self.runtimes:
            await self._sweep_containers(found)

    async def _sweep_containers(self, found: dict[int, str] | None = None) -> None:
        """Remove this daemon's containers that no open job owns: ended while colo or the engine
        was away, or created by a start the engine cut short."""
        rt = self.runtimes["docker"]
        if found is None:
            found = await asyncio.to_thread(rt.adopt)
        for job_id, handle in found.items():
            job = self.open_jobs.get(job_id)
            if job is not None and (job.handle == handle or job.state == State.STARTING):
                continue
            await asyncio.to_thread(rt.cleanup, handle)

    def _unrecorded_process(self, job: Job) -> str | None:
        """A process job whose start was cut short before its handle was stored: its shim may be
        running (or have finished) all the same. Found by the exit file it was given, so that
        recovery never starts the same job twice."""
        if job.spec.runtime != "process" or job.state != State.STARTING:
            return None
        import psutil

        exit_file = str(self.run_dir(job.id) / "exit")
        for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
            cmd = p.info["cmdline"] or []
            if len(cmd) > 1 and cmd[0].endswith("colo-shim") and cmd[1] == exit_file:
                return f"{p.pid}:{p.info['create_time']:.3f}"
        if os.path.exists(exit_file):
            return "0:0"  # it ran and ended while colo was away; poll() reads its exit code
        return None

    # periodic work ----------------------------------------------------------------------------
    async def _tick(self) -> None:
        while not self.stopping:
            try:
                await self.sample()
            except Exception as e:  # noqa: BLE001 - a bad sample must not stop the daemon
                log.warning("sampling failed: %s", e)
            await asyncio.sleep(self.config.sample_interval)

    async def _watch_docker(self) -> None:
        """An engine that was not there at start-up, or went away, is looked for at each tick."""
        rt = self.runtimes.get("docker")
        if rt is None:
            if time.monotonic() < self._docker_retry_at:
                return
            self._docker_retry_at = time.monotonic() + DOCKER_RETRY
            await asyncio.to_thread(self._init_docker)
            if "docker" in self.runtimes:
                log.warning("Docker engine found: container jobs can run")
                self.docker_error = None
                await self._recover([j for j in self.jobs_in(*ACTIVE)
                                     if j.spec.runtime == "docker" and j.id not in self.live])
                self.wake()
        elif rt.down is not None and await asyncio.to_thread(rt.check):
            await self._sweep_containers()
            for j in self.jobs_in(State.RUNNING):  # cancels asked for while it was away
                if j.cancel_by and j.handle and j.spec.runtime == "docker":
                    asyncio.get_running_loop().create_task(self._finish_cancel(j.id, j.handle))
            self.wake()

    async def sample(self) -> None:
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
        rows = await asyncio.to_thread(self._usage_samples, self.jobs_in(State.RUNNING))
        if rows:
            self.store.add_samples(rows)

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
        for dev in self.devices:
            if dev.error is None and any(dev.uuid in j.gpus for j in running):
                util.update(self.nvml.process_utilization(dev.index))
        now, rows, stats = time.time(), [], {}
        for j in running:
            if not j.gpus or not j.handle:
                continue
            u = self.usage(j)
            try:
                pids = self.runtime_for(j).pids(j.handle)
            except Exception:  # noqa: BLE001 - it may be ending right now
                pids = []
            sm = min(sum(util.get(p, (0, 0))[0] for p in pids) / 100.0, 1.0)
            bw = min(sum(util.get(p, (0, 0))[1] for p in pids) / 100.0, 1.0)
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
            pids = set(await asyncio.to_thread(rt.pids, job.handle))
            if clients and not pids & clients:
                continue
            live = self.live.setdefault(job.id, Live())
            if live.task:
                live.task.cancel()
            if job.attempts <= job.spec.retries:
                self._requeue(job.id, f"{mps.FAULT_REASON}; requeued (attempt {job.attempts} of {job.spec.retries + 1})")
            else:
                self.transition(job.id, State.FAILED, mps.FAULT_REASON)
            asyncio.get_running_loop().create_task(self._kill_after_fault(job.id, rt, job.handle))
        self.wake()

    async def _kill_after_fault(self, job_id: int, rt, handle: str) -> None:
        await asyncio.to_thread(rt.stop, handle, self.config.stop_grace)
        try:
            await blocking(rt.wait, handle)  # reaped, so its exit file or container is final
        except (Gone, Unavailable):
            pass
        await asyncio.to_thread(rt.cleanup, handle)
        if self.store.get(job_id).state in TERMINAL:  # a requeued job gets a fresh ledger when it starts
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


def _code_text(code: int) -> str:
    """137 -> "137 (SIGKILL)": exit codes past 128 are how a signal's death is reported."""
    if code > 128:
        try:
            return f"{code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return str(code)


class DecisionWriter:
    """Stores WAIT decisions from its own thread and SQLite connection, latest per job."""

    def __init__(self, db_path: Path):
        self.db_path = db_path
        self._pending: dict[int, tuple] = {}
        self._now = 0.0
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="colo-decisions", daemon=True)
        self._thread.start()

    def put(self, rows: list[tuple], now: float) -> None:
        with self._cv:
            self._pending.update((r[0], r) for r in rows)
            self._now = now
            self._cv.notify()

    def _run(self) -> None:
        store = Store(self.db_path)
        try:
            while True:
                with self._cv:
                    while not self._pending and not self._stop:
                        self._cv.wait()
                    batch, self._pending = self._pending, {}
                    now = self._now
                if batch:
                    try:
                        store.record_decisions(batch.values(), now)
                    except Exception as e:  # noqa: BLE001 - disk full, say: the next batch tries again
                        log.warning("could not store %d decisions: %s", len(batch), e)
                if self._stop and not self._pending:
                    return
        finally:
            store.close()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)
