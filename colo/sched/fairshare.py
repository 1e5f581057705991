"""Fair share across users and per-user limits. Pure: no I/O, no clock (callers pass `now`).

A user's recent GPU use is the GPU memory their jobs held (budget x GPUs) over time, in GiB-hours,
each moment's use decaying with a half-life, as in Slurm's fair-share factor: use from one
half-life ago counts half. The next job comes from the user with the least recent use; within a
user's own jobs, priority and then submission order. So a user who queued 1,000 jobs does not
keep another user's one job waiting behind them; users take turns, least use first.

The daemon feeds the resulting order to policy.plan() through Candidate.seq; `colo sim` can do
the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Sequence, TypeVar

T = TypeVar("T")

GiB = 1024**3
HOUR = 3600.0


def weight(budget: int, gpus: int) -> float:
    """GPU use of a job while it holds its budget: GiB of GPU memory."""
    return budget * gpus / GiB


def interval_use(w: float, start: float, end: float, now: float, half_life: float) -> float:
    """Use of weight `w` held from `start` to `end`, decayed to `now`, in GiB-hours."""
    if end <= start:
        return 0.0
    if half_life <= 0:
        return w * (end - start) / HOUR
    k = math.log(2) / half_life
    return w / k * (math.exp(-k * (now - end)) - math.exp(-k * (now - start))) / HOUR


@dataclass
class Ledger:
    """Use of ended jobs per uid, each kept as a value at a time and decayed when read."""
    half_life: float
    _val: dict[int, tuple[float, float]] = field(default_factory=dict)  # uid -> (GiB-h, as of)

    def add(self, uid: int, w: float, start: float, end: float) -> None:
        v, at = self._val.get(uid, (0.0, end))
        ref = max(at, end)
        self._val[uid] = (self._decay(v, ref - at) + interval_use(w, start, end, ref, self.half_life), ref)

    def _decay(self, v: float, dt: float) -> float:
        return v if self.half_life <= 0 else v * 0.5 ** (dt / self.half_life)

    def usage(self, now: float, running: Iterable[tuple] = ()) -> dict[int, float]:
        """uid -> recent use at `now` (GiB-hours): ended jobs plus `running` (uid, weight, started_at)
        or (uid, weight, start, end) for a span that ends before now (held_span)."""
        out = {uid: self._decay(v, max(0.0, now - at)) for uid, (v, at) in self._val.items()}
        for uid, w, started, *end in running:
            out[uid] = out.get(uid, 0.0) + interval_use(w, started, end[0] if end else now, now, self.half_life)
        return out


def held_span(start: float, end: float, off: float = 0.0, off_since: float | None = None) -> tuple[float, float]:
    """The span a job counts as using its GPUs: it ran from `start` to `end` but was suspended
    (its memory in host memory, nothing running: colo suspend) for `off` seconds before and, when
    `off_since` is given, from then on. The held seconds count in full, as one span that ends when
    it last held its GPU (earlier suspended time taken from its start): the GiB-hours are exact
    without decay; with decay they count as slightly more recent than they were."""
    last = min(end, off_since) if off_since is not None else end
    return min(last, start + max(0.0, off)), last


def fair_walk(queues: Mapping[int, Iterable[T]], usage: Mapping[int, float]) -> Iterator[T]:
    """Jobs in the order they should be considered, lazily. `queues`: uid -> that user's jobs in
    their own order (priority, then submission). Users take turns, the one with the least recent
    use first in every round (ties: lower uid). Lazy, so a scheduler can stop early."""
    its = [iter(queues[u]) for u in sorted(queues, key=lambda u: (usage.get(u, 0.0), u))]
    while its:
        alive = []
        for it in its:
            for job in it:
                yield job
                alive.append(it)
                break
        its = alive


def fair_order(jobs: Sequence[tuple[int, int, int, int]], usage: Mapping[int, float]) -> list[int]:
    """Job ids in fair-share order. `jobs`: (job_id, uid, priority, seq)."""
    by_user: dict[int, list[tuple[int, int, int]]] = {}
    for job_id, uid, prio, seq in jobs:
        by_user.setdefault(uid, []).append((-prio, seq, job_id))
    for lst in by_user.values():
        lst.sort()
    return [j for _, _, j in fair_walk(by_user, usage)]


@dataclass(frozen=True)
class Limits:
    """Per-user limits; 0 means none."""
    queued: int = 0  # jobs waiting at once (refused at submit past it)
    running: int = 0  # jobs running at once
    gpu_mem: int = 0  # bytes of GPU memory budgeted at once, over all GPUs


@dataclass
class UserLoad:
    running: int = 0
    gpu_mem: int = 0  # bytes budgeted, over all GPUs


def submit_refusal(limits: Limits, user: str, queued: int, tasks: int = 1) -> str | None:
    """Why a user with `queued` jobs waiting may not queue `tasks` more (an array's tasks), or None."""
    if not limits.queued or queued + tasks <= limits.queued:
        return None
    if tasks == 1:
        return (f"{user} has {queued} jobs queued, the most one user may queue here (max_queued_per_user); "
                "wait for some to start or cancel some")
    return (f"{user} has {queued} jobs queued and asks for {tasks} more, past {limits.queued}, the most one user "
            "may queue here (max_queued_per_user; an array counts its tasks); wait for some to start or cancel some")


def start_refusal(limits: Limits, user: str, load: UserLoad, budget: int, gpus: int) -> str | None:
    """Why a job of `user` may not start now given what that user holds, or None."""
    if limits.running and load.running >= limits.running:
        return (f"waiting for a limit: {user} has {load.running} job(s) running, the most one user may run "
                f"at once (max_running_per_user)")
    need = budget * gpus
    if limits.gpu_mem and load.gpu_mem + need > limits.gpu_mem:
        return (f"waiting for a limit: {user}'s running jobs hold {load.gpu_mem / GiB:.1f} GiB of GPU memory; "
                f"this job's {need / GiB:.1f} GiB would pass {limits.gpu_mem / GiB:.1f} GiB, the most one user "
                "may hold at once (max_gpu_mem_per_user)")
    return None
