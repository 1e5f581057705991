"""One handler per request op: dispatch and the job operations. Each checks who is asking
(SO_PEERCRED) before it looks. What a submit must pass is admission.py's; what `ls`, `top` and
`gpus` send is listing.py's."""
from __future__ import annotations

import asyncio
import logging
import os
import pwd
import resource
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

from .. import __version__, logtimes, protocol
from .. import report as rp
from ..jobs import ARRAY_FIELDS, TERMINAL, Job, JobSpec, Mode, State
from ..runtimes.base import EngineError, Gone, Unavailable
from ..store import NotFound
from ..units import format_size_exact
from . import logread, session, validate
from .errors import ApiError
from .external import External, Refused
from .listing import ENDED
from .slices import Pieces
from .suspend import SuspendRefused, held_span
from .validate import Caller, is_admin

if TYPE_CHECKING:
    from ..replies import AdminLogReply, GpusReply, JobSummary
    from .core import Daemon

__all__ = ["ATTACHED", "STREAMS", "Api", "ApiError"]

log = logging.getLogger("colo")


def job_id_arg(args: dict) -> int:
    v = args.get("id")
    try:
        protocol.check_args("show", {"id": v})  # the one rule for ids (protocol.ARGS)
    except protocol.ProtocolError as e:
        raise ApiError(str(e), e.code) from None
    return v


