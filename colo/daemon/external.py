"""Jobs that Slurm started on this node, registered by colo's SPANK plugin (native/slurm).

Slurm decides which node and how much GPU memory (the count-only `gpumem` GRES); colo, on the
node, decides which GPU and MPS or time-sliced with the same plan() as for its own jobs
(policy.place_now: a job Slurm already started cannot wait), and gives it the same ledger,
interposer and MPS pipe (launchspec.build_launch). Such a job is an ordinary row in colo's store
with `spec.slurm_job` set, so `colo ls`, `top`, `show` and profile learning treat it like any
other; its "runtime" below only follows it, because Slurm starts and kills its processes.

Only root may use these ops (slurmstepd and slurmd run the plugin as root); every value comes
from Slurm (job id, uid, gid, the gpumem count from slurmctld), except the profile name, which is
the user's own choice as with `colo submit --profile`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import signal
import stat
import subprocess
import threading
import time

from ..config import Config
from ..jobs import ACTIVE, Job, JobSpec, Mode, State
from ..node import interposer
from ..runtimes.base import Gone, StartError
from ..sched import policy
from ..units import format_size
from .jobtable import JobTable
from .validate import NAME

log = logging.getLogger("colo")
STILL_THERE = 30.0  # seconds between asking Slurm whether a followed job still exists
_ALIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "PENDING", "REQUEUED", "RESIZING"}


class Refused(Exception):
    """One line for the plugin, which shows it to the user and fails the step."""


def _handle(slurm_job: int, job_id: int) -> str:
    return f"slurm:{slurm_job}:{job_id}"


def _parse(handle: str) -> tuple[int, int]:
    _, sj, jid = handle.split(":")
    return int(sj), int(jid)


def slurm_state(slurm_job: int) -> str | None:
    """The job's state as slurmctld tells it ("RUNNING", ...); "" when Slurm no longer knows it;
    None when Slurm cannot be asked (then nothing is concluded)."""
    try:
        r = subprocess.run(["squeue", "-h", "-j", str(slurm_job), "-o", "%T"], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return "" if "invalid job id" in r.stderr.lower() else None
    return r.stdout.strip().upper()


def _safe_ledger(path) -> interposer.Ledger | None:
    """The ledger in a folder the job's user can write: no symlink, no FIFO, a regular file only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return interposer.read_ledger(f"/proc/self/fd/{fd}")  # the very file checked above
    except (OSError, interposer.LedgerError):
        return None
    finally:
        os.close(fd)


