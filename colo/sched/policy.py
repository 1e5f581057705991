"""Placement: which queued job starts where, in which mode, and why the others wait.

Pure: no I/O, no clock. The daemon and `colo sim` both call plan(); nothing about scheduling
is written anywhere else.

Rules, in order, for each candidate (priority, then submission order; smaller jobs behind a
waiting one may start: backfill):
1. Memory is a hard rule (invariant 1): the sum of budgets on a GPU never exceeds its usable
   memory. Best fit: among the GPUs that can take the job, the one left with the least room.
2. A job with no profile runs alone, or beside at most one well-known job (a profile learned
   from `well_known_runs` runs) that it is not predicted to slow past the bound, time-sliced: its
   first profile is then clean, and nobody shares a GPU with a stranger. A job already running
   without a profile takes at most one such neighbour. While a family (Candidate.family: its
   owner's name for it) runs one with no profile yet, its others wait for the provisional profile
   that one's first half minute makes where the empty GPUs are no more than the families with
   none running whose jobs wait and could fit: those get them first, one each.
3. Every co-location, MPS included, passes one check. From the profiles of the jobs already on
   the GPU (aligned on their elapsed time) and the candidate's, the co-run model
   (colo/interference.py) predicts each job's rate over the overlap in each mode allowed there,
   times what runs showed for each pairing (Learned); every shared rate is discounted once by
   the error of predictions whose pairings runs had shown (`seen_margin`), and once more for
   every pairing no run has shown yet by `margin` (the error of all predictions). A mode passes
   when no job's predicted slowdown exceeds `slowdown_bound` and the GPU's throughput beats
   waiting by `min_gain`. MPS (allowed: not in FAULT, the uid rule of invariant 5, summed SM and bandwidth
   below `saturation`) is taken when it passes, else time-slicing when it passes, else wait.
4. EXCLUSIVE_PROCESS GPUs take MPS clients only (invariant 4); PROHIBITED GPUs take nothing.
5. A --grow job (Candidate.grow) is lent up to `lend` x its budget out of what its GPU has left
   after the pass when no queued job fits in that (details["budget"], details["asked"]).
"""
from __future__ import annotations

import dataclasses
import gc
from operator import attrgetter
from typing import Any, Sequence

from ..units import format_size
from .assess import WAYS_OUT, _assess, _duration, _Gpu, _mem_text, _Res
from .budgets import (STEP, Holder, can_ever_fit, free_budget, gpu_allowed, gpu_filter_refusal, _only_text,
                      resume_refusal, step_up, suspend_victims)
from .grid import _arrays, thread_pct
from .learning import (ALONE_DOUBT, FADE, FADE_LIVE, KEEP_RUNS, KNOWN_BW, MARGIN_CAP, NOTHING, Learned,
                       expectation, expected, joined, left, progress, shared, turns_level)
from .views import START, WAIT, Candidate, Decision, GpuView, Placed, PolicyConfig, config_of

# plan() and what callers (the daemon, colo sim, the CLI) read beside it, kept importable from here
__all__ = ["ALONE_DOUBT", "FADE", "FADE_LIVE", "KEEP_RUNS", "KNOWN_BW", "MARGIN_CAP", "NOTHING", "START",
           "WAIT", "WAYS_OUT", "Candidate", "Decision", "GpuView", "Holder", "Learned", "Placed",
           "PolicyConfig", "can_ever_fit", "config_of", "expectation", "expected", "free_budget",
           "gpu_allowed", "gpu_filter_refusal", "joined", "left", "order", "place_now", "plan", "progress",
           "resume_refusal", "shared", "suspend_victims", "thread_pct", "turns_level"]


def _decision(job_id: int, action: str, gpus: tuple = (), mode: str | None = None, reason: str = "",
              details: dict | None = None, thread_pct: int | None = None) -> Decision:
    """Decision without the frozen dataclass's per-field __setattr__ (10,000 a pass must be cheap)."""
    d = object.__new__(Decision)
    object.__setattr__(d, "__dict__", {"job_id": job_id, "action": action, "gpus": gpus, "mode": mode,
                                       "reason": reason, "details": {} if details is None else details,
                                       "thread_pct": thread_pct})
    return d