class Api:
    """Dispatch and the job operations. Owns the cancels whose stop goes on in the background and
    which jobs `requeue` copied (for `wait`); the listings and the admission checks are the
    daemon's parts `listing` and `admission`."""

    def __init__(self, daemon: "Daemon"):
        self.d = daemon
        self.external = External(daemon)
        self._copies = 0  # copies `requeue` made: a wait looks for new ones when this changes
        self._copied: set[int] = set()  # jobs `requeue` made a copy of (since the daemon started)
        self._stops: set[asyncio.Task] = set()  # cancels whose stop is under way (kept referenced)
        self.listing, self.admission = daemon.listing, daemon.admission

    def _job(self, args: dict) -> Job:
        job_id = job_id_arg(args)
        try:
            return self.d.store.get(job_id)
        except NotFound:
            raise ApiError(f"no job {job_id}", protocol.NOT_FOUND) from None

    def _own(self, job: Job, caller: Caller, verb: str) -> Job:
        if job.uid != caller.uid and not is_admin(caller, self.d.config.admin_group):
            raise ApiError(f"job {job.id} belongs to {job.user}; you may not {verb} it", protocol.FORBIDDEN)
        return job

    def _acted(self, caller: Caller, job: Job, action: str, why: str = "") -> None:
        """An action on another user's job (only root and the admin group may): in the admin log."""
        if job.uid != caller.uid:
            self.d.store.log_admin(caller.user, action, f"job {job.id} of {job.user}", why)

    def summary(self, job: Job, reasons: dict[int, str] | None = None) -> JobSummary:
        return self.listing.summary(job, reasons)

    def reason(self, job: Job, decided: str | None = None) -> str:
        return self.listing.reason(job, decided)

    def reasons(self, jobs: list[Job]) -> dict[int, str]:
        return self.listing.reasons(jobs)

    # ops ----------------------------------------------------------------------------------------
    async def hello(self, caller: Caller, args: dict) -> dict:
        out = {"version": __version__, "protocol": protocol.VERSION, "uid": caller.uid, "user": caller.user,
               "admin": is_admin(caller, self.d.config.admin_group), "gpu_error": self.d.gpus.error,
               "docker_error": self.d.engines.docker_away(), "fake_gpu": self.d.config.fakegpu_state is not None}
        if args.get("detail"):
            out["node"] = await self._node()
        return out

    async def _node(self) -> dict:
        """What the daemon runs on, for `colo doctor`: its GPUs (simulated or real), MPS, how
        container jobs get GPUs, the limits users meet."""
        d, c = self.d, self.d.config
        m = d.gpus.mps
        docker = d.engines.get("docker")
        if docker is None or docker.down:
            containers = {"via": None, "detail": d.engines.docker_away() or "no Docker engine"}
        elif c.fakegpu_state is not None:
            containers = {"via": "simulated", "detail": "jobs on simulated GPUs need nothing of the engine"}
        else:
            access = await asyncio.to_thread(docker.gpu_access)
            containers = {"via": access.via, "detail": access.detail}
        return {"gpus": [{"index": g.index, "name": g.name, "total": g.total, "compute_mode": g.compute_mode,
                          "error": g.error, "drained": d.gpus.drained.get(g.uuid)} for g in d.gpus.devices],
                "simulated": c.fakegpu_state is not None,
                "mps": {"available": m.available(), "why_not": None if m.available() else m.unavailable_reason,
                        "multi_user": c.multi_user_mps, "used": d.cfg_policy.use_mps},
                "containers": containers,
                "limits": {"reserve": c.reserve, "max_queued_per_user": c.max_queued_per_user,
                           "max_running_per_user": c.max_running_per_user,
                           "max_gpu_mem_per_user": c.max_gpu_mem_per_user, "max_user_priority": c.max_user_priority,
                           "slowdown_bound": c.slowdown_bound, "patrol_kill": c.patrol_kill,
                           "patrol_grace": c.patrol_grace, "max_connections_per_user": c.max_connections_per_user,
                           "max_streams_per_user": c.max_streams_per_user, "job_tasks": c.job_tasks,
                           "max_job_tasks": c.max_job_tasks, "tasks_bounded": "pids" in getattr(d.cgroups, "limits", {}),
                           "open_files": resource.getrlimit(resource.RLIMIT_NOFILE)[0]},  # (RLIM_INFINITY: -1)
                "metrics": c.metrics_listen}

    async def submit(self, caller: Caller, args: dict, tty: bool = False, detached: bool = False,
                     pipe: bool = False) -> dict:
        """tty: a session's job (op `session`), which starts on the terminal the daemon made for it;
        detached: one started with --detach; pipe: one on pipes instead (colo run fed from a pipe)."""
        s = await self.admission.submission(caller, args.get("spec"), tty, detached, pipe)
        if s.indices is None:
            return self.summary(self.d.table.add(s.spec, caller.uid, caller.gid, caller.user, held_by=s.held_by))
        jobs = self.d.table.add_array(s.spec, s.indices, s.limit, caller.uid, caller.gid, caller.user,
                                      held_by=s.held_by)
        return {**self.summary(jobs[0]), "tasks": [j.id for j in jobs]}  # the array's id is its first task's

    def _queued(self, args: dict, caller: Caller, verb: str, done: str) -> Job:
        job = self._own(self._job(args), caller, verb)
        if job.state != State.QUEUED:
            raise ApiError(f"job {job.id} is {job.state}: only a queued job may be {done}", protocol.INVALID)
        return job

    async def hold(self, caller: Caller, args: dict) -> dict:
        """Keep a queued job from starting until it is released (as Slurm's scontrol hold)."""
        job = self._queued(args, caller, "hold", "held")
        if job.held_by and not validate.takes_over(job.user, job.held_by, caller):
            return self.summary(job)
        job = self.d.table.change_queued(job.id, f"held by {caller.user}", held_by=caller.user)
        self._acted(caller, job, "hold")
        return self.summary(job)

    async def release(self, caller: Caller, args: dict) -> dict:
        job = self._queued(args, caller, "release", "released")
        if not job.held_by:
            raise ApiError(f"job {job.id} is not held", protocol.INVALID)
        if why := validate.lift_refusal(job.id, job.user, job.held_by, caller, self.d.config.admin_group, "held"):
            raise ApiError(why, protocol.FORBIDDEN)
        job = self.d.table.change_queued(job.id, f"released by {caller.user}", held_by=None)
        self._acted(caller, job, "release")
        return self.summary(job)

    async def edit(self, caller: Caller, args: dict) -> dict:
        """Change a queued job's budget, priority or name; checked as a submit is."""
        job = self._queued(args, caller, "edit", "edited")
        changes = args.get("changes")
        if not isinstance(changes, dict) or not changes or set(changes) - {"gpu_mem", "priority", "name"}:
            raise ApiError("edit takes gpu_mem, priority and name", protocol.BAD_REQUEST)
        if "gpu_mem" in changes and not job.spec.gpus:
            raise ApiError(f"job {job.id} uses no GPU: --gpu-mem does not apply", protocol.INVALID)
        raw = {**job.spec.to_dict(), **changes}
        raw.pop("mounts")  # checked as the owner at submit; unchanged, and not re-read as whoever edits
        raw.pop("slurm_job", None)
        raw.pop("asked_mem", None)  # the daemon's (None while queued)
        kept = {k: raw.pop(k, None) for k in (*ARRAY_FIELDS, "copy_of", "tty", "detached", "pipe")}  # the daemon's, not the submitter's
        spec = self.admission.edited(caller, raw)
        spec.mounts = job.spec.mounts
        for k, v in kept.items():
            setattr(spec, k, v)
        await self.admission.admit(spec, caller, job.user, job.uid, queued=True)
        job = self.d.table.job(job.id)  # the checks may have waited: is it still queued?
        if job.state != State.QUEUED:
            raise ApiError(f"job {job.id} is {job.state}: only a queued job may be changed", protocol.INVALID)
        said = [f"{k} {_shown(k, getattr(job.spec, k))} -> {_shown(k, getattr(spec, k))}" for k in sorted(changes)
                if getattr(job.spec, k) != getattr(spec, k)]
        if not said:
            return self.summary(job)
        self._acted(caller, job, "edit", ", ".join(said))
        return self.summary(self.d.table.change_queued(job.id, f"edited by {caller.user}: {', '.join(said)}",
                                                       spec=spec))

    async def requeue(self, caller: Caller, args: dict) -> dict:
        """An ended job submitted again as a new job (a new id; the ended one stays in the history)."""
        job = self._own(self._job(args), caller, "requeue")
        if job.state not in TERMINAL:
            raise ApiError(f"job {job.id} is {job.state}: only an ended job can be requeued", protocol.INVALID)
        if job.spec.slurm_job is not None:
            raise ApiError(f"job {job.id} was a Slurm job: submit it to Slurm again", protocol.INVALID)
        if job.spec.tty:
            raise ApiError(f"job {job.id} was a session on a terminal that is gone: start it again with colo shell "
                           "or colo run", protocol.INVALID)
        spec = JobSpec.from_dict({**job.spec.to_dict(), "copy_of": job.id}).as_asked()  # not what --grow gave the last run
        await self.admission.admit(spec, caller, job.user, job.uid)
        new = self.d.table.add(spec, job.uid, job.gid, job.user,
                             reason=f"requeued by {caller.user} as a copy of job {job.id}")
        self._copies += 1  # waits on the ended job follow the copy
        self._copied.add(job.id)
        return self.summary(new)

    async def clean(self, caller: Caller, args: dict) -> dict:
        """Remove ended jobs with what is stored of them and their logs (retention.py): those
        `refs` name, each of which must be the caller's (root and admins: anyone's) and removable,
        else nothing is removed; or without refs, every removable ended job of the caller (of
        `users`: root and admins) in `states` that ended before `before`. Types: protocol.ARGS."""
        d = self.d
        admin = is_admin(caller, d.config.admin_group)
        users, refs, before = args.get("users"), args.get("refs"), args.get("before")
        states = [State(s) for s in args["states"]] if args.get("states") else list(TERMINAL)
        if users and not admin and set(users) != {caller.user}:
            raise ApiError("only root and the admin group may clean other users' jobs", protocol.FORBIDDEN)
        if not refs:
            mine = not (admin and users)  # the caller's own: their name (the jobs_user index) and uid
            removed, kept = await d.retention.remove_where(states, before, [caller.user] if mine else users,
                                                 caller.uid if mine else None)
            return {"removed": removed, "kept": kept}
        # every named job checked before any is removed: a wrong name removes nothing
        rows = d.store.listing(["id", "uid", "user", "state", "array_job", "ended_at", "name", "array"], State,
                               refs=refs)  # one query, the store's rule for refs (as ls)
        if not admin:  # a name (or 12_3) means the caller's own jobs; an id of another's is refused below
            ids = {int(r) for r in refs if r.isascii() and r.isdigit()}
            rows = [r for r in rows if r[1] == caller.uid or r[0] in ids or r[4] in ids]
        named = {str(v) for r in rows for v in (r[0], r[4], r[6], r[7]) if v is not None}
        for ref in refs:
            if (str(int(ref)) if ref.isascii() and ref.isdigit() else ref) not in named:  # 007 is job 7
                raise ApiError(f"no job {ref!r}" + ("" if admin else " of yours") + ": give a job id, ARRAY_INDEX "
                               "(12_3), an array's id or a job's name", protocol.NOT_FOUND)
        kept_now, picked = d.retention.kept_now(), {}
        for job_id, uid, user, state, array_job, ended_at, _, _ in rows:
            if uid != caller.uid and not admin:
                raise ApiError(f"job {job_id} belongs to {user}; you may not clean it", protocol.FORBIDDEN)
            if state not in ENDED:
                raise ApiError(f"job {job_id} is {state}: only ended jobs are cleaned (colo cancel it first); "
                               "nothing was removed", protocol.INVALID)
            if why := d.retention.why_kept(job_id, array_job, kept_now):
                raise ApiError(f"{why}; nothing was removed", protocol.INVALID)
            if (state in states and (before is None or (ended_at is not None and ended_at < before))
                    and (not users or user in users)):
                picked[job_id] = array_job
        removed, kept = await d.retention.remove_ended(sorted(picked.items()))
        return {"removed": removed, "kept": kept}

    async def ls(self, caller: Caller, args: dict) -> Pieces:
        """Jobs oldest first, filtered as `args` say (listing.Listing.ls), made and sent in slices."""
        return self.listing.ls(args)

    async def show(self, caller: Caller, args: dict) -> dict:
        job = self._own(self._job(args), caller, "see the details of")
        out = self.summary(job, self.reasons([job]))
        out["spec"] = job.spec.to_dict()
        ids = [*job.spec.after, *job.spec.after_any, *job.spec.after_fail]
        out["dep_states"] = {str(i): str(self.d.table.state_of(i) or "removed") for i in ids[:100]}
        out["events"] = self.d.store.events(job.id)
        out["decision"] = self.d.scheduler.explain(job.id)
        out["log"] = str(self.d.config.log_path(job.id))
        out["attempts"] = job.attempts
        if job.started_at and job.gpus:  # its time suspended (colo suspend): not counted as GPU use
            end = job.ended_at or time.time()
            held_from, held_to = held_span(job, end)
            out["off_gpu"] = end - job.started_at - (held_to - held_from)
        return out

    async def explain(self, caller: Caller, args: dict) -> dict:
        job = self._own(self._job(args), caller, "see the details of")
        dec = self.d.scheduler.explain(job.id)
        reason = job.reason
        if job.state == State.QUEUED and job.held_by:
            held = self.listing.reason(job)
            return {"id": job.id, "state": str(job.state), "reason": held,
                    "decision": {**(dec or {}), "action": "wait", "reason": held}}
        if job.state == State.RUNNING and (note := self.d.suspender.note(job.id)):
            return {"id": job.id, "state": "suspended", "decision": dec, "reason": note}
        if note := self.d.patrol.note(job.id):
            reason = f"{reason}; {note}"
            if dec is not None:
                dec = {**dec, "reason": f"{dec['reason']}; {note}"}
        return {"id": job.id, "state": str(job.state), "decision": dec, "reason": reason}

    async def cancel(self, caller: Caller, args: dict) -> dict:
        job = self._own(self._job(args), caller, "cancel")
        if job.state in TERMINAL:
            raise ApiError(f"job {job.id} already ended ({job.state})", protocol.INVALID)
        # The stop (SIGTERM, the grace period, SIGKILL) goes on in the background: a cancel returns
        # at once, so cancelling several jobs that ignore SIGTERM takes one grace period, not one
        # each (issue 16). The cancel itself is stored before this returns (Launcher.cancel).
        self._acted(caller, job, "cancel", f"it was {job.state}")
        task = self.stop_later(self.d.launcher.cancel(job.id, caller.user))
        await asyncio.sleep(0)  # the task runs to its first wait: cancel_by is stored, the stop begun
        if not task.done():
            await asyncio.wait({task}, timeout=0.05)
        return self.summary(self.d.table.job(job.id))

    def stop_later(self, stop) -> asyncio.Task:
        """A cancel's stop (the coroutine `stop`), carried on in the background and kept referenced."""
        task = asyncio.create_task(stop)
        self._stops.add(task)
        task.add_done_callback(self._stop_done)
        return task

    def _stop_done(self, task: asyncio.Task) -> None:
        self._stops.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("stopping a cancelled job failed: %s", task.exception())

    def _running(self, args: dict, caller: Caller, verb: str, done: str) -> Job:
        job = self._own(self._job(args), caller, verb)
        if job.state != State.RUNNING or not job.handle:
            raise ApiError(f"job {job.id} is {job.state}: only a running job can be {done}", protocol.INVALID)
        if job.spec.slurm_job is not None:
            raise ApiError(f"job {job.id} is Slurm job {job.spec.slurm_job}: ask Slurm (scontrol, scancel)",
                           protocol.INVALID)
        if job.cancel_by:
            raise ApiError(f"job {job.id} is being stopped (cancelled by {job.cancel_by})", protocol.INVALID)
        return job

    async def _engine(self, job: Job, act):
        try:
            return await act
        except (EngineError, Unavailable) as e:
            raise ApiError(f"job {job.id}: {e}", protocol.UNAVAILABLE if isinstance(e, Unavailable)
                           else protocol.INVALID) from None
        except Gone:
            raise ApiError(f"job {job.id} is ending", protocol.INVALID) from None

    async def pause(self, caller: Caller, args: dict) -> dict:
        """Freeze a running job (the launcher's runtime: cgroup freezer, docker pause). Not an MPS
        client: frozen in the middle of a kernel it could stall the GPU's MPS server for the others."""
        job = self._running(args, caller, "pause", "paused")
        if job.paused_by and validate.takes_over(job.user, job.paused_by, caller):  # already frozen
            return self.summary(self.d.table.set_fields(job.id, paused_by=caller.user))
        if job.paused_by:
            return self.summary(job)
        if job.mode == Mode.MPS:
            raise ApiError(f"job {job.id} is an MPS client of GPU {self.listing.gpus_text(job.gpus)}: colo does not pause "
                           "MPS clients (one frozen in the middle of a kernel could stall the MPS server for every "
                           f"other job on that GPU); colo cancel {job.id} stops it", protocol.INVALID)
        job = await self._engine(job, self.d.launcher.pause(job.id, caller.user))
        self._acted(caller, job, "pause")
        return self.summary(job)

    async def drain(self, caller: Caller, args: dict) -> dict:
        return await self.d.drains.drain(caller, args)  # colo/daemon/drain.py

    async def undrain(self, caller: Caller, args: dict) -> dict:
        return await self.d.drains.undrain(caller, args)

    async def suspend(self, caller: Caller, args: dict) -> dict:
        """Its GPU memory to host memory (colo/daemon/suspend.py)."""
        job = self._own(self._job(args), caller, "suspend")
        try:
            job = await self.d.suspender.suspend(job, caller.user)
        except SuspendRefused as e:
            raise ApiError(str(e), protocol.INVALID) from None
        self._acted(caller, job, "suspend")
        return self.summary(job)

    async def resume(self, caller: Caller, args: dict) -> dict:
        job = self._own(self._job(args), caller, "resume")
        if job.state == State.RUNNING and job.suspended:
            try:
                resumed = await self.d.suspender.want_resume(job, caller.user)
            except SuspendRefused as e:
                raise ApiError(str(e), protocol.INVALID) from None
            self._acted(caller, job, "resume", "suspended")
            return self.summary(resumed)
        if job.state != State.RUNNING or not job.paused_by:
            raise ApiError(f"job {job.id} is not paused ({job.state})", protocol.INVALID)
        if why := validate.lift_refusal(job.id, job.user, job.paused_by, caller, self.d.config.admin_group, "paused"):
            raise ApiError(why, protocol.FORBIDDEN)
        resumed = await self._engine(job, self.d.launcher.resume(job.id, caller.user))
        self._acted(caller, job, "resume", f"paused by {job.paused_by}")
        return self.summary(resumed)

    async def gpus(self, caller: Caller, args: dict) -> GpusReply:
        return self.listing.gpu_rows()

    async def top(self, caller: Caller, args: dict) -> Pieces:
        """Everything `colo top` shows, in one snapshot (replies.TopReply), made in slices."""
        return self.listing.top(caller.user)

    async def history(self, caller: Caller, args: dict) -> dict:
        """Ended jobs for `colo history` and `sim --from-history`, filtered and bounded in SQL (a
        server's months of history are never all read): those that ended at or after `since`, of
        `users`, only the newest `limit`; {"jobs": oldest first, "left": how many more matched}.
        Each with its profile's run time alone where known. Only what `history` prints of each
        spec (name, gpus, budget) unless `full` (sim); others' environments and mounts stay private."""
        # types and sizes: protocol.ARGS
        full = bool(args.get("full"))
        rows, left = self.d.store.history(TERMINAL, args.get("since"), args.get("users"), args.get("limit"), full)
        if full and not is_admin(caller, self.d.config.admin_group):
            for row in rows:
                if row["uid"] != caller.uid:
                    row["spec"].update(validate.PRIVATE_SPEC)
        return {"jobs": rows, "left": left}

    async def admin_log(self, caller: Caller, args: dict) -> AdminLogReply:
        """`colo history --admin`: what root, the admin group and colo's fault drains did, newest
        first (root and the admin group only: it names other users' jobs and reasons)."""
        if not is_admin(caller, self.d.config.admin_group):
            raise ApiError("only root and the admin group may read the admin log", protocol.FORBIDDEN)
        rows, left = self.d.store.admin_log(args.get("since"), args.get("limit"))
        return {"actions": rows, "left": left}

    async def report(self, caller: Caller, args: dict) -> dict:
        """`colo report` for the jobs that ended at or after `since`, of `users`: added up in SQL
        (per user) and from the jobs' GPU spans read one at a time, never a row per job in memory."""
        since, users, store, cfg = args.get("since"), args.get("users"), self.d.store, self.d.config
        idle = rp.idle_hours(store.report_samples(TERMINAL, since, users), cfg.idle_after,
                             max(60.0, 5 * cfg.sample_interval))
        return rp.assemble(store.report_users(TERMINAL, since, users), store.report_spans(TERMINAL, since, users), idle)

    async def slurm(self, caller: Caller, args: dict) -> dict:
        """colo's SPANK plugin: a Slurm job's step starts here, its batch script ended, or it ended."""
        if caller.uid != 0:
            raise ApiError("only root (Slurm's colo plugin) may register Slurm jobs", protocol.FORBIDDEN)
        try:
            return await self.external.handle(args)
        except Refused as e:
            raise ApiError(str(e), protocol.INVALID) from None

    # profiles: what the daemon places a user's jobs with ---------------------------------------
    def _profile_uid(self, caller: Caller, args: dict) -> int:
        """Whose view: the caller's own, or (root and admins only) another user's, by name or uid."""
        who = args.get("user")
        if who is None or who == caller.user or who == caller.uid:
            return caller.uid
        if not is_admin(caller, self.d.config.admin_group):
            raise ApiError("only root and the admin group may see another user's profiles", protocol.FORBIDDEN)
        if isinstance(who, int) and not isinstance(who, bool) and 0 <= who < 1 << 32:
            return who
        if isinstance(who, str):
            try:
                return pwd.getpwnam(who).pw_uid
            except KeyError:
                pass
        raise ApiError(f"no user {who!r}", protocol.NOT_FOUND)

    def _profile_name(self, args: dict) -> str:
        from .. import profiles

        name = args.get("name")
        if not isinstance(name, str) or not profiles.valid_name(name):
            raise ApiError(f"malformed profile name {name!r}", protocol.BAD_REQUEST)
        return name

    async def profiles(self, caller: Caller, args: dict) -> list[dict]:
        """Every profile the caller's jobs may run under, each with where it comes from."""
        from .. import profiles

        uid = self._profile_uid(caller, args)

        def collect() -> list[dict]:
            out = []
            for p in self.d.learner.profile_store(uid).ls():
                src = self.d.learner.profile_source(uid, p.name)
                out.append({**p.summary(), "source": src[0] if src else "?"})
            return out

        try:
            return await asyncio.to_thread(collect)
        except profiles.ProfileError as e:
            raise ApiError(str(e), protocol.INVALID) from None

    async def profile(self, caller: Caller, args: dict) -> dict:
        """One profile as the daemon would use it for the caller's next job of that name."""
        from .. import profiles

        uid, name = self._profile_uid(caller, args), self._profile_name(args)

        def one() -> dict | None:
            p = self.d.learner.profile_store(uid).get(name)
            if p is None:
                return None
            src = self.d.learner.profile_source(uid, name)
            return {**p.summary(), "source": src[0] if src else "?", "note": p.note, "text": profiles.dumps(p),
                    "sm": p.sm.tolist(), "mem": p.mem.tolist(), "membw": p.membw.tolist(),
                    "pcie": None if p.pcie is None else p.pcie.tolist()}

        try:
            r = await asyncio.to_thread(one)
        except profiles.ProfileError as e:
            raise ApiError(str(e), protocol.INVALID) from None
        if r is None:
            raise ApiError(f"no profile named {name!r}", protocol.NOT_FOUND)
        r["learned"] = self.d.learner.learned_summary(uid, name)  # on the loop: learning changes it there
        return r

    async def profile_share(self, caller: Caller, args: dict) -> dict:
        """Root or an admin makes a user's own copy of a profile the one everyone's jobs use."""
        from .. import profiles

        if not is_admin(caller, self.d.config.admin_group):
            raise ApiError("only root and the admin group may share a profile with everyone", protocol.FORBIDDEN)
        uid, name = self._profile_uid(caller, args), self._profile_name(args)
        try:
            await asyncio.to_thread(self.d.learner.share_profile, name, uid)
        except (profiles.ProfileError, OSError) as e:
            raise ApiError(str(e), protocol.NOT_FOUND) from None
        return {"name": name, "from_uid": uid, "source": "shared"}

    async def profile_put(self, caller: Caller, args: dict) -> dict:
        """A profile the caller recorded becomes their own copy (learning.put_profile checks it)."""
        from .. import profiles

        try:
            p, replaced = await asyncio.to_thread(self.d.learner.put_profile, caller.uid, args.get("text"))
        except profiles.ProfileError as e:
            raise ApiError(str(e), protocol.INVALID) from None
        except OSError as e:
            raise ApiError(f"could not store the profile: {e.strerror}", protocol.UNAVAILABLE) from None
        self.d.learner.forget_profile(p.name, caller.uid)  # its queued jobs plan with it from the next pass
        return {"name": p.name, "source": "own", "replaced": replaced, "runs": p.runs}

    async def shutdown(self, caller: Caller, args: dict) -> dict:
        if not is_admin(caller, self.d.config.admin_group) and caller.uid != os.geteuid():
            raise ApiError("only root or the daemon's owner may stop the daemon", protocol.FORBIDDEN)
        self.d.stop()
        return {"stopping": True}

    async def signal(self, caller: Caller, args: dict) -> dict:
        """A signal (protocol.SIGNALS) to a running job's main process (passed on by its shim; a container's by the engine): a
        notebook kernel's interrupt (SIGINT), as `scancel --signal` does."""
        job = self._own(self._job(args), caller, "signal")
        if job.state != State.RUNNING or not job.handle:
            raise ApiError(f"job {job.id} is {job.state}: only a running job can be signalled", protocol.INVALID)
        try:
            sent = await self.d.launcher.signal(job.id, job.handle, args["signal"])
        except Gone:
            raise ApiError(f"job {job.id} has ended", protocol.INVALID) from None
        if not sent:
            raise ApiError(f"job {job.id} is a {job.spec.runtime} job: colo signals process and container jobs only",
                           protocol.INVALID)
        self._acted(caller, job, "signal", f"signal {args['signal']}")
        return self.summary(self.d.table.job(job.id))

    # streams --------------------------------------------------------------------------------------
    async def session(self, caller: Caller, args: dict) -> AsyncIterator[Any]:
        """`colo shell`/`colo run`: a job on a terminal colo made for it (colo/daemon/session.py)."""
        try:
            session.check(args["spec"])
        except session.Refused as e:
            raise ApiError(str(e), protocol.INVALID) from None
        async for ev in _refusals(session.attach(self, caller, args["spec"])):
            yield ev

    async def attach(self, caller: Caller, args: dict) -> AsyncIterator[Any]:
        """`colo attach JOB`: a detached session's terminal, to its owner (colo/daemon/detach.py)."""
        async for ev in _refusals(session.reattach(self, caller, self._job(args))):
            yield ev

    async def logs(self, caller: Caller, args: dict) -> AsyncIterator[Any]:
        """The job's output from the start, or its last `tail` lines, or those colo saw at or after
        `since` (epoch seconds); with `timestamps`, events are {"lines": [[at, text], ...]}, `at`
        the time colo first saw the line (colo/logtimes.py), null for the rest of a line begun in
        an earlier event."""
        job = self._own(self._job(args), caller, "read the logs of")
        path = self.d.config.log_path(job.id)
        follow = bool(args.get("follow"))
        tail, since, stamps = args.get("tail"), args.get("since"), bool(args.get("timestamps"))
        if tail is not None and (not isinstance(tail, int) or isinstance(tail, bool) or tail < 0):
            raise ApiError(f"malformed tail {tail!r}: a number of lines, 0 or more", protocol.BAD_REQUEST)
        if since is not None and (not isinstance(since, (int, float)) or isinstance(since, bool)):
            raise ApiError(f"malformed since {since!r}: seconds since the epoch", protocol.BAD_REQUEST)
        seen = logtimes.Seen(path) if (since is not None or stamps) else None

        async def noted(size: int) -> tuple[tuple[list[int], list[float]], float]:
            """The notes, reaching `size` bytes, and the time of lines past them: a live job's
            lines not noted yet are noted as seen now, before they are stamped, so every view of
            a line gives the one time stored for it (colo/logtimes.py); an ended job's, its end."""
            if job.id in self.d.table.open:
                return (await asyncio.to_thread(seen.cover, size)).index, time.time()
            try:
                end = self.d.table.job(job.id).ended_at
            except NotFound:  # removed meanwhile (colo clean)
                end = None
            return (await asyncio.to_thread(seen.read)).index, end or time.time()

        # Never the whole log in memory: it is the job's to fill (colo/daemon/logread.py).
        pos, line_start, fd = 0, True, None
        dec = logread.decoder()  # one for the whole stream: a character may span two reads
        try:
            if path.exists():
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # (not in a thread: a stream ended then would lose it)
            if fd is not None and (tail is not None or since is not None or stamps):
                pos = os.fstat(fd).st_size
                index, fallback = await noted(pos) if seen is not None else (([], []), time.time())

                def bounds() -> tuple[int, int]:
                    start, stop = (logread.since_range(fd, pos, index, since, fallback) if since is not None
                                   else (0, pos))
                    if tail is not None:
                        start = logread.tail_start(fd, start, stop, tail)
                    return start, stop

                start, stop = await logread.settled(bounds)  # a scan back over up to the whole log
                line_start = logread.ends_line(fd, pos)
                for ev in logread.pieces(fd, start, stop, index, fallback, stamps, dec):
                    yield ev
            while True:
                if fd is None and path.exists():
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                size = os.fstat(fd).st_size if fd is not None else 0
                if size > pos:  # read now: written at or before now
                    stop = min(size, pos + (1 << 20))
                    index, at = await noted(stop) if stamps else (([], []), time.time())
                    for ev in logread.pieces(fd, pos, stop, index, at, stamps, dec, line_start):
                        yield ev
                    line_start, pos = logread.ends_line(fd, stop), stop
                    continue
                try:
                    state = self.d.table.job(job.id).state
                except NotFound:  # removed meanwhile (colo clean): what was read is all there is
                    state = None
                if not follow or state is None or state in TERMINAL:
                    if rest := dec.decode(b"", final=True):  # a character the log ends in the middle of
                        yield {"lines": [[None, rest]]} if stamps else {"data": rest}
                    return
                await self.d.table.changed.wait(0.25)  # or new output
        finally:
            if fd is not None:
                os.close(fd)

    async def wait(self, caller: Caller, args: dict) -> AsyncIterator[Any]:
        ids = args.get("ids")
        if not isinstance(ids, list) or not ids:
            raise ApiError("wait needs job ids", protocol.BAD_REQUEST)
        jobs = [self._own(self._job({"id": i}), caller, "wait for") for i in ids]
        yield {"waiting": [j.id for j in jobs]}  # the request is accepted; the client now just waits
        # A job runs again under its own id when the daemon requeues it (a fault, --grow, a cut-short
        # start: never ended meanwhile); `colo requeue` runs an ended one again as a copy with a new
        # id: followed too, so a wait ends when the work is done, with the newest copy's end.
        # An ended job never changes (a copy of it is looked for only when `requeue` made one of it):
        # only open jobs are looked at again. Reading every named job from the store at each change
        # let 100 waits on 300 ended jobs and a running one take 81 s of the daemon's CPU over 10
        # one-second jobs of others (108 s for them, 0.7 s without the waits).
        jobs = [self._newest_copy(j) for j in jobs]
        copies, live = self._copies, None  # live: where in `jobs` the open ones are
        while True:
            if copies != self._copies:
                copies, live = self._copies, None
                jobs = [self._newest_copy(j) if j.id in self._copied else j for j in jobs]
            if live is None:
                live = [k for k, j in enumerate(jobs) if j.state not in TERMINAL]
            for k in live:
                jobs[k] = self.d.table.job(jobs[k].id)
            live = [k for k in live if jobs[k].state not in TERMINAL]
            if not live:
                yield {"final": [{**self.summary(j), **({"waited_for": i} if i != j.id else {})}
                                 for i, j in zip(ids, jobs)]}
                return
            await self.d.table.changed.wait(5)

    def _newest_copy(self, job: Job) -> Job:
        """The job that runs `job`'s work now: its newest `colo requeue` copy, copies of copies followed."""
        while job.state in TERMINAL and (i := self.d.store.newest_copy(job.id)) is not None:
            job = self.d.table.job(i)
        return job


def _shown(field: str, v: Any) -> str:
    return format_size_exact(v) if field == "gpu_mem" else repr(v) if field == "name" else str(v)


STREAMS = {"logs", "wait", "session", "attach"}
ATTACHED = {"session", "attach"}  # streams that end when their client hangs up (server.py)


async def _refusals(events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A session's stream, its refusals as the API's."""
    try:
        async for ev in events:
            yield ev
    except session.Refused as e:
        raise ApiError(str(e), protocol.INVALID) from None
    except PermissionError as e:
        raise ApiError(str(e), protocol.FORBIDDEN) from None
    finally:
        await events.aclose()  # (its own `finally` now: a session's client hung up)
