"""The co-run performance model: how fast each job on a GPU progresses, given what the jobs
sharing it demand at this moment. Used by the simulator (as its physics) and by the policy (to
predict whether co-running pays). Every parameter lives here, with the figure it came from.

Terms. `sm` is the fraction of the GPU's SMs a job keeps busy when it runs alone (0..1); `membw`
the fraction of memory bandwidth it uses alone (0..1). A job's *rate* is its progress relative
to running alone: 1.0 means no slowdown, 0.5 means it takes twice as long.

Model.
- Contexts. All MPS clients of a GPU form one context (the MPS server); every time-sliced job is
  a context of its own. Contexts with work share the GPU in time slices: a context that keeps
  the GPU busy a fraction u of the time (u = min(1, sm / BUSY_SM)) gets its share of
  min(1, 1 / sum(u)), less the switching cost SWITCH_COST once more than one context is busy.
- Inside the MPS context, kernels of the clients run at once: while the summed SM demand D stays
  at or below 1 nobody slows down; past it each client gets 1/D. Summed bandwidth B past 1
  slows every client by a factor 1 + K * (B - 1): K = K_CACHE when two or more of the clients
  are cache/bandwidth-bound (they evict each other's working sets), else K_BW.
- A job that uses no GPU at this moment (sm = 0, e.g. loading data) is not slowed.

Calibration (docs/invariants.md, "Why share at all"):
- "MPS halves the time of two co-running jobs when they leave the GPU unsaturated (0.74 s vs
  1.50 s)": two jobs of sm 0.35, membw 0.3, 0.74 s alone. MPS: D = 0.7, both at rate 1: 0.74 s.
  Time-sliced: both contexts busy (u = 1), each gets (1 - SWITCH_COST) / 2, so
  2 * 0.74 / (1 - SWITCH_COST) = 1.50  ->  SWITCH_COST = 1 - 1.48 / 1.50 = 0.01333.
- "3.6x slower when both are cache-bound and saturate it (223.6 s vs 61.5 s)": two cache-bound
  jobs of sm 1.0, membw 0.9. Time-sliced: 2 T / (1 - SWITCH_COST) = 61.5 s -> T = 30.34 s alone.
  MPS: D = 2, B = 1.8, rate = 0.5 / (1 + K_CACHE * 0.8); both end at 2 T (1 + 0.8 K_CACHE) =
  223.6 s  ->  K_CACHE = (223.6 / 60.68 - 1) / 0.8 = 3.356.
- K_BW and BUSY_SM are not calibrated by a published figure; they are stated assumptions
  (bandwidth contention of jobs that are not cache-bound is mild; a job keeping a quarter of the
  SMs busy already has kernels queued all the time). tests/test_sim.py checks both calibrated
  figures through the simulator itself.
"""
from __future__ import annotations

import numpy as np

SWITCH_COST = 1.0 - 1.48 / 1.50  # time-slice switching, from 0.74 s vs 1.50 s
K_CACHE = (223.6 / (2 * 61.5 * (1.48 / 1.50) / 2) - 1.0) / 0.8  # from 223.6 s vs 61.5 s
K_BW = 0.5  # assumption: bandwidth oversubscription between jobs that are not cache-bound
BUSY_SM = 0.25  # assumption: SM activity from which a job's kernels keep the GPU busy

# The calibration workloads, used by tests and docs/sim.md.
CAL_LIGHT = dict(sm=0.35, membw=0.3, runtime=0.74, cache_bound=False)  # pair: MPS 0.74 s, TS 1.50 s
CAL_HEAVY = dict(sm=1.0, membw=0.9, runtime=61.5 * (1.48 / 1.50) / 2, cache_bound=True)  # 223.6 s vs 61.5 s


def rates(sm: np.ndarray, membw: np.ndarray, cache_bound: np.ndarray, mps: np.ndarray) -> np.ndarray:
    """Progress rate of each job at each instant.

    sm, membw: shape (jobs, T) demands; cache_bound, mps: shape (jobs,) booleans (mps: the job is
    an MPS client; else it is a time-sliced context of its own). Returns shape (jobs, T).
    """
    return contexts(sm, membw, cache_bound, mps, K_CACHE, K_BW, BUSY_SM, SWITCH_COST)


def contexts(sm, membw, cache_bound, mps, k_cache: float, k_bw: float, busy_sm: float,
             switch_cost: float) -> np.ndarray:
    """The structure above with its parameters given: the policy's model passes its own, and the
    simulator's truths (colo/sched/truth.py) theirs, so that tuning one never moves the other."""
    sm, membw, cache_bound, mps = columns(sm, membw, cache_bound, mps)
    busy = np.minimum(1.0, sm / busy_sm)
    inner = np.ones_like(sm)
    if mps.any():
        d = sm[mps].sum(axis=0)
        b = membw[mps].sum(axis=0)
        active_cache = ((sm[mps] > 0) & cache_bound[mps][:, None]).sum(axis=0)
        k = np.where(active_cache >= 2, k_cache, k_bw)
        slow = (1.0 + k * np.maximum(0.0, b - 1.0)) * np.maximum(1.0, d)
        inner[mps] = 1.0 / slow
        group_busy = np.minimum(1.0, busy[mps].sum(axis=0))
    else:
        group_busy = np.zeros(sm.shape[1])
    out = inner * time_slices(group_busy, busy[~mps], switch_cost)[None, :]
    return np.where(sm > 0, out, 1.0)


def columns(sm, membw, cache_bound, mps) -> tuple:
    """The inputs as arrays: demands of shape (jobs, T) (one instant when given per job), flags
    of shape (jobs,)."""
    sm = np.asarray(sm, dtype=float)
    membw = np.asarray(membw, dtype=float)
    if sm.ndim == 1:
        sm, membw = sm[:, None], membw[:, None]
    return sm, membw, np.asarray(cache_bound, dtype=bool), np.asarray(mps, dtype=bool)


def time_slices(group_busy: np.ndarray, ts_busy: np.ndarray, switch_cost: float) -> np.ndarray:
    """Each busy context's share of the GPU's time at each instant: the MPS group (busy
    `group_busy` of the time) and each time-sliced context (rows of `ts_busy`) share it, less the
    switching cost once two or more are busy."""
    total = group_busy + ts_busy.sum(axis=0)
    n_ctx = (group_busy > 0).astype(int) + (ts_busy > 0).sum(axis=0)
    share = np.minimum(1.0, 1.0 / np.maximum(total, 1e-12))
    return np.where(n_ctx > 1, share * (1.0 - switch_cost), 1.0)
