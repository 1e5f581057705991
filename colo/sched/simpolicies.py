"""The policies simulate() runs (colo/sched/sim.py), each deciding from the stored profiles only:
colo's own (policy.plan(), unchanged, fed as the daemon's scheduler feeds it) and the baselines it
is compared with (docs/sim.md, "Policies"). oracle-bound, which reads the truth, is not here
(colo/sched/oracle.py)."""
from __future__ import annotations

import math
from typing import Callable

from ..config import Config
from . import fairshare
from . import policy as pol
from .simnode import SimRun, seen_profile

FAIR_HALF_LIFE = Config.fair_share_half_life  # the daemon's default


def colo(now, queue, running, node, cfg, learned: pol.Learned | None = None,
         ledger: fairshare.Ledger | None = None, grow: bool = False, profiles: dict | None = None):
    """colo's own policy: policy.plan(), unchanged, fed as the daemon's scheduler feeds it: the
    queue in fair-share order (Candidate.seq, priority within each user's own queue), what was
    learned (co-run slowdowns, and the profiles learned so far); budgets enforced (the interposer)."""
    views = [pol.GpuView(f"sim-gpu{g.index}", g.index, g.usable, mps="active") for g in node]
    placed = [pol.Placed(r.job.id, (f"sim-gpu{r.gpu}",), r.budget or 0, r.job.uid, r.mode,
                         seen_profile(r, profiles), now - r.start,
                         None if r.expect is None else pol.progress(r.expect, now),
                         bool(r.decision[0].get("check_alone")), r.job.profile.name) for r in running]
    by_id = {r.job.id: r for r in queue}
    usage = (ledger or fairshare.Ledger(FAIR_HALF_LIFE)).usage(
        now, [(r.job.uid, fairshare.weight(r.budget or 0, 1), r.start) for r in running])
    fair = fairshare.fair_order([(r.job.id, r.job.uid, r.job.priority, r.seq) for r in queue], usage)
    cands = []
    for seq, job_id in enumerate(fair):
        r = by_id[job_id]
        seen = seen_profile(r, profiles)
        if grow and learned is not None:  # --grow: start with what earlier runs of its name needed (grow.budget_of)
            got = learned.suggest_budget(r.job.profile.name)
            if got and got > r.ask:
                r.ask = min(got, max(g.usable for g in node))
        cands.append(pol.Candidate(r.job.id, r.ask, 1, r.job.uid, 0, seq, seen, r.job.arrival, r.held, grow,
                                   family=r.job.profile.name))
    out = []
    for d in pol.plan(cands, views, placed, cfg, now=now, learned=learned):
        by_id[d.job_id].held = tuple(d.details.get("held", ()))  # as the daemon keeps its last decision
        if d.action == pol.START:
            r = by_id[d.job_id]
            r.decision = (d.details, d.mode)
            out.append((r, int(d.gpus[0].removeprefix("sim-gpu")), d.mode, int(d.details.get("budget", r.ask))))
    return out


def _exclusive(key):
    def fn(now, queue, running, node, cfg):
        idle = [g for g in node if not g.runs]
        q = sorted(queue, key=key)
        return [(r, g.index, "timesliced", None) for g, r in zip(idle, q)]
    return fn


exclusive_fifo = _exclusive(lambda r: r.seq)
# SJF by the stored run time (the real one is unknown until the job ends); unprofiled jobs last
exclusive_sjf = _exclusive(lambda r: (r.seen.runtime if r.seen is not None and not r.seen.provisional else math.inf,
                                      r.seq))


def _pack(sm_of, mem_of, tetris: bool):
    """Co-locate under MPS while the summed SM (per job: sm_of) stays <= 1 and the summed memory
    (mem_of) within capacity. No budgets: a job may grow past what it was packed by."""
    def fn(now, queue, running, node, cfg):
        load = {g.index: [sum(sm_of(r) for r in g.runs), sum(mem_of(r) for r in g.runs)] for g in node}
        out, q = [], sorted(queue, key=lambda r: r.seq)
        for g in node:
            while q:
                free_sm, free_mem = 1.0 - load[g.index][0], g.capacity - load[g.index][1]
                fits = [r for r in q if (sm_of(r) <= free_sm + 1e-9 or not (g.runs or load[g.index][1]))
                        and mem_of(r) <= free_mem]
                if not fits:
                    break
                # Tetris: the best-aligned job (demand . free); else first fit in arrival order
                r = max(fits, key=lambda r: sm_of(r) * free_sm + mem_of(r) / g.capacity * free_mem / g.capacity) if tetris else fits[0]
                q.remove(r)
                load[g.index][0] += sm_of(r)
                load[g.index][1] += mem_of(r)
                out.append((r, g.index, "mps", None))
        return out
    return fn


# Baselines pack by the profile they have (stored, or learned from a job's run as colo learns it);
# a job without one counts as a full GPU's SM and its budget.
def _stored(attr: str, unknown: Callable[[SimRun], float]) -> Callable[[SimRun], float]:
    return lambda r: getattr(r.seen, attr) if r.seen is not None else unknown(r)


tetris = _pack(_stored("peak_sm", lambda r: 1.0), _stored("peak_mem", lambda r: r.ask), True)
max_pack = _pack(_stored("peak_sm", lambda r: 1.0), _stored("peak_mem", lambda r: r.ask), False)
mean_pack = _pack(_stored("mean_sm", lambda r: 1.0), _stored("mean_mem", lambda r: r.ask), False)


def naive(now, queue, running, node, cfg):
    """Time-slicing replicas: everything starts at once, no budgets."""
    counts = {g.index: len(g.runs) for g in node}
    out = []
    for r in sorted(queue, key=lambda r: r.seq):
        gi = min(counts, key=lambda i: (counts[i], i))
        counts[gi] += 1
        out.append((r, gi, "timesliced", None))
    return out


def mps_all(now, queue, running, node, cfg):
    """Everything at once under MPS, with budgets; for calibration, not a contender."""
    return [(r, i % len(node), "mps", r.job.budget) for i, r in enumerate(sorted(queue, key=lambda r: r.seq))]
