"""What jobs *really* do in `colo sim`, kept apart from what the policies predict with.

Every policy (colo's and the baselines) decides from the stored profiles only. The simulator runs
each job from a *realisation* of its profile and moves it with a *physics*; both come from a Truth:

- `exact`: the realisation is the stored profile and the physics is colo's own co-run model
  (colo/interference.py). Measures decisions under the assumption that the model is right; kept for
  calibration checks and as a regression reference, not as evidence.
- `noisy`: each application's real behaviour is drawn around its stored profile (SM and
  bandwidth x 0.7..1.4, duration x 0.8..1.25, peak memory x 1.0..1.15, spreads configurable):
  the profile is off by the same factors for every run of that application within one truth
  seed (it was measured elsewhere, or long ago), and each run's phases are shifted by up to 10 %
  of the run. Every job sharing a GPU with another busy job is slowed by a further 10..30 %
  (drawn per application) that colo's model does not know about.
- `study`: the `noisy` realisation moved by a physics of its own whose parameters are fitted to
  the placement study's table (DESIGN.md "Workloads from the studies") and that reproduces the
  MPS study's pairs exactly: besides colo's structure (contexts in time slices, MPS clients at
  once), co-running jobs interfere once their summed memory bandwidth passes a knee (L2 and
  DRAM contention; time-sliced neighbours evict each other's working sets between slices).
  The fit and its residuals are in docs/sim.md (workloads/calibrate_study.py).

Nothing here is imported by colo/sched/policy.py: the policy cannot see the truth.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from . import interference

TRUTHS = ("exact", "noisy", "study")


@dataclass(frozen=True)
class Spreads:
    """Ranges (low, high) of the per-job factors a realisation draws uniformly."""
    sm: tuple[float, float] = (0.7, 1.4)
    membw: tuple[float, float] = (0.7, 1.4)
    duration: tuple[float, float] = (0.8, 1.25)
    phase: float = 0.10  # shift of the series, as a fraction of the run, either way
    peak_mem: tuple[float, float] = (1.0, 1.15)  # real memory use over the stored profile
    corun: tuple[float, float] = (0.10, 0.30)  # extra slowdown when sharing, unknown to the model


NO_SPREAD = Spreads((1.0, 1.0), (1.0, 1.0), (1.0, 1.0), 0.0, (1.0, 1.0), (0.0, 0.0))


@dataclass
class Real:
    """One job's real behaviour: series on its own step, alone run time, and its co-run penalty."""
    sm: np.ndarray
    mem: np.ndarray
    membw: np.ndarray
    step: float
    runtime: float
    cache_bound: bool
    corun: float = 0.0  # extra slowdown factor - 1 while it shares a GPU with another busy job


# ---- the study physics -------------------------------------------------------------------------
# Fitted by workloads/calibrate_study.py (grid over KNEE and K_INTERFERE; see docs/sim.md).
KNEE = 0.6  # summed bandwidth of the busy jobs on a GPU from which they interfere
K_INTERFERE = 14.0  # slowdown per unit of summed bandwidth past the knee
SWITCH_COST = 1.0 - 1.48 / 1.50  # 0.74 s vs 1.50 s: the light pair sums 0.6, at the knee, no interference


def _heavy_pair_constants(knee: float, k_int: float) -> tuple[float, float]:
    """(alone run time of the MPS study's heavy job, K_CACHE) so that the heavy pair takes 61.5 s
    time-sliced and 223.6 s under MPS with this interference (both figures are measurements that
    already contain it). Pair: sm 1.0, membw 0.9, cache-bound."""
    inter = 1.0 + k_int * max(0.0, 1.8 - knee)
    alone = 61.5 * (1.0 - SWITCH_COST) / 2.0 / inter  # time-sliced: each gets (1 - cost) / 2 / inter
    # MPS: rate = 1 / (D * (1 + K (B - 1)) * inter), D = 2, B = 1.8; both end at 223.6 s
    k_cache = (223.6 / (alone * 2.0 * inter) - 1.0) / 0.8
    return alone, k_cache


# The truths' own copies of the structure's parameters: today the values colo's model was
# calibrated with (DESIGN.md's pairs), but the truth's, so that tuning the policy's model
# (colo/interference.py) never moves what the jobs really do.
BUSY_SM = 0.25  # SM activity from which a job's kernels keep the GPU busy
K_BW = 0.5  # bandwidth oversubscription between MPS clients that are not cache-bound
K_CACHE = (223.6 / (2 * 61.5 * (1.0 - SWITCH_COST) / 2) - 1.0) / 0.8  # 223.6 s vs 61.5 s, no interference


