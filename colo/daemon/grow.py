"""--grow: the budget a job of one GPU is planned with (its profile's runs), and what its start
says of a budget raised beyond what it asked for (learned, or lent by plan() where no queued
job could use the memory). The scheduler calls these on each pass's decisions."""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING

from ..jobs import Job
from ..sched import fairshare, policy
from ..units import format_size

if TYPE_CHECKING:
    from .learner import Learner


def grow_note(budget: int, asked: int, learned: int | None) -> str:
    """What `colo explain` and the job's events say of a budget --grow raised at its start
    (learned: the part its profile's runs gave, the rest lent)."""
    how = ("its profile's runs used that much (+10 %)" if learned and learned >= budget else
           f"{format_size(learned)} from its profile's runs, the rest lent" if learned else "lent")
    return f"budget {format_size(budget)} (asked {format_size(asked)}; {how}: --grow)"


def budget_of(j: Job, learner: Learner, views: list[policy.GpuView], limits: fairshare.Limits) -> int:
    """The budget a --grow job of one GPU is planned with: the most its profile's runs used
    + 10 % when more than it asked for, as learned from its own user's runs only (invariant
    13: no one else's runs, no profile file a user hands in), at most what a GPU it may use
    can give and its user's memory limit. plan() then holds it to invariant 1 like any budget."""
    asked = j.spec.gpu_mem
    mine = learner.learned.get(j.uid)
    if j.spec.gpus != 1 or mine is None or not mine.max_mem:
        return asked
    got = mine.suggest_budget(learner.profile_name(j))
    if not got or got <= asked:
        return asked
    cap = max((v.usable for v in views if v.error is None
               and policy.gpu_allowed(v, j.spec.gpu_ids, j.spec.gpu_type)), default=asked)
    if limits.gpu_mem:
        cap = min(cap, limits.gpu_mem)
    return max(asked, min(got, cap))


def grown(decisions: list[policy.Decision], open_jobs: dict[int, Job], cands: dict[int, policy.Candidate]) -> list[int]:
    """Starts of --grow jobs with more than they asked for (lent by plan(), or planned with
    their learned budget): what they asked, what was lent and what was learned go beside the
    budget in their details. Changed in place; returns their indices."""
    out = []
    for i, d in enumerate(decisions):
        if d.action != policy.START:
            continue
        j = open_jobs.get(d.job_id)
        if j is None or not j.spec.grow or d.details.get("budget", j.spec.gpu_mem) == j.spec.gpu_mem:
            continue
        c = cands.get(d.job_id)
        learned = c.budget if c is not None and c.budget > j.spec.gpu_mem else None
        budget, asked = d.details["budget"], j.spec.gpu_mem
        details = {**d.details, "asked": asked, "lent": budget - (learned or asked)}
        if learned:
            details["learned_budget"] = learned
        decisions[i] = dataclasses.replace(d, details=details)
        out.append(i)
    return out


def lent_fairly(decisions: list[policy.Decision], grown: list[int], views: list[policy.GpuView],
                placed: list[policy.Placed], open_jobs: dict[int, Job], budgets: Counter) -> None:
    """plan() lends out of memory no job it was given fits in; it is not given every queued
    job (a pass for new jobs plans those only; jobs waiting for a dependency, a hold or a limit
    are not planned). A lend stands only where no queued GPU job at all, of anyone, fits in
    what its GPU has left: --grow never takes memory from a job that waits. In place."""
    lent = [i for i in grown if decisions[i].details.get("lent")]
    if not lent:
        return
    starts = [d for d in decisions if d.action == policy.START]
    leaving = Counter(open_jobs[d.job_id].spec.gpu_mem for d in starts if open_jobs[d.job_id].spec.gpus)
    smallest = min((b for b, n in budgets.items() if n > leaving[b]), default=None)
    if smallest is None:
        return
    free = policy.free_budget(views, placed)
    for d in starts:
        for u in d.gpus:
            if u in free:
                free[u] -= d.details.get("budget", open_jobs[d.job_id].spec.gpu_mem)
    for i in lent:
        d = decisions[i]
        extra = d.details["lent"]
        if d.gpus and free.get(d.gpus[0], 0) >= smallest - extra:
            free[d.gpus[0]] += extra
            decisions[i] = dataclasses.replace(
                d, reason=f"{d.reason}; not lent after all: a queued job fits in what its GPU has left",
                details={**d.details, "budget": d.details["budget"] - extra, "lent": 0})


def said(decisions: list[policy.Decision], grown: list[int]) -> None:
    """The budget a start under --grow gives, in its reason (`colo explain`, the job's events)."""
    for i in grown:
        d = decisions[i]
        det = d.details
        if d.action == policy.START and det["budget"] != det["asked"]:
            decisions[i] = dataclasses.replace(d, reason=f"{d.reason}; " + grow_note(
                det["budget"], det["asked"], det.get("learned_budget") if det.get("lent") else det["budget"]))