class SlurmRuntime:
    """How colo follows a Slurm job: it ends when the plugin's epilog says so (or when Slurm no
    longer knows it); `colo cancel` asks Slurm to cancel it; its processes are those that hold a
    slot in its ledger (their pids come from the kernel's lock table, not from the job)."""

    cleanup_in_background = False  # a dict entry and a file: nothing to wait for

    def __init__(self, config: Config, table: JobTable):
        self.config = config
        self.table = table
        self._lock = threading.Lock()
        self._ends: dict[int, tuple[threading.Event, list]] = {}  # slurm job -> (ended, [exit code])

    def _slot(self, slurm_job: int) -> tuple[threading.Event, list]:
        with self._lock:
            return self._ends.setdefault(slurm_job, (threading.Event(), []))

    def ended(self, slurm_job: int, code: int) -> None:
        ev, box = self._slot(slurm_job)
        box[:] = [code]
        ev.set()

    def start(self, launch) -> str:
        raise StartError("Slurm jobs are started by Slurm, not by colo")

    def wait(self, handle: str) -> int:
        sj, _ = _parse(handle)
        ev, box = self._slot(sj)
        while not ev.wait(STILL_THERE):
            if slurm_state(sj) == "":
                raise Gone(f"Slurm job {sj} ended without colo's epilog telling it")
        return box[0]

    def poll(self, handle: str) -> int | None:
        sj, _ = _parse(handle)
        ev, box = self._slot(sj)
        if ev.is_set():
            return box[0]
        st = slurm_state(sj)
        if st == "" or (st and st not in _ALIVE):
            raise Gone(f"Slurm job {sj} ended while colo was down")
        return None

    def exit_note(self, handle: str) -> str:
        return ""

    def stop(self, handle: str, grace: float) -> None:
        sj, _ = _parse(handle)
        r = subprocess.run(["scancel", str(sj)], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise StartError(f"scancel {sj}: {r.stderr.strip() or r.returncode}")

    def adopt(self) -> dict[int, str]:
        return {}

    def pids(self, handle: str) -> list[int]:
        _, jid = _parse(handle)
        try:
            uid = self.table.job(jid).uid
        except KeyError:
            return []
        led = _safe_ledger(self.config.run_dir(jid) / "ledger")
        out = []
        for p in (led.processes if led else []):
            pid = p.get("host_pid")
            try:
                if pid and os.stat(f"/proc/{pid}").st_uid == uid:  # the job's own user's process
                    out.append(pid)
            except OSError:
                pass
        return out

    def cgroup_paths(self, handle: str) -> dict[str, str]:
        return {}  # Slurm's cgroup, not colo's: its processes are those holding its ledger's slots

    def cleanup(self, handle: str) -> None:
        sj, jid = _parse(handle)
        with self._lock:
            self._ends.pop(sj, None)
        try:
            _env_path(self.config, jid).unlink()
        except OSError:
            pass


# ---- the ops ---------------------------------------------------------------------------------

def _int(args: dict, key: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    v = args.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise Refused(f"malformed {key}: {v!r}")
    return v


def find(table: JobTable, slurm_job: int) -> Job | None:
    for j in table.open.values():
        if j.spec.slurm_job == slurm_job:
            return j
    return None


def _env_path(config: Config, job_id: int):
    return config.state_dir / "slurm" / f"{job_id}.json"


class External:
    """The `slurm` op's actions. One per daemon (api.Api keeps it). Calls the daemon's parts as
    a request handler does: the job table, the GPUs, the scheduler (placement now, its
    decisions), the learner (profiles) and the launcher (what to start it with, following it)."""

    def __init__(self, daemon):
        self.d = daemon
        self._starting: dict[int, asyncio.Future] = {}  # slurm job -> its env, while it is placed

    @property
    def rt(self) -> SlurmRuntime:
        return self.d.engines.get("slurm")

    async def handle(self, args: dict) -> dict:
        action = args.get("action")
        if action == "attach":
            return await self.attach(args)
        if action == "batch_exit":
            return await self.batch_exit(args)
        if action == "end":
            return await self.end(args)
        raise Refused(f"unknown slurm action {action!r}")

    async def attach(self, args: dict) -> dict:
        """A step of Slurm job `job` starts here: place the job (once), return its tasks' env."""
        d = self.d
        sj = _int(args, "job", 1, 1 << 32)
        uid, gid = _int(args, "uid", 0, 1 << 32), _int(args, "gid", 0, 1 << 32)
        gpu_mem = _int(args, "gpu_mem")
        profile = args.get("profile")
        if profile is not None and (not isinstance(profile, str) or not NAME.match(profile)):
            raise Refused(f"malformed profile name {profile!r}: letters, digits, . _ - (at most 64)")
        if sj in self._starting:
            return {"job": None, "env": await asyncio.shield(self._starting[sj])}
        job = find(d.table, sj)
        if job is not None:
            if job.uid != uid:
                raise Refused(f"Slurm job {sj} is known to colo as {job.user}'s")
            return {"job": job.id, "env": self._load_env(job.id)}
        if gpu_mem == 0:  # asked for no GPU memory: it gets no GPU (its memory is nobody's budget)
            return {"job": None, "env": {"CUDA_VISIBLE_DEVICES": ""}}
        if d.gpus.error:
            raise Refused(d.gpus.error)
        views = d.gpus.views(in_use=True)  # less memory held outside any budget (the patrol)
        bound = args.get("gpu_index") or []
        if not isinstance(bound, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in bound):
            raise Refused(f"malformed gpu_index: {bound!r}")
        if bound:  # Slurm bound GPUs to it (gres/gpu): colo places it on exactly those
            views = [v for v in views if v.index in bound]
            if len(views) != len(set(bound)):
                raise Refused(f"Slurm gave it GPUs {bound}, colo sees GPUs {[v.index for v in d.gpus.views()]}")
        ngpus = max(1, len(views) if bound else 1)
        per_gpu = gpu_mem // ngpus  # gpumem is the job's on this node, spread over its GPUs
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
        spec = JobSpec(argv=["slurm", str(sj)], name=f"slurm-{sj}", gpu_mem=per_gpu, gpus=ngpus,
                       profile=profile, slurm_job=sj)
        now = time.time()
        cand = policy.Candidate(0, per_gpu, ngpus, uid, 0, 0, d.learner.profile_of(Job(0, spec, uid, gid, user)))
        dec = policy.place_now(cand, views, d.scheduler.placed(now), d.cfg_policy)
        if dec.action != policy.START:
            raise Refused(f"no GPU on this node can hold its gpumem budget of {format_size(per_gpu)} now: {dec.reason}")
        fut = self._starting[sj] = asyncio.get_running_loop().create_future()
        try:
            env = await self._start(spec, uid, gid, user, dec)
        except BaseException as e:
            fut.set_exception(Refused(str(e)))
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waits
            raise
        else:
            fut.set_result(env)
        finally:
            self._starting.pop(sj, None)
        return {"job": env.get("COLO_JOB_ID"), "env": env}

    async def _start(self, spec: JobSpec, uid: int, gid: int, user: str, dec: policy.Decision) -> dict:
        d = self.d
        job = d.table.add(spec, uid, gid, user)  # then at once STARTING: the scheduler never sees it queued
        dec = policy.Decision(job.id, dec.action, dec.gpus, dec.mode, dec.reason, dec.details, dec.thread_pct)
        d.scheduler.record([dec])
        handle = _handle(spec.slurm_job, job.id)
        job = d.table.transition(job.id, State.STARTING, f"started by Slurm (job {spec.slurm_job}): {dec.reason}",
                           gpus=list(dec.gpus), mode=Mode(dec.mode or "timesliced"), attempts=1, handle=handle)
        try:
            launch = await asyncio.to_thread(d.launcher.build_launch, job, dec)
            env = dict(launch.env)
            await asyncio.to_thread(self._save_env, job.id, env)
        except Exception as e:  # noqa: BLE001 - the step fails with this line; the job is not left starting
            reason = f"failed to start: {e}"
            d.table.transition(job.id, State.FAILED, reason)
            d.launcher.finish(job.id)
            raise Refused(reason) from None
        d.table.transition(job.id, State.RUNNING, f"running under Slurm (job {spec.slurm_job})")
        d.launcher.adopt(job.id, handle)
        return env

    def _save_env(self, job_id: int, env: dict) -> None:
        """Kept where only root can write: later steps of the job get the very same environment."""
        p = _env_path(self.d.config, job_id)
        p.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(env, f)
        os.replace(tmp, p)

    def _load_env(self, job_id: int) -> dict:
        try:
            return json.loads(_env_path(self.d.config, job_id).read_text())
        except (OSError, ValueError) as e:
            raise Refused(f"colo job {job_id}: its environment is gone ({e})") from None

    async def _terminate_clients(self, job: Job) -> bool:
        """terminate_client for every MPS client of the job still attached; Slurm kills them next."""
        if job.mode != Mode.MPS or not job.gpus or not job.handle:
            return True
        pids = await asyncio.to_thread(self.rt.pids, job.handle)
        if not pids:
            return True
        return await asyncio.to_thread(self.d.gpus.mps.terminate_then, job.gpus[0], pids, lambda: None)

    async def batch_exit(self, args: dict) -> dict:
        """The batch script ended (by itself, scancel or a time limit): whatever the job still runs
        is killed by Slurm next, so its MPS clients are terminated first (invariant 6)."""
        sj = _int(args, "job", 1, 1 << 32)
        job = find(self.d.table, sj)
        if job is None:
            return {"job": None}
        ok = await self._terminate_clients(job)
        return {"job": job.id, "terminated": ok}

    async def end(self, args: dict) -> dict:
        """Every process of the job is gone (Slurm's epilog): record its end, learn its profile."""
        sj = _int(args, "job", 1, 1 << 32)
        code = _int(args, "exit_code", 0, 255)
        sig = _int(args, "signal", 0, 64)
        job = find(self.d.table, sj)
        if job is None or job.state not in ACTIVE:
            return {"job": None}
        await self._terminate_clients(job)  # normally none is left; if one is, it goes cleanly
        if sig in (signal.SIGTERM, signal.SIGKILL) and not job.cancel_by:
            self.d.table.set_fields(job.id, cancel_by=f"Slurm (signal {sig}: scancel, time limit or preemption)")
        self.rt.ended(sj, 128 + sig if sig else code)  # follow() records it; cleanup() drops the env
        return {"job": job.id}
