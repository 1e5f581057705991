"""oracle-bound: a reference, not a baseline (it reads the truth; calibration only), and
forecast(), the truth's own physics stepped forward for a set of runs on one GPU."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from . import truth as simtruth
from .simnode import SimRun


def forecast(truth: simtruth.Truth, members: Sequence[tuple], now: float, capacity: int,
             memo: dict | None = None, deadlines: np.ndarray | None = None) -> np.ndarray | None:
    """When each of `members` ((run, progress, mode) on one GPU, from now, nobody else starting)
    really ends under the truth's own physics, stepping as simulate() does; None when their real
    memory passes `capacity` at some instant on the way. The last one left runs alone (rate 1).
    memo: the truth's rates per (run, point, mode) set, kept by the caller across calls (the same
    sets come back at every re-plan). deadlines: None as soon as one of them must end after its
    own (no job runs faster than alone), which spares following a set that cannot pass."""
    memo = {} if memo is None else memo
    k = len(members)
    p = np.array([m[1] for m in members], dtype=float)
    runs = [m[0] for m in members]
    rt = np.array([r.runtime for r in runs])
    step = np.array([r.step for r in runs])
    npts = np.array([r.n for r in runs])
    cb = np.array([r.cache_bound for r in runs])
    mps = np.array([m[2] == "mps" for m in members])
    corun = np.array([r.corun for r in runs])
    end = np.full(k, np.nan)
    alive = np.array([x < y - 1e-6 for x, y in zip(p, rt)])
    end[~alive] = now
    t = now
    while alive.sum() >= 2:
        idx = np.flatnonzero(alive)
        if deadlines is not None and (t + rt[idx] - p[idx] > deadlines[idx] + 1e-6).any():
            return None
        seg = np.minimum((p[idx] / step[idx] + 1e-9).astype(int), npts[idx] - 1)
        if sum(int(runs[i].mem[s]) for i, s in zip(idx, seg)) > capacity:
            return None
        key = tuple((runs[i].seq, int(s), bool(mps[i])) for i, s in zip(idx, seg))
        rate = memo.get(key)
        if rate is None:
            sm = np.array([runs[i].sm[s] for i, s in zip(idx, seg)])
            bw = np.array([runs[i].membw[s] for i, s in zip(idx, seg)])
            rate = memo[key] = truth.rates(sm, bw, cb[idx], mps[idx], corun[idx])[:, 0]
        bound = np.minimum(rt[idx], (seg + 1) * step[idx])
        dt = max(0.0, float(np.min((bound - p[idx]) / rate)))
        p[idx] = np.minimum(rt[idx], p[idx] + rate * dt)
        t += dt
        done = idx[p[idx] >= rt[idx] - 1e-6]
        end[done] = t
        alive[done] = False
    for i in np.flatnonzero(alive):  # alone: every truth runs a job alone at its alone speed
        end[i] = t + rt[i] - p[i]
    if deadlines is not None and (end > deadlines + 1e-6).any():
        return None
    return end


def _realisation(r: SimRun) -> tuple:
    key = r.__dict__.get("_realisation")
    if key is None:
        key = r.__dict__["_realisation"] = (r.runtime, r.step, r.cache_bound, r.corun, r.sm.tobytes(),
                                             r.membw.tobytes(), r.mem.tobytes())
    return key


def oracle_bound(now, queue, running, node, cfg, truth: simtruth.Truth, memo: dict | None = None):
    """A reference, not a policy (it reads the truth; calibration only, never a baseline): the
    makespan a packer reaches while keeping every job within `slowdown_bound`, to tell whether an
    aim is reachable at all with the bound kept. Shortest *real* run time first; on each GPU, a
    job starts beside those there when, by the truth's own physics from where each of them is
    now (forecast()), their real memory fits the GPU at every instant, every one of them (the
    newcomer included) ends within the bound of its real alone time counted from its own start
    (so no later start can push an earlier job past it: a start re-checks everyone's whole run),
    and the GPU drains no later than if the newcomer waited for the others to end; under MPS or
    time-sliced, whichever drains sooner. No budgets (it knows what each job uses). Greedy, so
    its makespan is what keeping the bound certainly allows, not the best that could."""
    bound = cfg.slowdown_bound
    out = []
    q = sorted(queue, key=lambda r: (r.runtime, r.seq))
    for g in node:
        here = [(r, r.p, r.mode) for r in g.runs]
        starts = [r.start for r in g.runs]
        drain = None
        tried = set()
        for r in list(q):
            if int(r.mem.max()) > g.capacity:
                continue  # never fits: stays queued (lost at the end, as under any policy)
            same = _realisation(r)  # a job identical to one refused here in this pass is refused too
            if same in tried:
                continue
            if not here:
                choice = "mps"
            else:
                if drain is None:  # when those already here end, nobody else starting
                    ends = forecast(truth, here, now, g.capacity, memo)
                    drain = float(ends.max()) if ends is not None else now
                drain_after = drain + r.runtime
                choice, best = None, math.inf
                # each job within the bound from its own start, and nobody past the drain of waiting
                deadlines = np.minimum(np.array(starts + [now]) + bound * np.array([m[0].runtime for m in here] + [r.runtime]),
                                       drain_after)
                for mode in ("mps", "timesliced"):
                    e = forecast(truth, here + [(r, 0.0, mode)], now, g.capacity, memo, deadlines)
                    if e is not None and e.max() < best:
                        choice, best = mode, float(e.max())
                if choice is None:
                    tried.add(same)
                    continue
            here.append((r, 0.0, choice))
            starts.append(now)
            drain, tried = None, set()
            q.remove(r)
            out.append((r, g.index, choice, None))
    return out
