"""One handler per request op. Each checks who is asking (SO_PEERCRED) before it looks."""
from __future__ import annotations

import asyncio
import bisect
import heapq
import logging
import json
import os
import pwd
import resource
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, AsyncIterator

from .. import __version__, logtimes, protocol
from ..sched import fairshare
from .. import report as rp
from ..jobs import ACTIVE, ARRAY_FIELDS, TERMINAL, Job, JobSpec, Mode, State
from ..sched.policy import can_ever_fit, gpu_allowed, gpu_filter_refusal
from ..runtimes.base import EngineError, Gone, Unavailable
from ..store import NotFound
from ..units import format_size_exact
from . import deps, logread, onend as mail, pin, session
from .external import External, Refused
from .validate import Caller, Forbidden, Invalid, check_spec, is_admin, parse_array

if TYPE_CHECKING:
    from .core import Daemon

log = logging.getLogger("colo")


class ApiError(Exception):
    def __init__(self, message: str, code: str = protocol.INVALID):
        super().__init__(message)
        self.code = code


def job_id_arg(args: dict) -> int:
    v = args.get("id")
    try:
        protocol.check_args("show", {"id": v})  # the one rule for ids (protocol.ARGS)
    except protocol.ProtocolError as e:
        raise ApiError(str(e), e.code) from None
    return v


