"""`colo suspend` / `colo resume` of a suspended job (docs/suspend.md): a running job's GPU memory
moved to host memory by the driver's checkpoint API and back, through colo-ckpt (native/tools),
run in a worker thread: the loop never waits on a driver call.

Owns each suspended job's record (the job's `suspended` column, JSON), the suspends and resumes
under way, and why a wanted resume still waits. A record is stored before the driver is asked and
changed after it answered, so a daemon killed in between finds the job again at its start and
finishes or undoes the step (`recover`): a job is never left locked.

Record phases: "suspending" (asked; its budget still counted), "suspended" (its processes hold
no device memory: its budget is not counted on its GPUs unless a resume is wanted, which
reserves it as the front of the queue), "resuming" (restore asked; budget counted)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import Config
from ..jobs import ACTIVE, Job, Mode, State
from ..node import interposer
from ..sched import fairshare, policy
from ..units import format_size
from .gpus import Gpus
from .jobtable import JobTable

log = logging.getLogger("colo")

TOOL = "colo-ckpt"
RECLAIM_FRONT = 16  # queued jobs a policy makes room for in one tick, from the queue's front


class SuspendRefused(Exception):
    """A suspend or resume that colo or the driver refused: the reason, for the asker."""


@dataclass
class Record:
    phase: str  # suspending | suspended | resuming
    by: str
    at: float
    pids: list[int] = field(default_factory=list)
    bytes: int = 0  # held in host memory while suspended
    wanted: float | None = None  # a resume was asked at this time (colo resume, its next CUDA call)

    def dump(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def record_of(job: Job) -> Record | None:
    if not job.suspended or job.state != State.RUNNING:
        return None
    try:
        return Record(**json.loads(job.suspended))
    except (TypeError, ValueError):
        return None


def releases_budget(job: Job) -> bool:
    """Whether the job's budget is not counted on its GPUs: suspended, and no resume wanted."""
    r = record_of(job)
    return r is not None and r.phase == "suspended" and r.wanted is None


def off_gpu(job: Job) -> bool:
    """Whether the job is suspended now: its memory in host memory, nothing of it running on a GPU
    (not GPU use: fair share, report, the metrics' GPU-seconds)."""
    r = record_of(job)
    return r is not None and r.phase == "suspended"


def held_span(job: Job, end: float) -> tuple[float, float]:
    """The span of a job's run that counts as GPU use (fair share): its suspended time left out,
    that of ended suspends (off_gpu) and the one under way, since its checkpoint was done."""
    r = record_of(job)
    return fairshare.held_span(job.started_at or end, end, job.off_gpu, r.at if off_gpu(job) else None)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _driver_reason(out: str) -> str:
    """colo-ckpt's "error PID STEP CODE NAME: TEXT" lines, as one sentence."""
    errs = []
    for line in out.splitlines():
        parts = line.split(" ", 4)
        if len(parts) == 5 and parts[0] == "error":
            errs.append(f"the driver's {parts[2]} of pid {parts[1]} answered {parts[4]}")
    return "; ".join(errs)


