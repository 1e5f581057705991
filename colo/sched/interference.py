"""The co-run performance model: how fast each job on a GPU progresses, given what the jobs
sharing it demand at this moment. Used by the simulator (as its physics) and by the policy (to
predict whether co-running pays). Every parameter lives here, with the figure it came from.

Terms. `sm` is the fraction of the GPU's SMs a job keeps busy when it runs alone (0..1); `membw`
the fraction of memory bandwidth it uses alone (0..1). A job's *rate* is its progress relative
to running alone: 1.0 means no slowdown, 0.5 means it takes twice as long.

Model.
- Contexts. All MPS clients of a GPU form one context (the MPS server); every time-sliced job is
  a context of its own. Contexts with work share the GPU in time slices: a context keeps the GPU
  busy u = min(1, sm / BUSY_SM) of the time. The GPU serves the contexts with work in turn, and
  one whose queue empties gives the rest of its slice back: a context that needs less than an
  equal share of what is left gets all it needs, and the others split the rest (max-min fair),
  less the switching cost SWITCH_COST once more than one context is busy. So a light job beside
  a heavy one is not slowed, and the heavy one pays for both (as every job paying alike would
  not say: a group the bound passed could slow its heaviest job past it).
- Inside the MPS context, kernels of the clients run at once: while the summed SM demand D stays
  at or below MPS_CAP nobody slows down; past it each client gets MPS_CAP / D. Summed bandwidth B
  past 1 slows every client by a factor 1 + K * (B - 1): K = K_CACHE when two or more of the
  clients are cache/bandwidth-bound (they evict each other's working sets), else K_BW.
- A job that uses no GPU at this moment (sm = 0, e.g. loading data) is not slowed.

Calibration (the H200 of docs/gpu.md, bench/results/gpu-2026-11-28; the simulator's `h200` truth
is fitted to the same figures by code of its own, colo/sched/fitted.py):
- Two saturating 4096² matmul loops (NVML SM ~100 %), 5.4 s each alone, ran 10.8 s back to back,
  8.9 s time-sliced (1.21x) and 8.1 s under MPS (1.33x). Time-sliced: each context busy
  1 / BUSY_SM, both share 1 / (2 / BUSY_SM): 2 / BUSY_SM = 1 / 0.605 -> BUSY_SM = 1.21. MPS: D = 2,
  each at MPS_CAP / 2 = 1 / 1.5 -> MPS_CAP = 1.33.
- Six light PyTorch jobs (SM 3 % mean, 12 % peak) time-sliced at once were not slowed past their
  run-to-run spread: SWITCH_COST = 0. The placement study's light pair under MPS (0.74 s, not
  slowed) holds; its 1.50 s time-sliced does not: the H200 contradicts it.
- The cache-bound heavy pair (sm 1.0, membw 0.9; not measured on the H200): the study's 223.6 s
  under MPS against 61.5 s time-sliced is kept as the model's caution. Time-sliced 2 T / 1.21 x
  = 61.5 s sets T; under MPS both end at T x 1.5 x (1 + 0.8 K_CACHE) = 223.6 s.
- K_BW is not calibrated by any figure; a stated assumption (bandwidth contention of jobs that are
  not cache-bound is mild). tests/test_sim.py checks the calibrated figures through the simulator.
"""
from __future__ import annotations

import numpy as np

BUSY_SM = 1.21  # a context keeps the GPU busy sm / BUSY_SM of the time: 2 x (1 / 1.21) = 1.65, so 2 / 1.65 = 1.21x
SWITCH_COST = 0.0  # no cost of time slices the H200 showed (six light jobs: within run-to-run noise)
MPS_CAP = 2 / 1.5  # MPS clients run kernels at once: summed SM up to 1.33 before 1/D (the pair: 1.5x each, 1.33x)
# The cache-bound pair (not measured on the H200): the placement study's 3.6x slower under MPS than
# time-sliced (223.6 s vs 61.5 s) kept as the model's caution: T = 61.5 / 2 / (1 / BUSY_SM)
# alone; under MPS each runs at 1 / (2 / MPS_CAP x (1 + K 0.8)), both end at 223.6 s.
K_CACHE = (223.6 / (61.5 / 2 * BUSY_SM * 2 / MPS_CAP) - 1.0) / 0.8
K_BW = 0.5  # assumption: bandwidth oversubscription between jobs that are not cache-bound