class Api:
    def __init__(self, daemon: "Daemon"):
        self.d = daemon
        self.external = External(daemon)
        self._copies = 0  # copies `requeue` made: a wait looks for new ones when this changes
        self._copied: set[int] = set()  # jobs `requeue` made a copy of (since the daemon started)
        self._stops: set[asyncio.Task] = set()  # cancels whose stop is under way (kept referenced)
        # job id -> (the Job it was made from, its reason, its summary as JSON): a queued or ended
        # job's row changes only with the job or its reason, so `ls` of 10,000 re-encodes none
        self._rows: dict[int, tuple[Job, str | None, bytes]] = {}
        # the same for ls's compact rows, per (fields, cut) asked for (Api._live_rows, _ended_rows)
        self._ls_rows: dict[tuple, dict[int, tuple[Job, str | None, bytes]]] = {}
        self._ls_ended: dict[tuple, dict[int, bytes]] = {}
        # the queue's ls rows per kind of listing, as of (_queue_version, the scheduler's version)
        self._blocks: dict[tuple, tuple[tuple, list]] = {}
        self._queue_version = 0  # any queued job added, changed or gone
        daemon.table.on_change.append(self._queue_changed)
        daemon.table.on_edit.append(self._queue_changed)

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

    def summary(self, job: Job, reasons: dict[int, str] | None = None) -> dict:
        out = {
            "id": job.id, "name": job.spec.name, "held_by": job.held_by if job.state == State.QUEUED else None, "user": job.user, "uid": job.uid, "state": str(job.state),
            "paused_by": job.paused_by if job.state == State.RUNNING else None,
            "gpus": job.gpus, "gpu_index": self._indices(job.gpus), "mode": self.mode(job), "budget": job.spec.gpu_mem,
            "ngpus": job.spec.gpus, "image": job.spec.image, "argv": job.spec.argv,
            "submitted_at": job.submitted_at, "started_at": job.started_at, "ended_at": job.ended_at,
            "exit_code": job.exit_code, "priority": job.spec.priority, "reason": job.reason,
            "cancel_by": job.cancel_by if job.state in ACTIVE else None,
            "slurm_job": job.spec.slurm_job,
            "array_job": job.spec.array_job, "array_index": job.spec.array_index,
        }
        out["reason"] = self.reason(job, reasons.get(job.id) if reasons is not None else None)
        if job.state in ACTIVE:
            u = self.d.sampler.stats.get(job.id) or self.d.sampler.usage(job)  # the sampler's, or read now
            if u:
                out["used"] = u.get("used")
                out["refused"] = u.get("refused")
                out["sm_util"] = u.get("sm_util")
                out["nvml_used"] = u.get("nvml_used")  # its processes, as NVML sees them (the patrol)
                out["idle_since"] = u.get("idle_since")  # holding GPU memory with no GPU activity since (idle_after)
        return out

    def _indices(self, uuids: list[str]) -> list[int | None]:
        """GPUs by index, as `colo gpus` numbers them (None: one no longer here)."""
        if not uuids:
            return []
        index = {g.uuid: g.index for g in self.d.gpus.devices}
        return [index.get(u) for u in uuids]

    def _gpus_text(self, uuids: list[str]) -> str:
        """ls's GPU column: indices (a UUID's start for a GPU no longer here)."""
        return ",".join(u[:12] if i is None else str(i) for i, u in zip(self._indices(uuids), uuids))

    def mode(self, job: Job) -> str | None:
        return self.d.table.mode_shown(job, {f["gpu"] for f in self.d.patrol.foreign})

    def reason(self, job: Job, decided: str | None = None) -> str:
        """The reason listings show: a queued job's latest decision (`decided`) unless it is held, a
        running job's with what the patrol says of it, or who paused it."""
        if job.state == State.QUEUED:
            if job.held_by:  # said at once, before a pass has looked at it
                return f"held by {job.held_by} (colo release {job.id})"
            return job.reason if decided is None else decided
        if job.state == State.RUNNING and job.paused_by:
            return f"paused by {job.paused_by} (colo resume {job.id})"
        notes = [n for n in (self.d.patrol.note(job.id), self.d.sampler.idle_note(job.id)) if n] \
            if job.state in ACTIVE else []
        return "; ".join([job.reason, *notes])

    def reasons(self, jobs: list[Job]) -> dict[int, str]:
        """Why each queued job waits: the scheduler's latest word."""
        out = {}
        for j in jobs:
            if j.state == State.QUEUED:
                d = self.d.scheduler.decisions.get(j.id)
                if d is not None:
                    out[j.id] = d.reason
        return out

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
                          "error": g.error} for g in d.gpus.devices],
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

    async def submit(self, caller: Caller, args: dict, tty: bool = False) -> dict:
        """tty: a session's job (op `session`), which starts on the terminal the daemon made for it."""
        d = self.d
        protected = [d.config.state_dir, d.config.socket.parent]
        raw = args.get("spec")
        try:
            # --after 12_3, --after prep: made job ids here (deps.py), before the spec is checked
            spec = check_spec(deps.resolved(d.store, raw, caller.user) if isinstance(raw, dict) else raw,
                              caller, protected)
            spec.tty = tty
            array = raw.get("array")
            indices, limit = parse_array(array) if array is not None else (None, None)
            if spec.mail_type and not mail.transfer_agent():
                raise Invalid(f"--mail-type: this node has no mail transfer agent ({mail.WHERE}); ask for a "
                              "command instead: --on-end 'notify-send done' (or any command, run as you)")
        except Invalid as e:
            raise ApiError(str(e), protocol.INVALID) from None
        except Forbidden as e:
            raise ApiError(str(e), protocol.FORBIDDEN) from None
        if spec.mounts:  # opened as the caller now, to say no at once (pinned again at start)
            try:
                await asyncio.to_thread(pin.verify, spec.mounts, caller, d.native / pin.HELPER, protected)
            except Invalid as e:
                raise ApiError(str(e), protocol.INVALID) from None
            except Forbidden as e:
                raise ApiError(str(e), protocol.FORBIDDEN) from None
        await self._admit(spec, caller, caller.user, caller.uid, tasks=len(indices) if indices else 1)
        held = caller.user if raw.get("hold") else None  # submit --hold (sbatch -H)
        if indices is None:
            return self.summary(d.table.add(spec, caller.uid, caller.gid, caller.user, held_by=held))
        jobs = d.table.add_array(spec, indices, limit, caller.uid, caller.gid, caller.user, held_by=held)
        return {**self.summary(jobs[0]), "tasks": [j.id for j in jobs]}  # the array's id is its first task's

    async def _admit(self, spec: JobSpec, caller: Caller, user: str, uid: int, queued: bool = False,
                     tasks: int = 1) -> None:
        """What submit checks beyond the spec's own form, for `user`'s job asked for by `caller` (a
        submit, a requeue, or an edit: `queued`, the job is already counted and its dependencies and
        image were checked)."""
        d = self.d
        top = d.config.max_user_priority
        if spec.priority > top and caller.uid != os.geteuid() and not is_admin(caller, d.config.admin_group):
            raise ApiError(f"--priority {spec.priority} is above {top}, the most a user may set here "
                           f"(max_user_priority); members of {d.config.admin_group or 'no admin group'} and root "
                           "may set more", protocol.FORBIDDEN)
        if (n := spec.tasks) and n > (most := d.config.max_job_tasks) > 0 and not is_admin(caller, d.config.admin_group):
            raise ApiError(f"--tasks {n} is above {most}, the most a job may have here (max_job_tasks); members of "
                           f"{d.config.admin_group or 'no admin group'} and root may ask for more", protocol.FORBIDDEN)
        if not queued and (why := fairshare.submit_refusal(d.scheduler.limits, user,
                                                             d.scheduler.queued_count(uid) + tasks - 1)):
            raise ApiError(why, protocol.FORBIDDEN)
        if spec.gpus:
            if d.gpus.error:
                raise ApiError(d.gpus.error, protocol.INVALID)
            views = [v for v in d.gpus.views() if gpu_allowed(v, spec.gpu_ids, spec.gpu_type)]
            why = (gpu_filter_refusal(spec.gpu_ids, spec.gpu_type, spec.gpus, d.gpus.views())
                   or self._too_big(spec.gpu_mem, spec.gpus, views) or can_ever_fit(spec.gpu_mem, spec.gpus, views))
            if why:
                raise ApiError(f"job can never run here: {why}", protocol.INVALID)
        if queued:
            return
        if spec.image is not None:
            rt = d.engines.get("docker")
            if rt is None:
                raise ApiError(d.engines.docker_error or "no Docker engine", protocol.UNAVAILABLE)
            try:
                here = await asyncio.to_thread(rt.has_image, spec.image)
            except Unavailable as e:
                raise ApiError(f"{e}: container jobs cannot be submitted until it answers again",
                               protocol.UNAVAILABLE) from None
            except EngineError as e:  # it answers, but failed the look (500): nothing is stored
                raise ApiError(f"{e}; try again", protocol.UNAVAILABLE) from None
            if not here:
                raise ApiError(f"image {spec.image!r} not found locally (colo does not pull; "
                               "build or load it first)", protocol.NOT_FOUND)
            if spec.gpus and d.config.fakegpu_state is None and (why := await asyncio.to_thread(rt.gpu_refusal)):
                raise ApiError(why, protocol.INVALID)  # no CDI device, no nvidia runtime: refused now, not at start
        # Last, with no await after it: the caller stores the job before `colo clean` can run, and
        # clean keeps the jobs an open job depends on (retention.py).
        for key in ("after", "after_any", "after_fail"):
            for a in getattr(spec, key):
                try:
                    d.store.get(a)
                except NotFound:
                    raise ApiError(f"--{key.replace('_', '-')} {a}: no such job (never submitted, or removed by "
                                   "colo clean or history_keep_days)", protocol.NOT_FOUND) from None

    def _queued(self, args: dict, caller: Caller, verb: str, done: str) -> Job:
        job = self._own(self._job(args), caller, verb)
        if job.state != State.QUEUED:
            raise ApiError(f"job {job.id} is {job.state}: only a queued job may be {done}", protocol.INVALID)
        return job

    async def hold(self, caller: Caller, args: dict) -> dict:
        """Keep a queued job from starting until it is released (as Slurm's scontrol hold)."""
        job = self._queued(args, caller, "hold", "held")
        if job.held_by:
            return self.summary(job)
        return self.summary(self.d.table.change_queued(job.id, f"held by {caller.user}", held_by=caller.user))

    async def release(self, caller: Caller, args: dict) -> dict:
        job = self._queued(args, caller, "release", "released")
        if not job.held_by:
            raise ApiError(f"job {job.id} is not held", protocol.INVALID)
        return self.summary(self.d.table.change_queued(job.id, f"released by {caller.user}", held_by=None))

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
        kept = {k: raw.pop(k, None) for k in (*ARRAY_FIELDS, "copy_of", "tty")}  # the daemon's, not the submitter's
        try:
            spec = check_spec(raw, caller, [self.d.config.state_dir, self.d.config.socket.parent])
        except (Invalid, Forbidden) as e:
            raise ApiError(str(e), protocol.INVALID) from None
        spec.mounts = job.spec.mounts
        for k, v in kept.items():
            setattr(spec, k, v)
        await self._admit(spec, caller, job.user, job.uid, queued=True)
        job = self.d.table.job(job.id)  # the checks may have waited: is it still queued?
        if job.state != State.QUEUED:
            raise ApiError(f"job {job.id} is {job.state}: only a queued job may be changed", protocol.INVALID)
        said = [f"{k} {_shown(k, getattr(job.spec, k))} -> {_shown(k, getattr(spec, k))}" for k in sorted(changes)
                if getattr(job.spec, k) != getattr(spec, k)]
        if not said:
            return self.summary(job)
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
        await self._admit(spec, caller, job.user, job.uid)
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
            if state not in _ENDED:
                raise ApiError(f"job {job_id} is {state}: only ended jobs are cleaned (colo cancel it first); "
                               "nothing was removed", protocol.INVALID)
            if why := d.retention.why_kept(job_id, array_job, kept_now):
                raise ApiError(f"{why}; nothing was removed", protocol.INVALID)
            if (state in states and (before is None or (ended_at is not None and ended_at < before))
                    and (not users or user in users)):
                picked[job_id] = array_job
        removed, kept = await d.retention.remove_ended(sorted(picked.items()))
        return {"removed": removed, "kept": kept}

    def _too_big(self, budget: int, ngpus: int, views: list) -> str | None:
        """A budget above what any GPU (the job may use) can give, said with exact sizes: usable vs
        asked (issue 16)."""
        views = {v.uuid: v for v in views}
        gpus = sorted(((views[g.uuid].usable, g.total) for g in self.d.gpus.devices if g.uuid in views),
                      reverse=True)
        if not ngpus or len(gpus) < ngpus or gpus[ngpus - 1][0] >= budget:
            return None
        usable, total = gpus[ngpus - 1]
        kept = total - usable
        return (f"--gpu-mem {format_size_exact(budget)} is more than a GPU here can give: "
                f"{format_size_exact(usable)} is usable on the largest ({format_size_exact(total)} total"
                + (f", less the {format_size_exact(kept)} colo keeps back, `reserve` in its config)" if kept else ")")
                + f"; ask for {format_size_exact(usable)} or less")

    def rows(self, jobs: list[Job]) -> protocol.Raw:
        """The summaries of `jobs` as one JSON array; rows of jobs that are not running are cached."""
        cache, decisions, parts = self._rows, self.d.scheduler.decisions, []
        dumps = json.dumps
        for j in jobs:
            if j.state in ACTIVE:  # live figures: made afresh
                parts.append(dumps(self.summary(j), separators=(",", ":"), default=str).encode())
                continue
            d = decisions.get(j.id) if j.state == State.QUEUED else None
            reason = d.reason if d is not None else None
            hit = cache.get(j.id)
            if hit is None or hit[1] != reason or (hit[0] is not j and (j.state not in TERMINAL or hit[0].state != j.state)):
                row = dumps(self.summary(j, {j.id: reason} if reason is not None else None),
                            separators=(",", ":"), default=str).encode()
                hit = (j, reason, row)
                if len(cache) < ROWS_CACHED or j.id in cache:  # bounded: `ls --json` of 50,000 is rare
                    cache[j.id] = hit
            parts.append(hit[2])
        if len(cache) > 2 * len(self.d.table.open) + 20000:  # rows of jobs gone from every listing
            keep = {j.id for j in jobs}
            self._rows = {k: v for k, v in cache.items() if k in keep}
        return protocol.Raw(b"[" + b",".join(parts) + b"]")

    async def ls(self, caller: Caller, args: dict) -> protocol.Raw:
        """Jobs oldest first: those in `states` (default: every job with `all`, else the queued and
        running ones) of `users` named one of `names` that one of `refs` names (ids, names, arrays'
        ids, ARRAY_INDEX); only the newest `limit`. Open jobs are the daemon's own (with live
        reasons), ended ones are read with the filters in SQL.

        Without `fields`: each job's summary (`colo ls --json`). With `fields` (protocol.LS_FIELDS):
        {"fields", "rows": each job's fields in a list, "left": {state: jobs not sent}}, made to be cheap
        to send and read: times in whole seconds, gpus as one comma-separated text, argv as one line,
        texts cut to `cut` characters; with `head` (a terminal's bound; not with `limit`), at most that many jobs:
        every starting and running one, then queued ones from the front, then the newest ended."""
        d = self.d
        users = set(args["users"]) if args.get("users") is not None else None
        names = set(args["names"]) if args.get("names") is not None else None
        if args.get("states") is not None:
            want = set(args["states"])
        else:
            want = set(_ALL_STATES) if args.get("all", True) else {"queued", "starting", "running"}
        limit = args.get("limit") or None
        head = None if limit else args.get("head") or None
        ended = [State(s) for s in want & _ENDED]
        refs = args.get("refs")
        # which open jobs refs name: asked of the store, which holds the one rule (Store._where)
        named = None if refs is None else {r[0] for r in d.store.listing(["id"], _OPEN, refs=refs)}
        fields, cut, collapse = args.get("fields"), args.get("cut") or None, args.get("tasks") is False
        if fields is not None and users is None and names is None and named is None and "queued" in want:
            # the common `colo ls`: the queue's rows as the last such listing made them, while no
            # queued job and no decision changed since; the active jobs' rows afresh
            live = [j for j in d.table.active(*ACTIVE) if j.state._value_ in want]
            rows = _merged(self._queued_rows(fields, cut, collapse), self._live_rows(live, fields, cut))
        else:
            # State is a str enum whose hash is a Python call: its _value_ (the plain str) is compared
            live = [j for j in d.table.open.values() if j.state._value_ in want and (users is None or j.user in users)
                    and (names is None or j.spec.name in names) and (named is None or j.id in named)]
            if any(live[i].id > live[i + 1].id for i in range(len(live) - 1)):
                live.sort(key=lambda j: j.id)
            rows = None
        if fields is None:
            jobs = live
            if ended:
                jobs = sorted([*live, *self._ended_jobs(ended, users, names, limit, refs)], key=lambda j: j.id)
            return self.rows(jobs[-limit:] if limit else jobs)
        if rows is None:
            rows = self._live_rows(live, fields, cut, collapse)
        n_ended: dict[str, int] = {}
        if ended:
            past = d.store.listing(["id", "state"], ended, users, names, limit or head, refs)
            more = self._ended_rows(past, fields, cut)
            rows = sorted([*rows, *more]) if rows and past and past[0][0] < rows[-1][0] else [*rows, *more]
            if head and len(past) == head:  # more may be stored: how many, for `left`
                n_ended = d.store.listing_counts(ended, users, names, refs)
        if limit:
            rows = rows[-limit:]
        left: dict[str, int] = {}
        if head and (len(rows) > head or n_ended):
            rows, left = _bounded(rows, head, n_ended)
        return protocol.Raw(_encode({"fields": fields, "left": left})[:-1] + b',"rows":['
                            + b",".join([r[2] for r in rows]) + b"]}")

    def _queued_rows(self, fields: list[str], cut: int | None, collapse: bool) -> list[tuple[int, str, bytes]]:
        """_live_rows of every queued job, kept while no queued job and no decision changed (the
        table's watchers and the scheduler's `version` say): `colo ls` of 50,000 then walks none."""
        key = (tuple(fields), cut, collapse)
        stamp = (self._queue_version, self.d.scheduler.version)
        hit = self._blocks.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        queued = [j for j in self.d.table.open.values() if j.state._value_ == "queued"]
        if any(queued[i].id > queued[i + 1].id for i in range(len(queued) - 1)):
            queued.sort(key=lambda j: j.id)
        rows = self._live_rows(queued, fields, cut, collapse)
        self._blocks.pop(key, None)
        while len(self._blocks) >= 4:  # the kinds of listing asked for lately
            self._blocks.pop(next(iter(self._blocks)))
        self._blocks[key] = (stamp, rows)
        return rows

    def _queue_changed(self, prev: Job | None, job: Job) -> None:
        if job.state == State.QUEUED or (prev is not None and prev.state == State.QUEUED):
            self._queue_version += 1

    def _live_rows(self, jobs: list[Job], fields: list[str], cut: int | None,
                   collapse: bool = False) -> list[tuple[int, str, bytes]]:
        """(id, state, the row ls sends, encoded) of open jobs. A queued job's row changes only with
        the job (a new Job) or the reason it waits: kept, so that `ls` of 10,000 encodes few.
        collapse: the queued tasks of an array as one row, its first's, whose id (and ARRAY_INDEX)
        says which, as squeue shows them: 12_[3-9,11]."""
        if collapse:
            rows, groups = [], {}
            for j in jobs:
                if j.state._value_ == "queued" and j.spec.array_job is not None:
                    g = groups.get(j.spec.array_job)
                    if g is not None:
                        g.append(j.spec.array_index)
                        continue
                    groups[j.spec.array_job] = [j.spec.array_index]
                rows.append(j)
            out = self._live_rows(rows, fields, cut)
            for k, (i, st, row) in enumerate(out):
                j = self.d.table.open.get(i)
                g = groups.get(j.spec.array_job) if j is not None and st == "queued" else None
                if g is not None and len(g) > 1:
                    text = f"{j.spec.array_job}_[{_ranges(sorted(g))}]"
                    why = self.d.scheduler.decisions.get(i)
                    out[k] = (i, st, _encode([text if f in ("id", "array") else v for f, v in
                                              zip(fields, self._row(j, fields, cut, why and why.reason))]))
            return out
        if fields == ["id"]:  # `colo ls -q`: nothing to keep
            return [(j.id, j.state._value_, b"[%d]" % j.id) for j in jobs]
        key = (tuple(fields), cut)
        cache = self._ls_rows.pop(key, None)
        if cache is None:
            cache = {}
            while len(self._ls_rows) >= 4:  # each kind of listing asked for lately (-q, the default, ...)
                self._ls_rows.pop(next(iter(self._ls_rows)))
        self._ls_rows[key] = cache  # the newest last
        decisions, out = self.d.scheduler.decisions, []
        for j in jobs:
            st = j.state._value_  # State is a str enum whose hash and value are Python calls
            if st != "queued":
                out.append((j.id, st, _encode(self._row(j, fields, cut))))
                continue
            dec = decisions.get(j.id)
            why = None if dec is None else dec.reason
            hit = cache.get(j.id)
            if hit is None or hit[0] is not j or hit[1] != why:
                hit = cache[j.id] = (j, why, _encode(self._row(j, fields, cut, why)))
            out.append((j.id, st, hit[2]))
        if len(cache) > len(self.d.table.open) + 1000:  # rows of jobs no longer queued
            self._ls_rows[key] = {k: v for k, v in cache.items() if k in self.d.table.open}
        return out

    def _ended_jobs(self, ended: list[State], users, names, limit: int | None, refs) -> list[Job]:
        """Stored ended jobs for ls's filters. An ended job never changes: those whose summary rows()
        holds are not read again."""
        ids = [r[0] for r in self.d.store.listing(["id"], ended, users, names, limit, refs)]
        cache = self._rows
        miss = [i for i in ids if (h := cache.get(i)) is None or h[0].state not in TERMINAL]
        got = {j.id: j for j in self.d.store.jobs_by_id(miss)} if miss else {}
        return [got[i] if i in got else cache[i][0] for i in ids]

    def _ended_rows(self, past: list[tuple[int, str]], fields: list[str], cut: int | None) -> list[tuple]:
        """(id, state, the row ls sends, encoded) of the stored ended jobs `past` (id, state); an ended
        job's row never changes: kept (up to 100,000 a kind of listing), only the others are read."""
        key = (tuple(fields), cut)
        cache = self._ls_ended.pop(key, None)
        if cache is None or len(cache) > 100_000:
            cache = {}
            while len(self._ls_ended) >= 4:
                self._ls_ended.pop(next(iter(self._ls_ended)))
        self._ls_ended[key] = cache
        miss = [i for i, _ in past if i not in cache]
        if miss:
            index = {g.uuid: g.index for g in self.d.gpus.devices}
            for r in self.d.store.listing_by_id(["id", *fields], miss):
                cache[r[0]] = _encode(_as_sent(r[1:], fields, cut, index))
        return [(i, st, cache[i]) for i, st in past]

    def _row(self, j: Job, fields: list[str], cut: int | None, why: str | None = None) -> list:
        """One open job's `fields` as ls sends them (see ls): its GPUs by index, a lone time-sliced
        job "exclusive", a paused one's state "paused"."""
        out = []
        for f in fields:
            if f == "reason":
                out.append(self.reason(j, why)[:cut])
            elif f == "argv":
                out.append(" ".join(j.spec.argv)[:cut])
            elif f == "gpus":
                out.append(self._gpus_text(j.gpus))
            elif f == "mode":
                out.append(self.mode(j))
            elif f == "state" and j.paused_by and j.state == State.RUNNING:
                out.append("paused")
            else:
                out.append(_LIVE[f](j))
        return out

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
        return out

    async def explain(self, caller: Caller, args: dict) -> dict:
        job = self._own(self._job(args), caller, "see the details of")
        dec = self.d.scheduler.explain(job.id)
        reason = job.reason
        if job.state == State.QUEUED and job.held_by:
            held = f"held by {job.held_by} (colo release {job.id})"
            return {"id": job.id, "state": str(job.state), "reason": held,
                    "decision": {**(dec or {}), "action": "wait", "reason": held}}
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
        if job.paused_by:
            return self.summary(job)
        if job.mode == Mode.MPS:
            raise ApiError(f"job {job.id} is an MPS client of GPU {self._gpus_text(job.gpus)}: colo does not pause "
                           "MPS clients (one frozen in the middle of a kernel could stall the MPS server for every "
                           f"other job on that GPU); colo cancel {job.id} stops it", protocol.INVALID)
        return self.summary(await self._engine(job, self.d.launcher.pause(job.id, caller.user)))

    async def resume(self, caller: Caller, args: dict) -> dict:
        job = self._own(self._job(args), caller, "resume")
        if job.state != State.RUNNING or not job.paused_by:
            raise ApiError(f"job {job.id} is not paused ({job.state})", protocol.INVALID)
        return self.summary(await self._engine(job, self.d.launcher.resume(job.id, caller.user)))

    async def gpus(self, caller: Caller, args: dict) -> dict:
        d = self.d
        active = d.table.jobs_in(*ACTIVE)
        views = {v.uuid: v for v in d.gpus.views()}
        out = []
        for g in d.gpus.devices:
            placed = [j for j in active if g.uuid in j.gpus]
            out.append({**g.to_dict(), "usable": views[g.uuid].usable, "mps": views[g.uuid].mps,
                        "budgeted": sum(j.spec.gpu_mem for j in placed), "jobs": [j.id for j in placed],
                        # held outside any budget (processes of no job, jobs past their budgets): not given out
                        "unbudgeted": d.gpus.unbudgeted.get(g.uuid, 0),
                        "over": [j.id for j in placed if j.id in d.patrol.over]})
        return {"gpus": out, "error": d.gpus.error, "fake": d.config.fakegpu_state is not None}

    async def top(self, caller: Caller, args: dict) -> dict:
        """Everything `colo top` shows, in one snapshot."""
        d = self.d
        gpus = await self.gpus(caller, args)
        # the running jobs, and the front of the queue as `colo top` shows it (its total apart)
        live = sorted(d.table.active(*ACTIVE) + heapq.nsmallest(
            TOP_QUEUED, (j for j in d.table.open.values() if j.state._value_ == "queued"),
            key=lambda j: (-j.spec.priority, j.submitted_at, j.id)), key=lambda j: j.id)
        # ended jobs only briefly, the last few: the panel is for what runs (history: colo history)
        recent = [j for j in d.store.jobs(TERMINAL, limit=TOP_ENDED, newest_first=True)
                  if (j.ended_at or 0) > time.time() - TOP_ENDED_FOR]
        # processes of no job, as the patrol mapped them at the last sample (colo's MPS servers excluded)
        foreign = [{"gpu": f["gpu"], "pid": f["pid"], "used": f["used"], "command": _cmd(f["pid"]),
                    "user": _user(f["pid"])} for f in d.patrol.foreign]
        head = json.dumps({"at": time.time(), "gpus": gpus["gpus"], "gpu_error": gpus["error"], "fake": gpus["fake"],
                           "foreign": foreign, "you": caller.user, "queued": d.scheduler.queued_total()},
                          separators=(",", ":"), default=str).encode()
        return protocol.Raw(head[:-1] + b',"jobs":' + self.rows(live + recent) + b"}")

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
                    row["spec"].update(env={}, mounts=[], workdir=None)
        return {"jobs": rows, "left": left}

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
        self.d.stopping = True
        self.d.wake()
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
        return self.summary(self.d.table.job(job.id))

    # streams --------------------------------------------------------------------------------------
    async def session(self, caller: Caller, args: dict) -> AsyncIterator[Any]:
        """`colo shell`/`colo run`: a job on a terminal colo made for it (colo/daemon/session.py)."""
        try:
            session.check(args["spec"])
        except session.Refused as e:
            raise ApiError(str(e), protocol.INVALID) from None
        async for ev in session.attach(self, caller, args["spec"]):
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
        # Never the whole log in memory: it is the job's to fill (colo/daemon/logread.py).
        pos, line_start, fd = 0, True, None
        dec = logread.decoder()  # one for the whole stream: a character may span two reads
        try:
            if path.exists():
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # (not in a thread: a stream ended then would lose it)
            if fd is not None and (tail is not None or since is not None or stamps):
                now = job if job.state in TERMINAL else self.d.table.job(job.id)
                fallback = now.ended_at if now.state in TERMINAL and now.ended_at else time.time()
                index = await asyncio.to_thread(logtimes.load, path) if (since is not None or stamps) else ([], [])
                pos = os.fstat(fd).st_size

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
                    for ev in logread.pieces(fd, pos, stop, ([], []), time.time(), stamps, dec, line_start):
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