class Suspender:
    def __init__(self, config: Config, table: JobTable, gpus: Gpus, native_dir: Path, runtime_for, stats,
                 placed, wake, decisions=dict, usage=lambda job: None):
        self.config = config
        self.table = table
        self.gpus = gpus
        self.tool = native_dir / TOOL
        self._runtime_for = runtime_for  # Engines.runtime_for
        self._stats = stats  # () -> the sampler's stats per job (its last sample)
        self._usage = usage  # Sampler.usage: a job's ledger read now (before its first sample)
        self._placed = placed  # Scheduler.placed: the jobs on GPUs as plan() sees them
        self._wake = wake
        self._decisions = decisions  # () -> the scheduler's latest decision per queued job
        self._skip: dict[int, float] = {}  # a policy's suspend refused: not tried again before then
        self._busy: set[int] = set()  # jobs with a driver step under way
        self.waits: dict[int, str] = {}  # a wanted resume that waits: why
        self._soon: asyncio.Task | None = None
        table.on_change.append(self._job_changed)
        self.counts = {"suspends": 0, "resumes": 0, "refused": 0, "suspend_seconds": 0.0, "resume_seconds": 0.0}

    # the helper --------------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        if self.config.fakegpu_state is not None:
            env.update(self.gpus.fake_env())
        return env

    def _run(self, *args: str) -> tuple[int, str]:
        """colo-ckpt, blocking (a worker thread's). Bounded: a target that never answers (frozen)
        makes the tool give up by itself; this is the last guard."""
        limit = self.config.suspend_lock_timeout + 60
        try:
            r = subprocess.run([str(self.tool), "-t", str(int(self.config.suspend_lock_timeout * 1000)), *args],
                               capture_output=True, text=True, env=self._env(), timeout=limit)
        except subprocess.TimeoutExpired:
            return 124, f"error 0 {args[0]} 909 CUDA_ERROR_TIMEOUT: colo-ckpt did not answer in {limit:g} s"
        except OSError as e:
            return 127, f"error 0 {args[0]} 0 CUDA_ERROR: {e}"
        return r.returncode, r.stdout + (r.stderr if r.returncode else "")

    async def _ckpt(self, what: str, pids: list[int]) -> tuple[int, str]:
        if not pids:  # none of its processes is left: nothing to move (its ends are the reaper's)
            return 0, ""
        return await asyncio.to_thread(self._run, what, *map(str, pids))

    def _still_its(self, job: Job, pids: list[int]) -> list[int]:
        """The pids of a record that are still the job's processes (blocking: a worker thread's).
        colo-ckpt acts as root: a pid that ended and was reused (by another user's process, maybe
        another suspended job's) is never passed to it; the job's runtime says which are its own."""
        try:
            mine = set(self._runtime_for(job).pids(job.handle))
        except Exception:  # noqa: BLE001 - it is ending: none are left to act on
            return []
        return [p for p in pids if p in mine]

    async def _ckpt_own(self, what: str, job: Job, pids: list[int]) -> tuple[int, str]:
        """colo-ckpt on those of a stored record's pids that are still the job's."""
        return await self._ckpt(what, await asyncio.to_thread(self._still_its, job, pids))

    def _word(self, job_id: int, value: int | None = None) -> int:
        """The job's ledger's suspend word (native/interpose/gate.c), blocking (worker threads)."""
        try:
            return interposer.suspend_word(self.config.run_dir(job_id) / "ledger", value)
        except OSError as e:
            log.warning("job %d: its ledger's suspend word: %s", job_id, e)
            return 0

    async def _tell_gate(self, job_id: int, value: int) -> None:
        await asyncio.to_thread(self._word, job_id, value)

    def _store(self, job_id: int, rec: Record | None) -> Job:
        return self.table.set_fields(job_id, suspended=rec.dump() if rec else None)

    def _off_gpu_ends(self, job: Job, rec: Record, phase: str) -> Job:
        """A suspended job leaves the phase "suspended": the time since its checkpoint was done
        (rec.at) is added to its time off the GPU (fair share, report), in the same update."""
        now = time.time()
        rec.phase, off = phase, job.off_gpu + max(0.0, now - rec.at)
        rec.at = now
        return self.table.set_fields(job.id, suspended=rec.dump(), off_gpu=off)

    def _note(self, job: Job, text: str) -> None:
        """In the job's history (events) and, for a process job, its log."""
        self.table.store.add_event(job.id, text)
        log.info("job %d: %s", job.id, text)
        if job.spec.runtime != "process":
            return
        try:
            fd = os.open(self.config.log_path(job.id), os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.write(fd, f"\n[colo: {text}]\n".encode())
        except OSError:
            pass
        finally:
            os.close(fd)

    # suspend -----------------------------------------------------------------------------------
    def refusal(self, job: Job) -> str | None:
        """Why colo does not suspend this job (before the driver is asked)."""
        if job.state != State.RUNNING or not job.handle:
            return f"job {job.id} is {job.state}: only a running job can be suspended"
        if not job.gpus:
            return f"job {job.id} holds no GPU: nothing to suspend"
        if job.spec.slurm_job is not None:
            return f"job {job.id} is Slurm job {job.spec.slurm_job}: ask Slurm"
        if job.cancel_by:
            return f"job {job.id} is being stopped (cancelled by {job.cancel_by})"
        if job.paused_by:
            return f"job {job.id} is paused (frozen, it cannot answer the driver): colo resume {job.id} first"
        if job.mode == Mode.MPS:
            return f"job {job.id} is an MPS client: the driver cannot checkpoint MPS clients"
        if job.id in self._busy:
            return f"job {job.id} is being suspended or resumed right now"
        return None

    def _host_refusal(self, job: Job, nbytes: int) -> str | None:
        share = self.config.suspend_host_share
        avail = mem_available()
        if nbytes > share * avail:
            return (f"job {job.id} holds {format_size(nbytes)} of GPU memory; suspended it would take that much host "
                    f"memory, more than this node allows ({share:.0%} of the {format_size(avail)} available)")
        cap = self.config.suspend_host_max
        if cap:
            held = sum(r.bytes for j in self.table.jobs_in(State.RUNNING) if (r := record_of(j)) and j.id != job.id)
            if held + nbytes > cap:
                return (f"job {job.id} holds {format_size(nbytes)} of GPU memory; with the {format_size(held)} "
                        f"suspended jobs hold already that passes suspend_host_max ({format_size(cap)})")
        return None

    async def suspend(self, job: Job, by: str) -> Job:
        rec = record_of(job)
        if rec is not None and rec.phase == "suspended":
            return job
        if why := self.refusal(job):
            raise SuspendRefused(why)
        self._busy.add(job.id)
        try:
            return await self._suspend(job, by)
        finally:
            self._busy.discard(job.id)

    async def _suspend(self, job: Job, by: str) -> Job:
        t0 = time.monotonic()
        pids = await asyncio.to_thread(self._runtime_for(job).pids, job.handle)
        st = self._stats().get(job.id) or await asyncio.to_thread(self._usage, job) or {}
        nbytes = max(st.get("nvml_used") or 0, st.get("used") or 0) or job.spec.gpu_mem * len(job.gpus)
        if why := self._host_refusal(job, nbytes):
            self.counts["refused"] += 1
            raise SuspendRefused(why)
        self._store(job.id, Record("suspending", by, time.time(), pids, nbytes))  # stored first: see recover
        # the job's interposers hold its calls before the driver from now on (else one that came
        # after the lock would wait inside the driver, where nothing asks for the resume)
        await self._tell_gate(job.id, interposer.SUSPENDED)
        rc, out = await self._ckpt("suspend", pids)
        if rc != 0:
            self._store(job.id, None)
            await self._tell_gate(job.id, 0)
            self.counts["refused"] += 1
            raise SuspendRefused(f"job {job.id} was not suspended: {_driver_reason(out) or out.strip()}; nothing of it changed")
        held = [int(p) for p, s in (line.split(" ", 1) for line in out.splitlines() if " " in line)
                if p.isdigit() and s.strip() == "checkpointed"]
        if not held:
            self._store(job.id, None)
            await self._tell_gate(job.id, 0)
            self.counts["refused"] += 1
            raise SuspendRefused(f"job {job.id} has no CUDA process to suspend")
        asked = record_of(self.table.job(job.id))  # a resume asked meanwhile (colo resume) is kept
        job = self._store(job.id, Record("suspended", by, time.time(), held, nbytes, asked.wanted if asked else None))
        dt = time.monotonic() - t0
        self.counts["suspends"] += 1
        self.counts["suspend_seconds"] += dt
        self._note(job, f"suspended by {by}: {format_size(nbytes)} of GPU memory moved to host memory "
                        f"({len(held)} process{'es' if len(held) != 1 else ''}, {dt:.2f} s); colo resume {job.id}")
        self._wake()  # its budget is free for the queue
        if asked and asked.wanted is not None:
            asyncio.get_running_loop().create_task(self._resume_soon(job.id))
        return job

    async def _resume_soon(self, job_id: int) -> None:
        """A resume asked while the job was being suspended: tried once the suspend is done (the
        suspend's own request has let go of the job by then)."""
        while job_id in self._busy:
            await asyncio.sleep(0.01)
        await self.resume_waiting()

    # resume ------------------------------------------------------------------------------------
    async def want_resume(self, job: Job, by: str) -> Job:
        """A resume asked (colo resume): its budget is reserved now (the front of the queue), and
        it is restored as soon as that budget fits on its GPUs again."""
        rec = record_of(job)
        if rec is None:
            raise SuspendRefused(f"job {job.id} is not suspended")
        if rec.wanted is None and rec.phase in ("suspending", "suspended"):  # suspending: once it is done
            rec.wanted = time.time()
            job = self._store(job.id, rec)
            log.info("job %d: resume asked by %s", job.id, by)
        await self.resume_waiting()
        return self.table.job(job.id)

    def _job_changed(self, prev: Job | None, job: Job) -> None:
        """A job that held budget ended: a wanted resume may fit now, before the next tick."""
        if prev is None or prev.state not in ACTIVE or job.state in ACTIVE or not prev.gpus:
            return
        if self._soon is None or self._soon.done():
            self._soon = asyncio.get_running_loop().create_task(self.resume_waiting())

    async def resume_waiting(self) -> None:
        """Restores the suspended jobs whose resume is wanted and whose budget fits again, the
        longest waiting first (the tick, a request)."""
        held = [(j.id, r) for j in self.table.jobs_in(State.RUNNING)
                if (r := record_of(j)) and r.phase == "suspended" and r.wanted is None and j.id not in self._busy]
        if held:  # a CUDA call of theirs waits at the gate: it asks for the resume
            words = await asyncio.to_thread(lambda: [self._word(i) for i, _ in held])
            for (job_id, rec), word in zip(held, words):
                if word & interposer.RESUME_WANTED and record_of(self.table.job(job_id)) == rec:
                    rec.wanted = time.time()
                    self._store(job_id, rec)
                    log.info("job %d: resume asked by its next CUDA call", job_id)
        wanted = sorted((r.wanted, j.id) for j in self.table.jobs_in(State.RUNNING)
                        if (r := record_of(j)) and r.phase == "suspended" and r.wanted is not None)
        for j in set(self.waits) - {i for _, i in wanted}:
            del self.waits[j]
        for _, job_id in wanted:
            if job_id in self._busy:
                continue
            job = self.table.job(job_id)
            others = [p for p in self._placed(time.time()) if p.job_id != job_id]
            why = policy.resume_refusal(job.spec.gpu_mem, job.gpus, self.gpus.views(in_use=True), others)
            if why:
                self.waits[job_id] = why
                continue
            self.waits.pop(job_id, None)
            self._busy.add(job_id)
            asyncio.get_running_loop().create_task(self._resume(job))

    async def _resume(self, job: Job) -> None:
        try:
            rec = record_of(job)
            if rec is None:
                return
            t0 = time.monotonic()
            self._off_gpu_ends(job, rec, "resuming")
            rc, out = await self._ckpt_own("resume", job, rec.pids)
            job = self.table.job(job.id)
            if job.state != State.RUNNING:
                return
            if rc != 0:
                rec.phase, rec.at = "suspended", time.time()  # off the GPU again from now
                self._store(job.id, rec)
                self.waits[job.id] = f"the driver's restore failed: {_driver_reason(out) or out.strip()}"
                log.warning("job %d: %s", job.id, self.waits[job.id])
                return
            self._store(job.id, None)
            await self._tell_gate(job.id, 0)  # its calls waiting at the gate go on
            dt = time.monotonic() - t0
            self.counts["resumes"] += 1
            self.counts["resume_seconds"] += dt
            self._note(job, f"resumed: {format_size(rec.bytes)} back on its GPU ({dt:.2f} s)")
        finally:
            self._busy.discard(job.id)

    # policies -----------------------------------------------------------------------------------
    def _holders(self, now: float) -> list[policy.Holder]:
        cfg, stats, out = self.config, self._stats(), []
        for j in self.table.jobs_in(State.RUNNING):
            if (len(j.gpus) != 1 or j.suspended or j.paused_by or j.cancel_by or j.mode == Mode.MPS
                    or j.spec.no_suspend or j.spec.slurm_job is not None or self._skip.get(j.id, 0) > now):
                continue
            idle_on = (cfg.idle_sessions if j.spec.interactive else cfg.idle_jobs) == "suspend"
            out.append(policy.Holder(j.id, j.gpus[0], j.spec.gpu_mem, j.spec.priority,
                                     (stats.get(j.id) or {}).get("idle_since"), idle_on, cfg.preempt == "suspend"))
        return out

    async def reclaim(self) -> None:
        """idle_jobs, idle_sessions = "suspend" and preempt = "suspend": for the queued jobs that
        wait for memory (their latest decision is the planner's wait), from the front, the holders
        policy.suspend_victims names are suspended; memory made room for one is not counted again
        for the next (the tick)."""
        cfg = self.config
        if "suspend" not in (cfg.idle_jobs, cfg.idle_sessions, cfg.preempt) or self._busy:
            return
        now = time.time()
        waiting = [self.table.open.get(i) for i, d in self._decisions().items()
                   if d.action == policy.WAIT and d.details]  # a placement's wait, not a dependency's or a hold's
        waiting = sorted((j for j in waiting if j is not None and j.state == State.QUEUED and j.spec.gpus == 1),
                         key=lambda j: (-j.spec.priority, j.submitted_at, j.id))[:RECLAIM_FRONT]
        if not waiting:
            return
        views = [g for g in self.gpus.views(in_use=True) if g.in_service]
        free = policy.free_budget(views, self._placed(now))
        holders = self._holders(now)
        plan: list[tuple[Job, list[int]]] = []
        for front in waiting:
            allowed = {g.uuid for g in views if policy.gpu_allowed(g, front.spec.gpu_ids, front.spec.gpu_type)}
            gpu, victims = policy.suspend_victims(front.spec.gpu_mem, front.spec.priority, holders,
                                                  {u: v for u, v in free.items() if u in allowed})
            if gpu is None:
                continue
            budgets = {h.job_id: h.budget for h in holders}
            free[gpu] += sum(budgets[v] for v in victims) - front.spec.gpu_mem  # as if it were placed there
            holders = [h for h in holders if h.job_id not in victims]
            if victims:
                plan.append((front, victims))
        for front, victims in plan:
            for victim in victims:
                job = self.table.open.get(victim)
                if job is None:
                    continue
                try:
                    await self.suspend(job, f"colo (job {front.id} waits for its memory)")
                except SuspendRefused as e:
                    self._skip[victim] = now + 300.0
                    log.info("job %d: not suspended for job %d: %s", victim, front.id, e)
                    return

    def note(self, job_id: int) -> str | None:
        """What `ls`, `show` and `explain` say of a suspended job."""
        job = self.table.open.get(job_id)
        rec = record_of(job) if job is not None else None
        if rec is None:
            return None
        if rec.phase == "suspending":
            return "being suspended" + ("; resume asked: restored once the suspend is done" if rec.wanted else "")
        if rec.phase == "resuming":
            return "being resumed"
        held = f"suspended by {rec.by}: {format_size(rec.bytes)} in host memory"
        if rec.wanted is None:
            return f"{held} (colo resume {job_id})"
        return f"{held}; resume asked, {self.waits.get(job_id, 'restoring')}"

    # restart -----------------------------------------------------------------------------------
    async def recover(self) -> None:
        """At the daemon's start: a step cut short by the daemon's end is finished or undone, so
        no job stays locked. A suspended job stays suspended (and resumable)."""
        for job in self.table.jobs_in(State.RUNNING):
            rec = record_of(job)
            if rec is None:
                continue
            if rec.phase == "suspended":
                await self._tell_gate(job.id, interposer.SUSPENDED | (self._word(job.id) & interposer.RESUME_WANTED))
                rc, out = await self._ckpt_own("suspend", job, rec.pids)  # idempotent: finishes a half-done step
                if rc != 0:
                    log.warning("job %d: its suspend could not be made whole again: %s", job.id, out.strip())
                continue
            # suspending or resuming: undone or finished alike by a resume (restore what is
            # checkpointed, unlock what is locked)
            rc, out = await self._ckpt_own("resume", job, rec.pids)
            if rc == 0:
                self._store(job.id, None)
                await self._tell_gate(job.id, 0)
                self._note(job, f"{'suspend' if rec.phase == 'suspending' else 'resume'} cut short by the daemon's "
                                "restart: resumed")
            else:
                rec.phase, rec.wanted, rec.at = "suspended", rec.wanted or time.time(), time.time()
                self._store(job.id, rec)
                log.warning("job %d: left suspended after a restart (its resume waits): %s", job.id, out.strip())

    def figures(self) -> tuple[dict[str, int], dict]:
        """For the metrics: bytes held in host memory per GPU, and the counts since the start."""
        per_gpu: dict[str, int] = {}
        for j in self.table.jobs_in(State.RUNNING):
            if (r := record_of(j)) and r.phase != "suspending":
                for u in j.gpus:
                    per_gpu[u] = per_gpu.get(u, 0) + r.bytes // max(len(j.gpus), 1)
        return per_gpu, dict(self.counts)
