"""Every check a job passes before it is stored: its spec's form (validate.py), with names of
earlier jobs made ids (deps.py), a mail agent for --mail-type, its mounts opened as the caller
(pin.py), then what the node and its limits allow (the priority cap, the per-user queue limit,
GPUs that could ever hold it, the image and the engine's GPU access, the jobs it depends on).

Used by `submit`, `session`, `requeue` and `edit`; built from the parts it asks (the store, the
GPUs, the engines, the scheduler's limits and queue counts). It stores nothing.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .. import protocol
from ..jobs import JobSpec
from ..runtimes.base import EngineError, Unavailable
from ..sched import fairshare
from ..sched.policy import can_ever_fit, gpu_allowed, gpu_filter_refusal
from ..store import NotFound
from ..units import format_size_exact
from . import deps, onend as mail, pin
from .errors import ApiError
from .validate import Caller, Forbidden, Invalid, check_spec, is_admin, parse_array

if TYPE_CHECKING:
    from ..config import Config
    from ..store import Store
    from .engines import Engines
    from .gpus import Gpus
    from .scheduler import Scheduler


@dataclass
class Submission:
    """A submit that passed every check: its spec, and for an array its task indices and how many
    may run at once."""
    spec: JobSpec
    indices: list[int] | None
    limit: int | None
    held_by: str | None  # submit --hold (sbatch -H): the caller


class Admission:
    """Owns nothing that lasts: each check asks the parts as they are now."""

    def __init__(self, config: "Config", store: "Store", gpus: "Gpus", engines: "Engines", scheduler: "Scheduler",
                 native: Path, detached_count: Callable[[int], int]):
        self.config, self.store, self.gpus, self.engines, self.scheduler = config, store, gpus, engines, scheduler
        self.native = native  # colo's compiled helpers (pin's)
        self.detached_count = detached_count  # the table's: a user's open detached sessions, queued or running

    def protected(self) -> list[Path]:
        """What no job may mount or write: colo's state and its socket's folder."""
        return [self.config.state_dir, self.config.socket.parent]

    async def submission(self, caller: Caller, raw: dict, tty: bool = False, detached: bool = False,
                         pipe: bool = False) -> Submission:
        """`raw` (a submit's spec) checked whole for `caller`; with no await after the last check,
        so the caller stores the job before anything else runs (see admit).
        tty: a session's job (op `session`), which starts on the terminal the daemon made for it;
        detached: one started with --detach (the daemon keeps its terminal); pipe: one without a terminal."""
        protected = self.protected()
        try:
            # --after 12_3, --after prep: made job ids here (deps.py), before the spec is checked
            spec = check_spec(deps.resolved(self.store, raw, caller.user) if isinstance(raw, dict) else raw,
                              caller, protected)
            spec.tty, spec.detached, spec.pipe = tty, tty and detached, tty and pipe
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
                await asyncio.to_thread(pin.verify, spec.mounts, caller, self.native / pin.HELPER, protected)
            except Invalid as e:
                raise ApiError(str(e), protocol.INVALID) from None
            except Forbidden as e:
                raise ApiError(str(e), protocol.FORBIDDEN) from None
        await self.admit(spec, caller, caller.user, caller.uid, tasks=len(indices) if indices else 1)
        if spec.detached:  # after the last await: two sessions asked for at once cannot both pass
            self._detach_check(caller.uid)
        return Submission(spec, indices, limit, caller.user if raw.get("hold") else None)

    def _detach_check(self, uid: int) -> None:
        """max_detached_per_user (0: no limit): queued detached sessions count as running ones do."""
        most, n = self.config.max_detached_per_user, self.detached_count(uid)
        if most and n >= most:
            raise ApiError(f"you have {n} detached sessions, the most allowed (max_detached_per_user = {most}; queued "
                           "ones count): end or attach to one (colo ls, colo cancel JOB, colo attach JOB)",
                           protocol.FORBIDDEN)

    def edited(self, caller: Caller, raw: dict) -> JobSpec:
        """An edited queued job's spec (`raw`: the stored one with the changes) in its form."""
        try:
            return check_spec(raw, caller, self.protected())
        except (Invalid, Forbidden) as e:
            raise ApiError(str(e), protocol.INVALID) from None

    async def admit(self, spec: JobSpec, caller: Caller, user: str, uid: int, queued: bool = False,
                     tasks: int = 1) -> None:
        """What submit checks beyond the spec's own form, for `user`'s job asked for by `caller` (a
        submit, a requeue, or an edit: `queued`, the job is already counted and its dependencies and
        image were checked)."""
        top = self.config.max_user_priority
        if spec.priority > top and caller.uid != os.geteuid() and not is_admin(caller, self.config.admin_group):
            raise ApiError(f"--priority {spec.priority} is above {top}, the most a user may set here "
                           f"(max_user_priority); members of {self.config.admin_group or 'no admin group'} and root "
                           "may set more", protocol.FORBIDDEN)
        if (n := spec.tasks) and n > (most := self.config.max_job_tasks) > 0 and not is_admin(caller, self.config.admin_group):
            raise ApiError(f"--tasks {n} is above {most}, the most a job may have here (max_job_tasks); members of "
                           f"{self.config.admin_group or 'no admin group'} and root may ask for more", protocol.FORBIDDEN)
        if not queued and (why := fairshare.submit_refusal(self.scheduler.limits, user, self.scheduler.queued_count(uid),
                                                             tasks)):
            raise ApiError(why, protocol.FORBIDDEN)
        if spec.gpus:
            if self.gpus.error:
                raise ApiError(self.gpus.error, protocol.INVALID)
            views = [v for v in self.gpus.views() if gpu_allowed(v, spec.gpu_ids, spec.gpu_type)]
            why = (gpu_filter_refusal(spec.gpu_ids, spec.gpu_type, spec.gpus, self.gpus.views())
                   or self._too_big(spec.gpu_mem, spec.gpus, views) or can_ever_fit(spec.gpu_mem, spec.gpus, views))
            if why:
                raise ApiError(f"job can never run here: {why}", protocol.INVALID)
        if queued:
            return
        if spec.image is not None:
            rt = self.engines.get("docker")
            if rt is None:
                raise ApiError(self.engines.docker_error or "no Docker engine", protocol.UNAVAILABLE)
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
            if spec.gpus and self.config.fakegpu_state is None and (why := await asyncio.to_thread(rt.gpu_refusal)):
                raise ApiError(why, protocol.INVALID)  # no CDI device, no nvidia runtime: refused now, not at start
        # Last, with no await after it: the caller stores the job before `colo clean` can run, and
        # clean keeps the jobs an open job depends on (retention.py).
        for key in ("after", "after_any", "after_fail"):
            for a in getattr(spec, key):
                try:
                    self.store.get(a)
                except NotFound:
                    raise ApiError(f"--{key.replace('_', '-')} {a}: no such job (never submitted, or removed by "
                                   "colo clean or history_keep_days)", protocol.NOT_FOUND) from None

    def _too_big(self, budget: int, ngpus: int, views: list) -> str | None:
        """A budget above what any GPU (the job may use) can give, said with exact sizes: usable vs
        asked (issue 16)."""
        views = {v.uuid: v for v in views}
        gpus = sorted(((views[g.uuid].usable, g.total) for g in self.gpus.devices if g.uuid in views),
                      reverse=True)
        if not ngpus or len(gpus) < ngpus or gpus[ngpus - 1][0] >= budget:
            return None
        usable, total = gpus[ngpus - 1]
        kept = total - usable
        return (f"--gpu-mem {format_size_exact(budget)} is more than a GPU here can give: "
                f"{format_size_exact(usable)} is usable on the largest ({format_size_exact(total)} total"
                + (f", less the {format_size_exact(kept)} colo keeps back, `reserve` in its config)" if kept else ")")
                + f"; ask for {format_size_exact(usable)} or less")
