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
  the placement study's table (docs/invariants.md "Figures from the studies") and that reproduces the
  MPS study's pairs exactly: besides colo's structure (contexts in time slices, MPS clients at
  once), co-running jobs interfere once their summed memory bandwidth passes a knee (L2 and
  DRAM contention; time-sliced neighbours evict each other's working sets between slices).
  The fit and its residuals are in docs/sim.md (workloads/calibrate_study.py).
- `smooth`: the `noisy` realisation (peak memory drawn afresh for every run) moved by a physics
  with no knee anywhere: MPS clients slow each other smoothly as their summed SM and bandwidth
  grow, cache-bound clients thrash each other's cache (a term in the product of their
  bandwidths), and time slices cost 3 % (two saturating jobs time-sliced are 3 % slower than
  back to back). Its three constants are solved from the published pairs (smooth_constants):
  the light pair 2x faster under MPS than time-sliced (0.74 s vs 1.50 s), the cache-bound heavy
  pair 3.6x slower (223.6 s vs 61.5 s). A world where light jobs share well and heavy ones must
  not.

- `h200`: the world aims are judged in. The `noisy` realisation (no hidden co-run penalty; peak
  memory drawn afresh for every run) moved by a physics fitted to what one H200 measured
  (colo/sched/fitted.py, constants in truth_h200.json, fitted by bench/fit_truth.py from the GPU
  check's reports): a job needs 0.83 x its SM reading of the GPU's time, contexts share time
  max-min fairly, MPS gets 10 % more done than time slices; light jobs barely meet. Its node's
  context memories are the measured ones. The other three truths reproduce none of the H200's
  figures (docs/sim.md): `noisy`, `study` and `smooth` are kept as named stress worlds (`study`:
  a GPU where bandwidth interference is severe; `smooth`: one where cache-bound pairs thrash).

Besides the jobs, what the node does (every truth but `exact`, which is the stored profiles as
they are): each CUDA context holds device memory outside any budget (CTX_MEM for a time-sliced
job, MPS_CLIENT_MEM for an MPS client, and MPS_SERVER_MEM once per GPU while it has clients; a
stored profile, sampled from a job running alone, already holds one ordinary context);
NVML gives per-process SM and bandwidth for ordinary contexts but not for MPS clients (their
activity is the server's: `nvml_per_client` says the driver attributes it); and samples are
noisy (SAMPLE_NOISE, relative).

Nothing here is imported by colo/sched/policy.py: the policy cannot see the truth.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from . import fitted, interference

TRUTHS = ("exact", "noisy", "study", "smooth", "h200")
H200 = fitted.load()
MiB = 1024**2
# what a context costs in device memory, outside the budgets (assumptions, stated: an ordinary
# CUDA context with the runtime loaded takes a few hundred MiB on recent GPUs; an MPS client
# much less, its server one ordinary context)
CTX_MEM = 300 * MiB
MPS_CLIENT_MEM = 64 * MiB
MPS_SERVER_MEM = 300 * MiB
SAMPLE_NOISE = 0.1  # relative spread of one SM or bandwidth reading


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
# calibrated with (the study pairs in docs/invariants.md), but the truth's, so that tuning the policy's model
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


# ---- the smooth physics ------------------------------------------------------------------------
# MPS: a client's slowdown is g(D, B) / g(d, b), with D, B the summed SM and bandwidth of the busy
# clients, d, b its own, and g(x, y) = (1 + x^P + y^P)^(1/P): 1 alone, close to max(1, D, B) far
# from the corner, rising without a knee near it; times 1 + K_THRASH * w b * sum(w' b') over the
# others (w = 1 for a cache-bound job, THRASH_OTHER else): cache-bound clients evict each other.
# Time slices: contexts share time as in colo's structure, less SMOOTH_SWITCH once two are busy.
SMOOTH_SWITCH = 0.03  # two saturating jobs time-sliced: 3 % slower than back to back
THRASH_OTHER = 0.1  # how much a job that is not cache-bound takes part in cache thrash


def _g(x, y, p):
    return (1.0 + np.power(x, p) + np.power(y, p)) ** (1.0 / p)


def smooth_constants() -> tuple[float, float, float, float]:
    """(P, K_THRASH, light pair's alone time, heavy pair's alone time) from the published pairs:
    time-sliced, each job of a pair gets (1 - SMOOTH_SWITCH) / 2 of the GPU, so 1.50 s and 61.5 s
    give the alone times; under MPS the light pair (sm 0.35, bandwidth 0.3, not cache-bound)
    takes 0.74 s and the heavy pair (sm 1.0, bandwidth 0.9, cache-bound) 223.6 s."""
    t_light = 1.50 * (1.0 - SMOOTH_SWITCH) / 2.0
    t_heavy = 61.5 * (1.0 - SMOOTH_SWITCH) / 2.0

    def k_thrash(p: float) -> float:
        return (223.6 / t_heavy / (_g(2.0, 1.8, p) / _g(1.0, 0.9, p)) - 1.0) / 0.81

    def light(p: float) -> float:  # the light pair's MPS slowdown at this P, less the figure's
        w = THRASH_OTHER * 0.3
        return _g(0.7, 0.6, p) / _g(0.35, 0.3, p) * (1.0 + k_thrash(p) * w * w) - 0.74 / t_light

    lo, hi = 2.0, 40.0  # light() falls as P grows
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if light(mid) > 0 else (lo, mid)
    p = (lo + hi) / 2
    return p, k_thrash(p), t_light, t_heavy


SMOOTH_P, K_THRASH, _, _ = smooth_constants()


def smooth_rates(sm, membw, cache_bound, mps):
    """Progress rate of each job at each instant under the smooth physics (shapes as interference.rates)."""
    sm, membw, cb, mps = interference.columns(sm, membw, cache_bound, mps)
    active = sm > 0
    inner = np.ones_like(sm)
    if mps.any():
        s, b = np.where(active[mps], sm[mps], 0.0), np.where(active[mps], membw[mps], 0.0)
        own = _g(s, b, SMOOTH_P)
        slow = _g(s.sum(axis=0), b.sum(axis=0), SMOOTH_P)[None, :] / own
        wb = np.where(cb[mps], 1.0, THRASH_OTHER)[:, None] * b
        slow = slow * (1.0 + K_THRASH * wb * (wb.sum(axis=0)[None, :] - wb))
        inner[mps] = 1.0 / slow
        group_busy = np.minimum(1.0, np.minimum(1.0, s / BUSY_SM).sum(axis=0))
    else:
        group_busy = np.zeros(sm.shape[1])
    share = interference.time_slices(group_busy, np.minimum(1.0, sm[~mps] / BUSY_SM), SMOOTH_SWITCH)
    return np.where(active, inner * share[None, :], 1.0)


# ---- truths -----------------------------------------------------------------------------------

@dataclass
class Truth:
    kind: str = "exact"  # exact | noisy | study | smooth | h200
    seed: int = 0
    spreads: Spreads = field(default_factory=Spreads)
    knee: float = KNEE
    k_int: float = K_INTERFERE
    # the node (None: the kind's own; `exact` has none of it): device memory per context, and
    # NVML's readings
    ctx_mem: int | None = None
    mps_client_mem: int | None = None
    mps_server_mem: int | None = None
    nvml_per_client: bool = False  # the driver attributes MPS clients' SM and bandwidth to them
    sample_noise: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in TRUTHS:
            raise ValueError(f"unknown truth {self.kind!r}: one of {', '.join(TRUTHS)}")
        real = self.kind != "exact"
        measured = self.kind == "h200"
        for name, value in (("ctx_mem", H200.ctx_mem if measured else CTX_MEM),
                            ("mps_client_mem", H200.mps_client_mem if measured else MPS_CLIENT_MEM),
                            ("mps_server_mem", H200.mps_server_mem if measured else MPS_SERVER_MEM),
                            ("sample_noise", SAMPLE_NOISE)):
            if getattr(self, name) is None:
                setattr(self, name, value if real else type(value)(0))

    def context_mem(self, mps: bool) -> int:
        """Device memory a job's own context takes beyond what it allocates."""
        return int(self.mps_client_mem if mps else self.ctx_mem)

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
        if self.kind in ("smooth", "h200"):  # peak memory drawn afresh for every run (inputs differ run to run)
            f_mem = float(run.uniform(*s.peak_mem)) if s.peak_mem[1] > s.peak_mem[0] else float(s.peak_mem[0])
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
        if self.kind == "smooth":
            return smooth_rates(sm, membw, cache_bound, mps)
        if self.kind == "h200":
            return fitted.rates(sm, membw, cache_bound, mps, H200)
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


def smooth_pair(kind: str) -> dict:
    """The MPS study's pair jobs as the smooth physics needs them (their alone times follow from
    its time-slice cost)."""
    _, _, t_light, t_heavy = smooth_constants()
    if kind == "light":
        return dict(interference.CAL_LIGHT, runtime=t_light)
    return dict(interference.CAL_HEAVY, runtime=t_heavy)

