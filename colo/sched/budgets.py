"""Memory budgets outside the placement pass: free budget per GPU, whether a suspended job can be
restored, whom to suspend for a waiting job, and the refusals at submission (--gpu-id/--gpu-type,
a budget no GPU can hold); and the step the budgets colo picks move in, and what --grow grows one by."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..units import format_size
from .views import GpuView, Placed

STEP = 256 * 1024**2  # a budget colo picks (suggested, grown, lent, a mix's) is a whole number of these
GROW = 1.25  # --grow: a budget that refused an allocation grows at least this much (the daemon and colo sim)


def step_up(n: float, step: int = STEP) -> int:
    """n bytes rounded up to a whole number of steps."""
    return int(math.ceil(n / step) * step)


def free_budget(gpus: Sequence[GpuView], placed: Sequence[Placed]) -> dict[str, int]:
    free = {g.uuid: g.usable for g in gpus}
    for p in placed:
        for u in p.gpus:
            if u in free:
                free[u] -= p.budget
    return free


def resume_refusal(budget: int, gpus: Sequence[str], views: Sequence[GpuView],
                   placed: Sequence[Placed]) -> str | None:
    """Why a suspended job cannot be restored now, or None. Only on its own GPUs: its device
    addresses must stay valid, so the driver restores it where it was (`placed`: the others)."""
    free = free_budget(views, placed)
    for u in gpus:
        if u not in free:
            return f"its GPU {u[:12]} is no longer here"
        if (v := next(g for g in views if g.uuid == u)).drained:  # colo drain --now suspended it there
            return f"waits for GPU {v.index} to be undrained ({v.drained})"
        if free[u] < budget:
            idx = next((g.index for g in views if g.uuid == u), "?")
            return (f"waits for GPU {idx} to have its {format_size(budget)} free again "
                    f"({format_size(max(free[u], 0))} free now)")
    return None


@dataclass(frozen=True)
class Holder:
    """A running job that a suspend could take GPU memory from (colo suspend's policies)."""
    job_id: int
    gpu: str  # its one GPU (jobs on several are not suspended by a policy)
    budget: int
    priority: int = 0
    idle_since: float | None = None  # idle (idle_after) since then, or None
    idle_policy: bool = False  # idle_jobs / idle_sessions say `suspend` for it
    preemptible: bool = False  # preempt = suspend, time-sliced, not --no-suspend, not an MPS client


def suspend_victims(budget: int, priority: int, holders: Sequence[Holder],
                    free: dict[str, int]) -> tuple[str | None, list[int]]:
    """Where a waiting job (budget per GPU, one GPU, priority) can go and whom to suspend for it
    there: the GPU that needs the fewest busy jobs preempted, then the fewest suspends; there the
    longest-idle holders first, then (preempt) holders of a lower priority, the lowest first.
    Never more than it takes. (gpu, []) when it fits already; (None, []) when no set suffices."""
    best: tuple[int, int, list[int], str] | None = None
    for gpu, room in free.items():
        if room >= budget:
            return gpu, []  # it fits already: the scheduler places it
        idle = sorted((h for h in holders if h.gpu == gpu and h.idle_policy and h.idle_since is not None),
                      key=lambda h: (h.idle_since, h.job_id))
        low = sorted((h for h in holders if h.gpu == gpu and h.preemptible and h.priority < priority
                      and h not in idle), key=lambda h: (h.priority, h.job_id))
        chosen: list[int] = []
        for h in [*idle, *low]:
            if room >= budget:
                break
            chosen.append(h.job_id)
            room += h.budget
        rank = (max(len(chosen) - len(idle), 0), len(chosen), chosen, gpu)
        if room >= budget and (best is None or rank[:2] < best[:2]):
            best = rank
    return (best[3], best[2]) if best else (None, [])


def gpu_allowed(g: GpuView, ids: Sequence[int] = (), kind: str | None = None) -> bool:
    """May a job with --gpu-id `ids` / --gpu-type `kind` use this GPU? (empty/None: any)"""
    return (not ids or g.index in ids) and (not kind or kind.casefold() in g.name.casefold())


def _only_text(ids: Sequence[int], kind: str | None) -> str:
    return " and ".join(x for x in ((f"--gpu-id {','.join(map(str, ids))}" if ids else ""),
                                     (f"--gpu-type {kind!r}" if kind else "")) if x)


def gpu_filter_refusal(ids: Sequence[int], kind: str | None, ngpus: int, gpus: Sequence[GpuView]) -> str | None:
    """Why no GPU of this node can ever take a job restricted by --gpu-id/--gpu-type, or None."""
    if not ids and not kind:
        return None
    ok = [g for g in gpus if gpu_allowed(g, ids, kind)]
    if len(ok) >= ngpus:
        return None
    here = ", ".join(f"GPU{g.index} {g.name}" for g in gpus) or "none"
    return f"{_only_text(ids, kind)} leaves {len(ok)} GPU(s) for a job of {ngpus} (this node has: {here})"


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
