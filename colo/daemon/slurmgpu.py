"""Which of the node's GPUs a job Slurm started here runs on (docs/slurm.md, "Which GPU"): pure
choices over colo's view of the node, for external.External, which owns the state they read (the
GPUs gres/gpu jobs hold, the GPUs kept free for gpu jobs that wait).

Slurm 22.05 puts shards on the first GPU that has them and hands a GPU out whole while shards of
it are in use; where a job may open any of the node's GPU devices (no ConstrainDevices), colo
picks instead: a shard job the least loaded GPU, a gpu job a GPU none of colo's jobs is on.
"""
from __future__ import annotations

import dataclasses
import os
import re

from ..sched import policy
from ..units import format_size_exact as exact

# seconds a GPU is kept free of new jobs for a gres/gpu job colo requeued for want of a whole GPU
# (it comes back after Slurm's credential delay, cred_expire: 120 s by default)
WANT_KEEP = 300.0


def devices_constrained(env=os.environ) -> bool:
    """Whether Slurm's cgroup.conf (beside its slurm.conf) says ConstrainDevices=yes: then a job may
    open only the GPU device files Slurm bound it, and colo must not place it on another GPU."""
    conf = os.path.join(os.path.dirname(env.get("SLURM_CONF") or "/etc/slurm/slurm.conf"), "cgroup.conf")
    try:
        with open(conf) as f:
            text = f.read(1 << 20)
    except OSError:
        return False  # no cgroup.conf: Slurm's default, ConstrainDevices=no
    return any(re.fullmatch(r"\s*constraindevices\s*=\s*yes\s*", line.split("#", 1)[0], re.I)
               for line in text.splitlines())


def no_room(views: list[policy.GpuView], placed: list[policy.Placed], budget: int, why: str,
            unbudgeted: dict[str, int]) -> str:
    """Why none of `views` can hold a job of `budget` now, in exact sizes (15.75GiB, not 16GiB)."""
    out = []
    for v in views:
        mine = sum(p.budget for p in placed if v.uuid in p.gpus)
        outside = unbudgeted.get(v.uuid, 0)
        if mine + budget <= v.usable:  # the memory is there: something else keeps it off
            out.append(f"GPU{v.index}: {why}")
            continue
        out.append(f"GPU{v.index} cannot hold its {exact(budget)} now: {exact(max(0, v.usable - mine))} free of "
                   f"{exact(v.usable + outside)} usable ({exact(mine)} in colo's budgets, "
                   f"{exact(outside)} held outside any budget)")
    return "; ".join(out)


def least_loaded(cand: policy.Candidate, bound: int, views: list[policy.GpuView], placed: list[policy.Placed],
                 held: set[int], kept: dict[int, int], config: policy.PolicyConfig,
                 unbudgeted: dict[str, int]) -> tuple[policy.Decision | None, str]:
    """colo's GPU for a one-GPU shard job Slurm bound to GPU `bound`: the least loaded (budget in
    colo's jobs, then their number; Slurm's own first among equals) of `views` in service that no
    gres/gpu job holds (`held`) and none is kept free for (`kept`: GPU -> Slurm job), on which
    place_now starts it. (decision, "") or (None, why none can hold it now)."""
    ok = [v for v in views if v.in_service and v.index not in held and v.index not in kept]

    def load(v: policy.GpuView) -> tuple:
        on = [p for p in placed if v.uuid in p.gpus]
        return sum(p.budget for p in on), len(on), v.index != bound, v.index

    for v in sorted(ok, key=load):
        dec = policy.place_now(cand, [v], placed, config)
        if dec.action == policy.START:
            if v.index != bound:
                dec = dataclasses.replace(dec, reason=f"{dec.reason} (colo's choice, the least loaded GPU; "
                                                      f"Slurm bound GPU{bound})")
            return dec, ""
    why = [no_room(ok, placed, cand.budget, "colo does not place it there now", unbudgeted)] if ok else []
    why += [f"GPU{i} is kept free for Slurm job {sj} (gres/gpu), which waits for a whole GPU"
            for i, sj in sorted(kept.items())]
    why += [f"GPU{i} is held whole by a gres/gpu job" for i in sorted(held)]
    return None, "; ".join(why) or "no GPU of this node is in service"


def for_whole(n: int, bound: list[int], views: list[policy.GpuView], load: dict[str, int], others: set[int],
              kept: dict[int, int], own: set[int]) -> tuple[list[int], set[int]]:
    """For a gpu job of `n` GPUs that Slurm bound to `bound`: GPUs none of colo's jobs is on (`load`:
    GPU uuid -> colo's budgets there) nor another gpu job holds (`others`) nor kept for another
    (`kept`), those kept for it (`own`) first, then Slurm's; else ([], the GPUs to keep free for it:
    the least loaded)."""
    usable = [v for v in views if v.in_service and v.index not in others and v.index not in kept]
    free = sorted((v for v in usable if not load.get(v.uuid)),
                  key=lambda v: (v.index not in own, v.index not in bound, v.index))
    if len(free) >= n:
        return [v.index for v in free[:n]], set()
    keep = sorted(usable, key=lambda v: (v.index not in own, load.get(v.uuid, 0), v.index))[:n]
    return [], {v.index for v in keep} if len(keep) == n else set()
