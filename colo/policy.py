"""Placement: which queued job starts where, in which mode, and why the others wait.

Pure: no I/O, no clock. The daemon and `colo sim` both call plan(); nothing about scheduling
is written anywhere else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .units import format_size

START = "start"
WAIT = "wait"


@dataclass(frozen=True)
class GpuView:
    uuid: str
    index: int
    usable: int  # bytes: capacity minus the configured reserve
    compute_mode: str = "default"  # default | exclusive_process | prohibited
    mps: str = "off"  # off | active | fault
    name: str = ""


@dataclass(frozen=True)
class Placed:
    """A job that holds budget on GPUs now."""
    job_id: int
    gpus: tuple[str, ...]
    budget: int  # bytes per GPU
    uid: int = 0
    mode: str = "timesliced"
    profile: Any = None
    elapsed: float = 0.0  # seconds since it started


@dataclass(frozen=True)
class Candidate:
    job_id: int
    budget: int  # bytes per GPU
    gpus: int = 1
    uid: int = 0
    priority: int = 0
    seq: int = 0  # submission order
    profile: Any = None


@dataclass(frozen=True)
class Decision:
    job_id: int
    action: str  # START | WAIT
    gpus: tuple[str, ...] = ()
    mode: str | None = None  # "mps" | "timesliced" | "none"
    reason: str = ""
    details: dict = field(default_factory=dict)  # the numbers behind the reason
    thread_pct: int | None = None


@dataclass(frozen=True)
class PolicyConfig:
    reserve: int = 0  # bytes kept free on every GPU
    saturation: float = 0.85
    multi_user_mps: bool = False
    use_mps: bool = True


def free_budget(gpus: Sequence[GpuView], placed: Sequence[Placed]) -> dict[str, int]:
    free = {g.uuid: g.usable for g in gpus}
    for p in placed:
        for u in p.gpus:
            if u in free:
                free[u] -= p.budget
    return free


def can_ever_fit(budget: int, ngpus: int, gpus: Sequence[GpuView]) -> str | None:
    """None when some empty node state could run the job; else why it never can."""
    if ngpus == 0:
        return None
    if ngpus > len(gpus):
        return f"needs {ngpus} GPUs, this node has {len(gpus)}"
    sizes = sorted((g.usable for g in gpus), reverse=True)
    if sizes[ngpus - 1] < budget:
        return (f"budget {format_size(budget)} per GPU is more than the largest usable GPU memory "
                f"({format_size(sizes[0])}, reserve excluded)")
    return None


def order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Priority first, then first come first served."""
    return sorted(candidates, key=lambda c: (-c.priority, c.seq))


def plan(candidates: Sequence[Candidate], gpus: Sequence[GpuView], placed: Sequence[Placed],
         config: PolicyConfig = PolicyConfig()) -> list[Decision]:
    """One decision per candidate, in queue order; a job that cannot start now lets smaller ones
    behind it start (backfill) when they fit."""
    free = free_budget(gpus, placed)
    by_uuid = {g.uuid: g for g in gpus}
    out: list[Decision] = []
    for c in order(candidates):
        if c.gpus == 0:
            out.append(Decision(c.job_id, START, (), "none", "needs no GPU"))
            continue
        usable = [u for u, g in by_uuid.items() if g.compute_mode != "prohibited"]
        fitting = sorted((u for u in usable if free[u] >= c.budget), key=lambda u: free[u] - c.budget)
        if len(fitting) < c.gpus:
            best = max(free.values(), default=0)
            out.append(Decision(c.job_id, WAIT, reason=(
                f"waiting for memory: needs {format_size(c.budget)} on {c.gpus} GPU(s), "
                f"most free budget on one GPU is {format_size(best)}"),
                details={"need": c.budget, "most_free": best}))
            continue
        chosen = tuple(fitting[: c.gpus])  # best fit: the least room left over
        for u in chosen:
            free[u] -= c.budget
        g = by_uuid[chosen[0]]
        out.append(Decision(c.job_id, START, chosen, "timesliced", (
            f"time-sliced on GPU{g.index}: budget {format_size(c.budget)} fits, "
            f"{format_size(free[chosen[0]])} of {format_size(g.usable)} left unbudgeted"),
            details={"budget": c.budget, "left": free[chosen[0]], "usable": g.usable}))
    return out