def _measured_on(profile: Any, view: GpuView) -> bool:
    """Was the profile's alone time measured on this model of GPU (its runs here, or `colo
    profile record` on one like it)? Then it needs no run alone to be checked (check_alone): its
    doubt is the ordinary one. A shipped profile (from the study's TITAN Xp) or one from another
    model is checked once."""
    gpu = getattr(profile, "gpu", "") or ""
    return bool(gpu) and gpu == view.name


def order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Priority first, then first come first served."""
    out = sorted(candidates, key=attrgetter("seq"))
    out.sort(key=attrgetter("priority"), reverse=True)  # stable: equal priorities keep seq order
    return out


def plan(candidates: Sequence[Candidate], gpus: Sequence[GpuView], placed: Sequence[Placed],
         config: PolicyConfig = PolicyConfig(), now: float | None = None,
         learned: "Learned | dict[int, Learned] | None" = None) -> list[Decision]:
    """One decision per candidate, in queue order; a job that cannot start now lets smaller ones
    behind it start (backfill) when they fit, unless it has waited `hold_after` seconds by `now`
    (then GPUs are held for it; without `now`, never). `learned`: what ends of jobs taught, for
    every job, or per uid (each user's jobs placed with what that user's runs taught only)."""
    # A pass allocates ~3 small objects per candidate and frees none; cyclic GC runs in the
    # middle of it would double its time and find nothing to collect.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(candidates, gpus, placed, config, now, learned)
    finally:
        if was_enabled:
            gc.enable()


def place_now(c: Candidate, gpus: Sequence[GpuView], placed: Sequence[Placed],
              config: PolicyConfig = PolicyConfig(), now: float | None = None) -> Decision:
    """For a job another scheduler (Slurm) has already started on this node: it cannot wait in
    colo's queue. plan()'s choice when plan() starts it; when plan() would rather wait (sharing
    past saturation), time-sliced on the best-fitting GPU that holds its budget (invariant 1
    still holds); WAIT only when no GPU has the memory, which the caller refuses."""
    d = plan([c], gpus, placed, config, now)[0]
    if d.action == START or c.gpus != 1:
        return d
    free = free_budget(gpus, placed)
    fits = [g for g in gpus if g.in_service and g.compute_mode == "default" and free[g.uuid] >= c.budget]
    if not fits:
        return d
    g = min(fits, key=lambda g: (free[g.uuid] - c.budget, g.index))
    return _decision(c.job_id, START, (g.uuid,), "timesliced",
                     f"time-sliced on GPU{g.index} (started by Slurm, so it cannot wait; colo alone would "
                     f"have waited: {d.reason})", dict(d.details))


def _hold_for(c: Candidate, state: dict[str, "_Gpu"]) -> list["_Gpu"] | None:
    """The GPUs to hold for a job that waits: the ones held for it last time while they still
    can take it (a hold that moved as other GPUs freed up would never end), else those with the
    most free budget (so the fewest jobs must end first) among the ones it could fit on."""
    if c.held:
        kept = [g for g in state.values() if g.view.index in c.held and g.view.usable >= c.budget]
        if len(kept) == c.gpus:
            return sorted(kept, key=lambda g: g.view.index)
    can = sorted((g for g in state.values() if g.view.usable >= c.budget and gpu_allowed(g.view, c.gpu_ids, c.gpu_type)),
                 key=lambda g: (-g.free, g.view.index))
    return can[: c.gpus] if len(can) >= c.gpus else None


def _plan(candidates: Sequence[Candidate], gpus: Sequence[GpuView], placed: Sequence[Placed],
          config: PolicyConfig, now: float | None, learned: "Learned | dict | None" = None) -> list[Decision]:
    per_uid = isinstance(learned, dict)
    cfgs: dict = {}

    def for_uid(uid: int) -> tuple["Learned | None", PolicyConfig]:
        """What this candidate's owner has learned, and the margin it sizes (cached per pass)."""
        got = cfgs.get(uid)
        if got is None:
            lrn = learned.get(uid, NOTHING) if per_uid else learned  # a user whose runs taught nothing yet
            c = dataclasses.replace(config, margin=lrn.margin(config.margin), seen_margin=lrn.seen_margin(
                config.margin)) if lrn is not None and lrn.errors else config
            got = cfgs[uid] = (lrn, c)
        return got

    cfg = config
    free = free_budget(gpus, placed)
    state: dict[str, _Gpu] = {g.uuid: _Gpu(g, free[g.uuid], []) for g in gpus
                              if g.compute_mode != "prohibited" and g.in_service}
    # A job that waits while a GPU is out of service is told so: it may be why.
    down = "".join(f"; GPU{g.index} is out of service ({g.error})" if g.error is not None else
                   f"; GPU {g.index} {g.drained}" for g in gpus if not g.in_service)
    for p in placed:
        arr = _arrays(p.profile, cfg.step, cfg.horizon) if p.profile is not None else None
        for u in p.gpus:
            if u in state:
                state[u].res.append(_Res(p.job_id, arr, int((p.elapsed if p.done is None else p.done) / cfg.step),
                                         p.mode, p.uid, p.alone))
    most_free = max((g.free for g in state.values()), default=0)
    # profiles whose alone time is being checked now (one run at a time each)
    checking = {p.profile.name for p in placed if p.alone and p.profile is not None}
    memo: dict[tuple, tuple] = {}
    refused: dict[tuple, tuple] = {}
    refused_like: dict[tuple, tuple] = {}
    wait_text: dict[tuple[int, int, int], str] = {}
    out: list[Decision] = []
    append = out.append
    may_hold = now is not None and cfg.hold_after > 0
    strangers_wait = not cfg.unprofiled_share
    stranger_text = (f"waiting: this job has no profile: it runs alone or beside one well-known job (a profile "
                     f"of {cfg.well_known_runs}+ runs), so that its profile is clean, and no GPU with its budget "
                     f"free is empty or runs just one such job; {WAYS_OUT}")
    # Families (owner, name) whose job running now has no profile yet: its first half minute makes
    # the family one (a provisional profile) that its others are placed with; until then the
    # empty GPUs go first to the families with none running whose jobs wait (one each).
    sampled = {(p.uid, p.family): p.job_id for p in placed if p.profile is None and p.family}
    unsampled = {(c.uid, c.family) for c in candidates
                 if c.profile is None and c.family and c.gpus and c.budget <= most_free} - sampled.keys()
    prev_c: Candidate | None = None
    for c in [*order(candidates), None]:  # None: a last turn, to look at the last one's decision
        if may_hold and prev_c is not None and out[-1].action == WAIT and now - prev_c.queued_at >= cfg.hold_after:
            held = _hold_for(prev_c, state)
            if held:
                may_hold = False
                names = ", ".join(f"GPU{g.view.index}" for g in held)
                waited = _duration(now - prev_c.queued_at)
                out[-1] = dataclasses.replace(out[-1], reason=f"{out[-1].reason}; {names} held for it (waiting "
                                              f"{waited}): nothing new starts there until it does",
                                              details={**out[-1].details, "held": [g.view.index for g in held]})
                for g in held:
                    del state[g.view.uuid]
                down += "".join(f"; GPU{g.view.index} is held for job {prev_c.job_id}" for g in held)
                most_free = max((g.free for g in state.values()), default=0)
                wait_text.clear()
                refused_like.clear()
        if c is None:
            break
        prev_c = c
        if c.gpus == 0:
            append(_decision(c.job_id, START, (), "none", "needs no GPU"))
            continue
        only = c.gpu_ids or c.gpu_type  # --gpu-id/--gpu-type: GPUs it may not use are not looked at
        if c.budget > most_free or c.gpus > len(state):  # the common case in a long queue: no numpy
            key = (c.budget, c.gpus, most_free)
            text = wait_text.get(key)
            if text is None:
                text = wait_text[key] = (f"waiting for memory: needs {format_size(c.budget)} on {c.gpus} GPU(s), "
                                         f"most free budget on one GPU is {format_size(most_free)}{down}")
            append(_decision(c.job_id, WAIT, reason=text, details={"need": c.budget, "most_free": most_free}))
            continue
        # Within a pass GPUs only fill up: a job like one already refused (same profile, uid and
        # GPU count) with at least its budget is refused for the same reason, without more work.
        same = (id(c.profile), c.uid, c.gpus, c.gpu_ids, c.gpu_type)
        prev = refused_like.get(same)
        if prev is not None and c.budget >= prev[0]:
            append(_decision(c.job_id, WAIT, reason=prev[1], details=dict(prev[2])))
            continue
        if c.profile is None and strangers_wait and (c.uid, c.family) in sampled and (
                waiting := len(unsampled - sampled.keys())) and waiting >= sum(
                1 for g in state.values() if not g.res and g.free >= c.budget):
            append(_decision(c.job_id, WAIT, reason=f"waiting: job {sampled[(c.uid, c.family)]} of its family "
                             f"runs now without a profile; one is made from its first half minute, and the empty "
                             f"GPUs go first to families with none running, one each{down}", details={"need": c.budget}))
            continue
        if c.profile is None and strangers_wait and not any(
                g.free >= c.budget and (not g.res or (len(g.res) == 1 and g.res[0].arr is not None
                                                      and g.res[0].arr.runs >= cfg.well_known_runs))
                for g in state.values()):
            # no profile (rule 2): only an empty GPU or one running a single well-known job can
            # take it, and none with its budget free is either; no per-GPU assessment needed
            append(_decision(c.job_id, WAIT, reason=stranger_text + down, details={"need": c.budget}))
            continue
        fitting = [g for g in state.values() if g.free >= c.budget and (not only or gpu_allowed(g.view, c.gpu_ids,
                                                                                                c.gpu_type))]
        if len(fitting) < c.gpus:
            among = f" among the GPUs it may use ({_only_text(c.gpu_ids, c.gpu_type)})" if only else ""
            if only and sum(1 for g in state.values() if gpu_allowed(g.view, c.gpu_ids, c.gpu_type)) < c.gpus:
                # the GPUs it may use take nothing new (drained, lost, held): that is why, not memory
                append(Decision(c.job_id, WAIT, reason=f"waiting: the GPUs it may use "
                                f"({_only_text(c.gpu_ids, c.gpu_type)}) take no new job now{down}",
                                details={"need": c.budget, "most_free": most_free}))
                continue
            append(Decision(c.job_id, WAIT, reason=(
                f"waiting for memory: needs {format_size(c.budget)} on {c.gpus} GPU(s), "
                f"{len(fitting)} GPU(s){among} have that much free budget{down}"),
                details={"need": c.budget, "most_free": most_free}))
            continue
        arr = _arrays(c.profile, cfg.step, cfg.horizon) if c.profile is not None else None
        # Best fit first; the first placement predicted to cost nobody anything is the answer,
        # so most candidates are assessed on one or two GPUs, and each assessment is memoised.
        fitting.sort(key=lambda g: (g.free - c.budget, g.view.index))
        options, free_ones = [], 0
        for g in fitting:
            uid_ok = cfg.multi_user_mps or all(r.uid == c.uid for r in g.res if r.mode == "mps")
            # the uid matters only through uid_ok, and through what its owner learned when per user
            rk = (id(c.profile), uid_ok, g.view.uuid, c.uid if per_uid else None)
            got = refused.get(rk)  # within a pass a GPU only gets busier: a refusal stands
            if got is None:
                k = rk + (g.version,)
                got = memo.get(k)
                if got is None:
                    lrn, ccfg = for_uid(c.uid) if learned is not None else (None, cfg)
                    got = memo[k] = _assess(arr, c.uid, g, ccfg, lrn)
                    if got[0] is None:
                        refused[rk] = got
            options.append((g, got))
            if got[0] is not None and not got[3]:
                free_ones += 1
                if free_ones >= c.gpus:
                    break
        ok = [(g, a) for g, a in options if a[0] is not None]
        if len(ok) < c.gpus:
            g, a = options[0]
            text = f"waiting: {a[1]}"
            append(_decision(c.job_id, WAIT, reason=text, details=dict(a[2])))
            if prev is None or c.budget < prev[0]:
                refused_like[same] = (c.budget, text, a[2])
            continue
        # predicted-free placements first, then best fit (least budget left over)
        ok.sort(key=lambda ga: (ga[1][3], ga[0].free - c.budget, ga[0].view.index))
        chosen = ok[: c.gpus]
        modes = {a[0] for _, a in chosen}
        mode = modes.pop() if len(modes) == 1 else "timesliced"
        if mode == "timesliced" and any(g.view.compute_mode != "default" for g, _ in chosen):
            append(Decision(c.job_id, WAIT, reason="waiting: no set of GPUs takes this job in one mode"))
            continue
        # A profile no run has shown alone here is measured against a stored alone time nobody
        # has checked, so the slowdown its shared runs show may be off by as much as that time is
        # (ALONE_DOUBT, which the check must then assume). Once, when it would start on an empty
        # GPU anyway, it runs alone there to the end, and its end teaches its alone time.
        check = (cfg.check_alone and learned is not None and len(chosen) == 1 and not chosen[0][0].res and arr is not None and arr.name
                 and not getattr(c.profile, "provisional", False) and arr.name not in checking
                 and arr.name not in for_uid(c.uid)[0].alone and not _measured_on(c.profile, chosen[0][0].view))
        if check:
            checking.add(arr.name)
        if c.profile is None and c.family:
            sampled.setdefault((c.uid, c.family), c.job_id)
        for g, _ in chosen:
            g.free -= c.budget
            g.res.append(_Res(c.job_id, arr, 0, mode, c.uid, bool(check)))
            g.version += 1
        most_free = max((g.free for g in state.values()), default=0)
        g0, a0 = chosen[0]
        reason = a0[1] if a0[0] == mode else f"time-sliced on {', '.join(f'GPU{g.view.index}' for g, _ in chosen)}"
        details = dict(a0[2], mode=mode, budget=c.budget, left=g0.free, usable=g0.view.usable,
                       predicted_slowdown=max(float(a[2].get("slowdown_this", {}).get(mode, 1.0)) for _, a in chosen))
        if c.grow:
            details["grow"] = True
        if check:
            details["check_alone"] = True
            reason += "; alone this once, so that how long its profile takes alone here is learned"
        tp = thread_pct(arr, cfg) if (mode == "mps" and arr is not None) else None
        if tp is not None:
            details["thread_pct"] = tp
        append(Decision(c.job_id, START, tuple(g.view.uuid for g, _ in chosen), mode,
                        f"{reason}; {_mem_text(g0, g0.free)}", details, tp))
    if cfg.lend > 1.0 and any(c.grow for c in candidates):
        _lend(out, candidates, state, cfg)
    return out


def _lend(out: list[Decision], candidates: Sequence[Candidate], state: dict[str, "_Gpu"], cfg: PolicyConfig) -> None:
    """Memory left on a GPU after this pass that no job still queued fits in goes to the --grow
    jobs started there, up to `lend` x their budget (in 256 MiB steps): invariant 1 holds (the
    budgets it raises are what the GPU had free), and nobody waits for it."""
    started = {d.job_id for d in out if d.action == START}
    smallest = min((c.budget for c in candidates if c.gpus and c.job_id not in started), default=None)
    for i, d in enumerate(out):
        if d.action != START or len(d.gpus) != 1 or not d.details.get("grow"):
            continue
        g = state.get(d.gpus[0])
        if g is None or (smallest is not None and g.free >= smallest):
            continue
        budget = d.details["budget"]
        extra = min(g.free, step_up(budget * cfg.lend) - budget) // STEP * STEP
        if extra <= 0:
            continue
        g.free -= extra
        out[i] = dataclasses.replace(d, reason=f"{d.reason}; {format_size(extra)} more lent (--grow: no queued job fits in it)",
                                     details={**d.details, "budget": budget + extra, "asked": budget, "left": g.free})