def _as_sent(r: tuple, fields: list[str], cut: int | None, index: dict[str, int]) -> list:
    """A stored job's fields (Store.listing) as ls sends them (see ls); GPUs by `index`."""
    out = list(r)
    for k, f in enumerate(fields):
        v = out[k]
        if f == "argv":
            out[k] = " ".join(v)[:cut]
        elif f == "gpus":
            out[k] = ",".join(str(index[u]) if u in index else u[:12] for u in v)
        elif f == "reason":
            out[k] = v[:cut]
        elif f.endswith("_at") and v is not None:
            out[k] = int(v)
    return out


def _merged(a: list[tuple], b: list[tuple]) -> list[tuple]:
    """Two lists of rows sorted by id, as one (b is short: the active jobs)."""
    if not b:
        return a
    out = list(a)
    for r in b:
        bisect.insort(out, r, key=lambda x: x[0])
    return out


def _ranges(ix: list[int]) -> str:
    """3,4,5,7 as Slurm writes a set of array indices: 3-5,7."""
    out, start = [], 0
    for k in range(1, len(ix) + 1):
        if k == len(ix) or ix[k] != ix[k - 1] + 1:
            out.append(str(ix[start]) if start == k - 1 else f"{ix[start]}-{ix[k - 1]}")
            start = k
    return ",".join(out)


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _bounded(rows: list[tuple[int, str, bytes]], head: int, n_ended: dict[str, int]) -> tuple[list, dict[str, int]]:
    """At most `head` of ls's (id, state, row) rows: the starting and running ones, then queued
    ones from the front, then the newest ended ones; and how many of each state were left out
    (`n_ended`: how many ended jobs matched, where more did than were read)."""
    keep = [r for r in rows if r[1] == "starting" or r[1] == "running"][:head]
    keep += [r for r in rows if r[1] == "queued"][:head - len(keep)]
    room = head - len(keep)
    keep += [r for r in rows if r[1] in _ENDED][-room:] if room else []
    left = Counter(r[1] for r in rows)
    for st, n in n_ended.items():
        left[st] = n
    left.subtract(r[1] for r in keep)
    keep.sort()
    return keep, {k: v for k, v in left.items() if v > 0}