def study_rates(sm, membw, cache_bound, mps, corun=None, knee: float = KNEE, k_int: float = K_INTERFERE):
    """Progress rate of each job at each instant under the study physics (shapes as interference.rates)."""
    _, k_cache = _heavy_pair_constants(knee, k_int)
    out = interference.contexts(sm, membw, cache_bound, mps, k_cache, K_BW, BUSY_SM, SWITCH_COST)
    sm = np.asarray(sm, dtype=float)
    membw = np.asarray(membw, dtype=float)
    if sm.ndim == 1:
        sm, membw = sm[:, None], membw[:, None]
    active = sm > 0
    # interference between everyone busy on the GPU, whatever the mode
    n_active = active.sum(axis=0)
    bsum = np.where(active, membw, 0.0).sum(axis=0)
    inter = np.where(n_active >= 2, 1.0 + k_int * np.maximum(0.0, bsum - knee), 1.0)
    out = out / inter[None, :]
    if corun is not None:
        out = out / np.where(n_active >= 2, 1.0 + np.asarray(corun, dtype=float)[:, None], 1.0)
    return np.where(active, out, 1.0)


def noisy_rates(sm, membw, cache_bound, mps, corun=None):
    """The structure of colo's model (with the truth's parameters) plus the co-run penalty the
    model does not know about."""
    out = interference.contexts(sm, membw, cache_bound, mps, K_CACHE, K_BW, BUSY_SM, SWITCH_COST)
    if corun is None:
        return out
    sm = np.asarray(sm, dtype=float)
    if sm.ndim == 1:
        sm = sm[:, None]
    n_active = (sm > 0).sum(axis=0)
    return out / np.where((n_active >= 2) & (sm > 0), 1.0 + np.asarray(corun, dtype=float)[:, None], 1.0)


# ---- truths -----------------------------------------------------------------------------------

@dataclass
class Truth:
    kind: str = "exact"  # exact | noisy | study
    seed: int = 0
    spreads: Spreads = field(default_factory=Spreads)
    knee: float = KNEE
    k_int: float = K_INTERFERE

    def __post_init__(self) -> None:
        if self.kind not in TRUTHS:
            raise ValueError(f"unknown truth {self.kind!r}: one of {', '.join(TRUTHS)}")

    def realise(self, job_id: int, profile) -> Real:
        """The job's real behaviour in this truth; the same (seed, job id, profile) gives the same."""
        sm, mem, bw = np.asarray(profile.sm, float), np.asarray(profile.mem, np.int64), np.asarray(profile.membw, float)
        step, runtime = float(profile.step), float(profile.runtime)
        if self.kind == "exact":
            return Real(sm, mem, bw, step, runtime, bool(profile.cache_bound))
        s = self.spreads
        rng = np.random.default_rng([self.seed, _stable(profile.name)])  # per application
        u = lambda lo_hi: float(rng.uniform(*lo_hi)) if lo_hi[1] > lo_hi[0] else float(lo_hi[0])  # noqa: E731
        f_sm, f_bw, f_dur, f_mem, corun = u(s.sm), u(s.membw), u(s.duration), u(s.peak_mem), u(s.corun)
        run = np.random.default_rng([self.seed, _stable(profile.name), job_id])  # per run
        shift = int(round(run.uniform(-s.phase, s.phase) * len(sm))) if s.phase > 0 else 0
        if shift:  # a phase comes earlier or later; the ends hold their level
            idx = np.clip(np.arange(len(sm)) - shift, 0, len(sm) - 1)
            sm, bw = sm[idx], bw[idx]
            mem = mem[idx] if mem.max() == mem[-1] else mem  # memory peaks keep their size either way
        return Real(np.clip(sm * f_sm, 0.0, 1.0), (mem * f_mem).astype(np.int64), np.clip(bw * f_bw, 0.0, 1.0),
                    step * f_dur, runtime * f_dur, bool(profile.cache_bound), corun)

    def rates(self, sm, membw, cache_bound, mps, corun) -> np.ndarray:
        if self.kind == "exact":
            return interference.rates(sm, membw, cache_bound, mps)
        if self.kind == "noisy":
            return noisy_rates(sm, membw, cache_bound, mps, corun)
        return study_rates(sm, membw, cache_bound, mps, None, self.knee, self.k_int)

    def with_seed(self, seed: int) -> "Truth":
        return replace(self, seed=seed)


def _stable(name: str) -> int:
    """A seed part from a name that does not change between Python runs (hash() does)."""
    return int.from_bytes(name.encode()[:16].ljust(16, b"\0"), "little") % (2**63)


def calibration_pair(kind: str, knee: float = KNEE, k_int: float = K_INTERFERE) -> dict:
    """The MPS study's pair jobs as this truth's physics needs them (the heavy job's alone time
    depends on how much interference the measured 61.5 s already held)."""
    if kind == "light":
        return dict(interference.CAL_LIGHT)
    alone, _ = _heavy_pair_constants(knee, k_int)
    return dict(interference.CAL_HEAVY, runtime=alone)