# The calibration workloads, used by tests and docs/sim.md.
CAL_LIGHT = dict(sm=0.35, membw=0.3, runtime=0.74, cache_bound=False)  # pair: MPS 0.74 s (study), TS 0.74 s (H200)
CAL_HEAVY = dict(sm=1.0, membw=0.9, runtime=61.5 / 2 * BUSY_SM, cache_bound=True)  # 223.6 s vs 61.5 s
CAL_SATURATING = dict(sm=1.0, membw=0.0, runtime=5.4, cache_bound=False)  # the H200's matmul: pair 10.8 s, TS 8.9 s, MPS 8.1 s


def rates(sm: np.ndarray, membw: np.ndarray, cache_bound: np.ndarray, mps: np.ndarray) -> np.ndarray:
    """Progress rate of each job at each instant.

    sm, membw: shape (jobs, T) demands; cache_bound, mps: shape (jobs,) booleans (mps: the job is
    an MPS client; else it is a time-sliced context of its own). Returns shape (jobs, T).
    """
    return contexts(sm, membw, cache_bound, mps, K_CACHE, K_BW, BUSY_SM, SWITCH_COST, MPS_CAP, in_turn=True)


def contexts(sm, membw, cache_bound, mps, k_cache: float, k_bw: float, busy_sm: float,
             switch_cost: float, mps_cap: float = 1.0, in_turn: bool = False) -> np.ndarray:
    """The structure above with its parameters given: the policy's model passes its own, and the
    simulator's truths (colo/sched/truth.py) theirs, so that tuning one never moves the other.
    in_turn: contexts are served in turn (max-min fair, the policy's model); else every busy
    context gets the same share of the GPU's time (the stress worlds' structure)."""
    sm, membw, cache_bound, mps = columns(sm, membw, cache_bound, mps)
    busy = np.minimum(1.0, sm / busy_sm)
    inner = np.ones_like(sm)
    if mps.any():
        d = sm[mps].sum(axis=0)
        b = membw[mps].sum(axis=0)
        active_cache = ((sm[mps] > 0) & cache_bound[mps][:, None]).sum(axis=0)
        k = np.where(active_cache >= 2, k_cache, k_bw)
        slow = (1.0 + k * np.maximum(0.0, b - 1.0)) * np.maximum(1.0, d / mps_cap)
        inner[mps] = 1.0 / slow
        group_busy = np.minimum(1.0, busy[mps].sum(axis=0))
    else:
        group_busy = np.zeros(sm.shape[1])
    if in_turn:
        out = inner * in_turns(group_busy, busy[~mps], mps, switch_cost)
    else:
        out = inner * time_slices(group_busy, busy[~mps], switch_cost)[None, :]
    return np.where(sm > 0, out, 1.0)


def in_turns(group_busy: np.ndarray, ts_busy: np.ndarray, mps: np.ndarray, switch_cost: float) -> np.ndarray:
    """Each job's rate from the GPU's time when contexts are served in turn (shape (jobs, T), jobs
    in the order of `mps`): the GPU's time (1) goes first to the contexts that need least; a
    context that needs no more than an equal share of what is left gets all it needs, the others
    split the rest equally. Less the switching cost once two or more are busy."""
    need = np.vstack([ts_busy, group_busy[None, :]])  # the MPS group last (a zero row without it)
    order = np.argsort(need, axis=0)
    sorted_need = np.take_along_axis(need, order, axis=0)
    left = 1.0 - (np.cumsum(sorted_need, axis=0) - sorted_need)  # time left before each, least first
    equal = left / np.arange(need.shape[0], 0, -1)[:, None]  # an equal share of it among the rest
    # the level the largest needs are held to: the equal share at the first context that needs more
    short = sorted_need > equal
    level = np.where(short.any(axis=0), np.take_along_axis(equal, np.argmax(short, axis=0)[None, :], axis=0)[0], np.inf)
    rate = np.where(need > 0, np.minimum(1.0, level[None, :] / np.maximum(need, 1e-12)), 1.0)
    busy_ctx = (need > 0).sum(axis=0)
    rate = np.where(busy_ctx > 1, rate * (1.0 - switch_cost), rate)
    out = np.empty((len(mps), need.shape[1]))
    out[~mps] = rate[:-1]
    out[mps] = rate[-1]
    return out


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