# What ls sends of an open job, by field (reason, argv, gpus, mode and a paused job's state: Api._row)
_LIVE = {
    "id": lambda j: j.id, "name": lambda j: j.spec.name, "user": lambda j: j.user, "state": lambda j: j.state._value_,
    "budget": lambda j: j.spec.gpu_mem, "submitted_at": lambda j: int(j.submitted_at),
    "started_at": lambda j: j.started_at and int(j.started_at), "ended_at": lambda j: j.ended_at and int(j.ended_at),
    "exit_code": lambda j: j.exit_code, "priority": lambda j: j.spec.priority, "array": lambda j: j.spec.array_ref,
}
_ALL_STATES = frozenset(s.value for s in State)
_OPEN = (State.QUEUED, *ACTIVE)
_ENDED = frozenset(s.value for s in TERMINAL)


def _shown(field: str, v: Any) -> str:
    return format_size_exact(v) if field == "gpu_mem" else repr(v) if field == "name" else str(v)


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        return "?"


def _user(pid: int) -> str:
    try:
        return pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError):
        return "?"


STREAMS = {"logs", "wait", "session"}
ATTACHED = {"session"}  # streams that end when their client hangs up (server.py)
TOP_ENDED, TOP_ENDED_FOR = 5, 300.0  # `colo top` shows the newest 5 ended jobs, for 5 minutes after their end
TOP_QUEUED = 500  # and the front of the queue (a terminal shows less); the number queued apart
ROWS_CACHED = 20000  # job summaries (`ls --json`, top) kept encoded
