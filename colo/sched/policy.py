"""Placement: which queued job starts where, in which mode, and why the others wait.

Pure: no I/O, no clock. The daemon and `colo sim` both call plan(); nothing about scheduling
is written anywhere else.

Rules, in order, for each candidate (priority, then submission order; smaller jobs behind a
waiting one may start: backfill):
1. Memory is a hard rule (invariant 1): the sum of budgets on a GPU never exceeds its usable
   memory. Best fit: among the GPUs that can take the job, the one left with the least room.
2. A job with no profile runs alone, or beside at most one well-known job (a profile learned
   from `well_known_runs` runs) that it is not predicted to slow past the bound, time-sliced: its
   first profile is then clean, and nobody shares a GPU with a stranger. A job already running
   without a profile takes at most one such neighbour.
3. Every co-location, MPS included, passes one check. From the profiles of the jobs already on
   the GPU (aligned on their elapsed time) and the candidate's, the co-run model
   (colo/interference.py) predicts each job's rate over the overlap in each mode allowed there,
   times what runs showed for each pairing (Learned); every shared rate is discounted once by
   the error of predictions whose pairings runs had shown (`seen_margin`), and once more for
   every pairing no run has shown yet by `margin` (the error of all predictions). A mode passes
   when no job's predicted slowdown exceeds `slowdown_bound` and the GPU's throughput beats
   waiting by `min_gain`. MPS (allowed: not in FAULT, the uid rule of invariant 5, summed SM and bandwidth
   below `saturation`) is taken when it passes, else time-slicing when it passes, else wait.
4. EXCLUSIVE_PROCESS GPUs take MPS clients only (invariant 4); PROHIBITED GPUs take nothing.
5. A --grow job (Candidate.grow) is lent up to `lend` x its budget out of what its GPU has left
   after the pass when no queued job fits in that (details["budget"], details["asked"]).
"""
from __future__ import annotations

import dataclasses
import gc
import math
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np

from . import interference
from ..units import format_size

START = "start"
WAIT = "wait"
GiB = 1024**3


@dataclass(frozen=True)
class GpuView:
    uuid: str
    index: int
    usable: int  # bytes: capacity minus the configured reserve
    compute_mode: str = "default"  # default | exclusive_process | prohibited
    mps: str = "off"  # off | active | fault
    name: str = ""
    error: str | None = None  # the driver stopped answering for it: nothing new is placed there


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
    # how far into its profile it is (alone-seconds of work: policy.progress of its decision's
    # expectation); None: taken to have run at its alone speed since it started (`elapsed`)
    done: float | None = None
    # it runs alone this once so that its alone time here is learned (its start's
    # details["check_alone"]): nothing starts beside it
    alone: bool = False


@dataclass(frozen=True)
class Candidate:
    job_id: int
    budget: int  # bytes per GPU
    gpus: int = 1
    uid: int = 0
    priority: int = 0
    seq: int = 0  # submission order
    profile: Any = None
    queued_at: float = 0.0  # when it was submitted (the clock `plan(now=...)` reads)
    held: tuple[int, ...] = ()  # GPU indices held for it by the last pass (details["held"]): kept
    grow: bool = False  # submitted with --grow: its budget may be larger than asked (see `lend`)
    gpu_ids: tuple[int, ...] = ()  # --gpu-id: only these GPU indices (empty: any)
    gpu_type: str | None = None  # --gpu-type: only GPUs whose name holds this


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
    saturation: float = 0.85  # predicted combined SM activity below which MPS is chosen
    multi_user_mps: bool = False
    use_mps: bool = True
    bw_saturation: float = 0.85  # same, for combined memory bandwidth
    min_gain: float = 0.25  # sharing past saturation must beat waiting by this much throughput (alone-speed jobs)
    step: float = 2.0  # seconds per point when profiles are compared
    horizon: float = 3600.0  # seconds of overlap looked at
    max_mps_clients: int = 48  # per device (Volta and newer)
    thread_headroom: float = 1.25  # MPS active threads = peak SM of the job x this, in 5 % steps
    unknown_sm: float = 1.0  # a running job with no profile is assumed to use this much...
    unknown_membw: float = 0.5  # ...and this much bandwidth
    # Harm bounds (issue 13). Predicted co-run rates are divided by 1 + margin before the checks:
    # the margin is the model's observed prediction error (learned; this default until then).
    slowdown_bound: float = 1.5  # no job is knowingly placed where it is predicted to run slower than this
    margin: float = 0.10
    # the margin for a share whose pairings runs have all shown (learned from the errors of such
    # predictions only; None: `margin`)
    seen_margin: float | None = None
    well_known_runs: int = 3  # a profile learned from this many runs may take an unprofiled neighbour
    unprofiled_share: bool = False  # True: jobs with no profile share time-sliced like the rest (memory decides)
    # Backfill lets small jobs pass one that waits; to keep a stream of them from starving it for
    # ever, the first job in queue order that has waited this long gets GPUs held for it: nothing
    # new starts there until it does. Seconds; 0 turns it off.
    hold_after: float = 1800.0
    # A --grow job starts with up to this much times its budget when the memory it takes could
    # fit no queued job anyway (lent, not reserved from anyone): a profile a little off then
    # costs no refused allocation and no re-run. 1.0 turns it off.
    lend: float = 1.25
    # A profile no run has shown alone here runs alone once (details["check_alone"]) when it would
    # start on an empty GPU anyway. Only for a caller that then passes Placed.alone for that job
    # (colo sim does; the daemon not yet), else the job it meant to keep alone is joined.
    check_alone: bool = False


def config_of(c: Any) -> PolicyConfig:
    """The policy's knobs from the daemon's configuration (colo/config.py Config, or anything with
    its fields): what the daemon places with, and `colo sim`'s colo by default."""
    return PolicyConfig(reserve=c.reserve, saturation=c.saturation, bw_saturation=c.bw_saturation,
                        min_gain=c.min_gain, hold_after=c.hold_after, slowdown_bound=c.slowdown_bound,
                        unprofiled_share=c.unprofiled_share, multi_user_mps=c.multi_user_mps,
                        use_mps=c.use_mps, lend=c.lend, check_alone=getattr(c, "check_alone", False))


# ---- per-profile arrays, cached --------------------------------------------------------------

@dataclass(frozen=True)
class _Arr:
    sm: np.ndarray
    membw: np.ndarray
    cache_bound: bool
    peak_sm: float
    peak_membw: float
    runs: int = 1
    name: str = ""


_CACHE: dict[tuple[int, float], tuple[Any, _Arr]] = {}


def _arrays(profile: Any, step: float, horizon: float) -> _Arr:
    """The profile on the policy's grid (peak within each grid step), cached per profile object."""
    key = (id(profile), step)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    sm = np.asarray(profile.sm, dtype=float)
    bw = np.asarray(getattr(profile, "membw", None) if getattr(profile, "membw", None) is not None else np.zeros_like(sm), dtype=float)
    pstep = float(profile.step)
    runtime = float(getattr(profile, "runtime", 0.0) or len(sm) * pstep)
    n = max(1, min(math.ceil(runtime / step - 1e-9), math.ceil(horizon / step)))
    starts = np.minimum((np.arange(n) * step / pstep).astype(int), len(sm) - 1)
    arr = _Arr(_smear(np.maximum.reduceat(sm, starts)), _smear(np.maximum.reduceat(bw, starts)),
               bool(getattr(profile, "cache_bound", False)), float(sm.max()), float(bw.max()),
               int(getattr(profile, "runs", 1) or 1), str(getattr(profile, "name", "")))
    if len(_CACHE) > 4096:
        _CACHE.clear()
    _CACHE[key] = (profile, arr)
    return arr


# What a job with no profile can do about waiting (its reason says it: `colo explain`)
WAYS_OUT = ("ways out: --profile NAME (a profile you recorded with `colo profile record`, or one an admin "
            "shared with `colo profile share`), `unprofiled_share = true` in the daemon's config, or wait: "
            "once a job like it (the same image or program and script) has run half a minute, jobs like it "
            "are placed beside others from its samples")
PHASE = 0.1  # where a job is in its profile is known to within this share of its run, either way


def _smear(v: np.ndarray) -> np.ndarray:
    """Each point the most of the points within PHASE of the run around it: a run's phases come a
    little earlier or later than its profile's (other inputs, a slower disk), so a share timed
    to fit a lull in a neighbour's profile can meet its busy phase instead."""
    k = int(math.ceil(PHASE * len(v)))
    if k <= 0 or len(v) < 2:
        return v
    pad = np.concatenate([np.full(k, v[0]), v, np.full(k, v[-1])])
    return np.lib.stride_tricks.sliding_window_view(pad, 2 * k + 1).max(axis=1)


def _unknown(cfg: PolicyConfig) -> _Arr:
    n = max(1, math.ceil(cfg.horizon / cfg.step))
    return _Arr(np.full(n, cfg.unknown_sm), np.full(n, cfg.unknown_membw), False, cfg.unknown_sm, cfg.unknown_membw, 0)


def thread_pct(arr: _Arr, cfg: PolicyConfig) -> int:
    pct = math.ceil(arr.peak_sm * cfg.thread_headroom * 20) * 5
    return int(min(100, max(10, pct)))


# ---- the GPU as the pass sees it ---------------------------------------------------------------

@dataclass
class _Res:
    job_id: int
    arr: _Arr | None  # None: no profile
    off: int  # grid index the job has reached
    mode: str
    uid: int
    alone: bool = False  # a check of its alone time: nothing starts beside it


class _Rows(NamedTuple):
    """A GPU's residents' profiles aligned on now (each from the grid point it has reached), zero
    padded, one row per resident; unpacked in this order where it is read (_assess)."""
    version: int  # the _Gpu's version they were made for
    sm: np.ndarray  # SM share per grid step
    membw: np.ndarray  # memory bandwidth share per grid step
    cache_bound: np.ndarray  # per resident
    mps: np.ndarray  # per resident: an MPS client
    ids: list  # job ids
    names: list  # profile names
    group_sm: np.ndarray  # the MPS group's summed SM per step
    group_bw: np.ndarray  # its summed bandwidth
    all_mps: bool  # every resident is an MPS client
    wait_cum: np.ndarray  # each resident's accumulated rate if nothing starts
    left: np.ndarray  # each one's rest of its profile in grid points
    whole: np.ndarray  # each one's whole run in grid points


@dataclass
class _Gpu:
    view: GpuView
    free: int
    res: list[_Res]
    version: int = 0  # bumped at every start in the pass: what is cached below is for one version
    rows: _Rows | None = None  # see _rows


def _rows(g: _Gpu, cfg: PolicyConfig) -> _Rows:
    """The GPU's _Rows. Kept on the GPU until a start changes it."""
    segs, whole = [], []
    for r in g.res:
        ra = r.arr if r.arr is not None else _unknown(cfg)
        whole.append(max(len(ra.sm), r.off + 1))
        if r.off < len(ra.sm):
            segs.append((ra, ra.sm[r.off:], ra.membw[r.off:]))
        else:
            # Past its profile's end and still running: the profile was wrong about it, so where it
            # is in it and when it ends are unknown. It is taken at its peak for as long as a
            # newcomer could overlap it (its last level, for as long as one grid step, once let
            # a bandwidth-heavy job start beside it and both ran 12-15x slower in `colo sim`).
            n = max(1, math.ceil(cfg.horizon / cfg.step))
            segs.append((ra, np.full(n, ra.peak_sm), np.full(n, ra.peak_membw)))
            whole[-1] = r.off + n
    width = max(len(s) for _, s, _ in segs)
    sm, bw = np.zeros((len(segs), width)), np.zeros((len(segs), width))
    for i, (_, s, b) in enumerate(segs):
        sm[i, :len(s)], bw[i, :len(b)] = s, b
    mps = np.array([r.mode == "mps" for r in g.res])
    cb = np.array([ra.cache_bound for ra, _, _ in segs])
    # the residents' summed rate if nothing starts, accumulated: waiting's throughput over any
    # stretch from now is one lookup
    wait_cum = np.cumsum(interference.rates(sm, bw, cb, mps), axis=1)
    g.rows = _Rows(g.version, sm, bw, cb, mps, [r.job_id for r in g.res], [ra.name for ra, _, _ in segs],
                   sm[mps].sum(axis=0), bw[mps].sum(axis=0), bool(mps.all()), wait_cum,
                   np.array([len(s) for _, s, _ in segs]), np.array(whole))
    return g.rows


def _pct(x: float) -> str:
    return f"{x * 100:.0f} %"


def _duration(seconds: float) -> str:
    m = int(seconds // 60)
    return f"{m // 60} h {m % 60} min" if m >= 60 else f"{m} min"


def _mem_text(g: _Gpu, budget_after: int) -> str:
    return f"memory {(g.view.usable - budget_after) / GiB:.1f} of {g.view.usable / GiB:.1f} GiB budgeted"


def _assess(arr: _Arr | None, uid: int, g: _Gpu, cfg: PolicyConfig,
            learned: "Learned | None" = None) -> tuple[str | None, str, dict, bool]:
    """(mode or None to wait, reason core, details, costly) for the candidate on this GPU;
    costly: the start is predicted to slow someone (so an empty GPU is better)."""
    v = g.view
    name = f"GPU{v.index}"
    allow_ts = v.compute_mode == "default"
    mps_res = [r for r in g.res if r.mode == "mps"]
    block = None
    if not cfg.use_mps:
        block = "MPS is turned off"
    elif v.mps == "fault":
        block = f"the MPS server of {name} is in FAULT"
    elif not cfg.multi_user_mps and any(r.uid != uid for r in mps_res):
        other = next(r.uid for r in mps_res if r.uid != uid)
        block = f"{name} runs the MPS server of uid {other} (no multi-user MPS)"
    elif len(mps_res) >= cfg.max_mps_clients:
        block = f"{name} has {len(mps_res)} MPS clients, the most one server takes"
    allow_mps = block is None
    checking = next((r for r in g.res if r.alone), None)
    if checking is not None:
        return None, (f"job {checking.job_id} runs alone on {name} this once, so that how long its profile takes "
                      "alone here is learned"), {"gpu": v.index}, False
    if v.compute_mode == "exclusive_process" and not allow_mps:
        return None, f"{name} is EXCLUSIVE_PROCESS (MPS clients only) and {block}", {"gpu": v.index}, False

    if arr is None and cfg.unprofiled_share:
        if allow_ts:
            return "timesliced", f"time-sliced on {name}: no profile yet, this run is profiled", {"gpu": v.index}, False
        if not g.res:
            return "mps", f"MPS on {name}: no profile yet; EXCLUSIVE_PROCESS GPU takes MPS clients only", {"gpu": v.index}, False
        return None, f"{name} is EXCLUSIVE_PROCESS and busy; a job with no profile is not co-located under MPS", {"gpu": v.index}, False
    if arr is None and not g.res:  # never profiled: run it alone and learn
        if allow_ts:
            return "timesliced", f"time-sliced on {name}: no profile yet, runs alone so that this run is profiled", {"gpu": v.index}, False
        return "mps", f"MPS on {name}: no profile yet, runs alone; EXCLUSIVE_PROCESS GPU takes MPS clients only", {"gpu": v.index}, False
    prefix = ""
    if not cfg.unprofiled_share and (arr is None or any(r.arr is None for r in g.res)):
        # a stranger (no profile) shares a GPU with at most one well-known job, time-sliced
        stranger = "this job has no profile" if arr is None else \
            f"job {next(r.job_id for r in g.res if r.arr is None)} on {name} has no profile yet"
        known = arr if arr is not None else g.res[0].arr
        if len(g.res) > 1 or known is None or known.runs < cfg.well_known_runs:
            return None, (f"{stranger}: it runs alone or beside one well-known job (a profile of "
                          f"{cfg.well_known_runs}+ runs), so that its profile is clean; {WAYS_OUT}"), {"gpu": v.index}, False
        if not allow_ts:
            return None, f"{stranger} and {name} is EXCLUSIVE_PROCESS: not co-located under MPS", {"gpu": v.index}, False
        allow_mps, block = False, f"{stranger}"
        arr = arr if arr is not None else _unknown(cfg)
        prefix = f"{stranger}, and beside job {g.res[0].job_id} "

    if not g.res:
        sat = arr.peak_sm >= cfg.saturation or arr.peak_membw >= cfg.bw_saturation
        d = {"gpu": v.index, "peak_sm": arr.peak_sm, "peak_membw": arr.peak_membw}
        if allow_mps and (not sat or not allow_ts):
            return "mps", f"MPS on {name}: alone, peak SM {_pct(arr.peak_sm)}", d, False
        if allow_ts:
            why = f"MPS {'off: ' + block if block else 'not needed: it saturates the GPU by itself'}"
            return "timesliced", f"time-sliced on {name}: alone ({why}, peak SM {_pct(arr.peak_sm)})", d, False
        return None, f"{name}: {block}", d, False

    # Everyone aligned on the candidate's future, from the GPU's resident rows (built once per
    # change of the GPU, not per candidate).
    rows = g.rows if g.rows is not None and g.rows.version == g.version else _rows(g, cfg)
    _, r_sm, r_bw, r_cb, r_mps, ids, names, g_sm, g_bw, all_mps, wait_cum, r_left, r_whole = rows
    overlap = min(len(arr.sm), r_sm.shape[1])
    c_sm, c_bw = arr.sm[:overlap], arr.membw[:overlap]
    group_sm = g_sm[:overlap] + c_sm
    group_bw = g_bw[:overlap] + c_bw
    top_sm, top_bw = float(group_sm.max()), float(group_bw.max())
    fits = top_sm < cfg.saturation and top_bw < cfg.bw_saturation
    if all_mps:  # every job is in the MPS group: its sums are everyone's
        peak_sm, peak_bw = top_sm, top_bw
    else:
        peak_sm = float((r_sm[:, :overlap].sum(axis=0) + c_sm).max())  # everyone, for the reason
        peak_bw = float((r_bw[:, :overlap].sum(axis=0) + c_bw).max())
    per_job = dict(zip(map(str, ids), r_sm[:, :overlap].max(axis=1).tolist()))
    per_job["this"] = float(c_sm.max())
    d = {"gpu": v.index, "overlap_s": overlap * cfg.step, "peak_sm": peak_sm, "peak_membw": peak_bw,
         "sm_by_job": per_job, "saturation": cfg.saturation}
    who = ", ".join([f"job {j}: {_pct(x)}" for j, x in per_job.items() if j != "this"] + [f"this job: {_pct(per_job['this'])}"])
    # One check for every way of sharing: each job's predicted rate over the overlap (in its
    # alone speed, discounted once by the margin) against the slowdown bound, and the GPU's
    # throughput (sum of rates) against waiting.
    # The status quo over the same stretch: the residents' model rates, slowed by what runs showed
    # for the pairings they are already in (else sharing would be charged for what waiting pays too),
    # each discounted as it is now (a resident sharing already by its margin; alone, not at all).
    lrn = learned if learned is not None and (learned.corun or learned.bw or learned.live) else None
    now_fac = lrn.among(names, r_mps, float(r_bw[:, :overlap].sum(axis=0).max())) if lrn is not None else None
    seen_m = cfg.margin if cfg.seen_margin is None else cfg.seen_margin
    if len(ids) < 2:
        now_doubt = np.ones(len(ids))
    elif learned is not None:
        now_doubt = 1.0 + np.where(learned.seen_among(names, r_mps), seen_m, cfg.margin)
    else:
        now_doubt = np.full(len(ids), 1.0 + cfg.margin)
    wait_rows = wait_cum[:, overlap - 1] / overlap
    if now_fac is not None:
        wait_rows = wait_rows / now_fac
    wait_tp = float((wait_rows / now_doubt).sum())
    tp, slow, this, unseen, res, raw = {"wait": wait_tp}, {}, {}, {}, {}, {}
    modes = (["mps"] if allow_mps else []) + (["timesliced"] if allow_ts else [])
    n = len(ids) + 1
    # the share of each one's whole run the overlap is (residents: of what they have left)
    frac = np.append(np.minimum(overlap, r_left) / r_whole, overlap / max(1, len(arr.sm)))
    explore: dict[str, bool] = {}
    far: set[str] = set()  # modes whose share is more than one step past what runs showed: never made
    # A job measured against a stored alone time no run here has checked: its real slowdown may
    # be what its run shows times how far that time is off (ALONE_DOUBT at most, half of it in
    # the bound: in a dense queue nothing ever runs alone to tell)
    known = learned.alone if learned is not None else {}
    unchecked = np.array([1.0 if nm in known else ALONE_DOUBT ** 0.5 for nm in [*names, arr.name]])
    for m in modes:
        fac = lrn.factors(names, arr.name, m, peak_bw) if lrn is not None else None
        if fac is not None:  # a resident keeps what its present neighbours cost it
            fac[:-1] = np.maximum(fac[:-1], now_fac)
        # The margin covers the model's error where nothing corrects it, once per job: the error
        # of predictions whose pairings runs had all shown (seen_margin) where each of its
        # pairings in this share has been seen, else that of all predictions. Once, not once per
        # pairing: a crowd the model says costs nothing is not refused for its size.
        unk = learned.unseen(names, arr.name, m) if learned is not None else np.append(np.ones(n - 1), n - 1)
        doubt = 1.0 + np.where(unk > 0, cfg.margin, seen_m)
        if m == "mps" and all_mps and top_sm <= 1.0 and top_bw <= 1.0:
            # one MPS context whose summed SM and bandwidth stay within the GPU: the model slows
            # nobody (interference.rates is 1 throughout), so the check needs no model pass
            per = np.ones(n) if fac is None else 1.0 / fac
        else:
            sm = np.vstack([r_sm[:, :overlap], c_sm])
            bw = np.vstack([r_bw[:, :overlap], c_bw])
            rate = interference.rates(sm, bw, np.append(r_cb, arr.cache_bound),
                                      np.append(r_mps, True) if m == "mps" else np.append(r_mps, False))
            if fac is not None:
                rate = rate / fac[:, None]
            per = rate.mean(axis=1)
        if fac is not None:  # co-run slowdowns the model missed, as observed
            d.setdefault("learned_factor", {})[m] = float(fac[-1])
        # throughput: the residents as they are discounted now, the newcomer by its own margin
        tp[m] = float((per[:-1] / now_doubt).sum() + per[-1] / doubt[-1])
        slow[m] = float((doubt * unchecked / np.maximum(per, 1e-9)).max())
        if learned is not None and not learned.explored(m, peak_bw):
            # More summed bandwidth than any shared run in this mode started into: contention can
            # rise steeply past a knee no profile shows. Never more than one step past it
            # (`beyond`), and only as an exploration whose harm is bounded: the overlap is so
            # short a part of each one's run that were its rate EXPLORE_WORST x worse than
            # predicted there, it would still end within the bound (a job near its end and a
            # long newcomer, say). Its end then shows whether that level costs anything.
            over = frac * (EXPLORE_WORST * doubt / np.maximum(per, 1e-9) - 1.0)
            explore[m] = True
            if learned.beyond(m, peak_bw):
                far.add(m)
            else:
                slow[m] = max(slow[m], float((1.0 + over).max()))
        this[m] = 1.0 / max(1e-9, float(per[-1]))  # this job's own, no margin: recorded, compared at its end
        unseen[m] = float(unk[-1])  # its pairings no run had shown: which margin its error sizes
        # the same for each resident (from now on, beside this job): what its end is compared with
        res[m] = {str(j): (1.0 / max(1e-9, float(p)), 1.0 if fac is None else float(f), float(u))
                  for j, p, f, u in zip(ids, per[:-1], fac if fac is not None else per, unk)}
        raw[m] = 1.0 / max(1e-9, float(per.min()))
    d["throughput"], d["slowdown"], d["slowdown_this"], d["margin"] = tp, slow, this, cfg.margin
    d["unseen"], d["residents"] = unseen, res

    def passes(m: str) -> bool:
        # a share the model says slows someone must beat waiting by min_gain; one it says slows
        # nobody need only beat it (what the newcomer gets done is what waiting costs the queue)
        need = cfg.min_gain if raw[m] > 1.02 else 0.0
        return m not in far and slow[m] <= cfg.slowdown_bound and tp[m] > wait_tp + need

    passing = [m for m in modes if passes(m)]
    sat_text = (f"sharing would saturate: predicted peak SM {_pct(peak_sm)} ({who})"
                + (f", bandwidth {_pct(peak_bw)}" if peak_bw >= cfg.bw_saturation else "")
                + f" >= {_pct(cfg.saturation)}") if not fits else (f"MPS: {block}" if block else "")
    if passing:
        best = max(passing, key=lambda m: tp[m])  # the mode that gets the most done (MPS on a tie)
        costly = raw[best] > 1.02  # someone is predicted slower than alone
        if explore.get(best):
            d["explore"] = True
        tail = (f"; exploring {_pct(peak_bw)} of bandwidth, more than any shared run showed: the overlap "
                "is short enough to stay within the bound were it much slower") if explore.get(best) else ""
        if best == "mps":
            return "mps", (f"MPS on {name}: predicted peak SM {_pct(peak_sm)} ({who})"
                           + (f" < {_pct(cfg.saturation)}" if peak_sm < cfg.saturation else "")
                           + (f", bandwidth {_pct(peak_bw)}" if peak_bw > 0.5 else "")
                           + (f"; predicted slowdown {slow[best]:.2f}x (margin {_pct(cfg.margin)})" if costly else "")
                           + tail), d, costly
        return best, (f"time-sliced on {name}: {sat_text + '; ' if sat_text else ''}predicted throughput "
                      f"{tp[best]:.2f} vs {wait_tp:.2f} waiting, worst slowdown {slow[best]:.2f}x "
                      f"<= {cfg.slowdown_bound:g}x" + tail), d, costly
    if not modes:
        return None, f"co-running on {name} is not possible: {sat_text or 'no mode allowed'}", d, False
    m = min(modes, key=lambda m: slow[m])
    label = "under MPS" if m == "mps" else "time-sliced"
    why = (f"a job would run {slow[m]:.2f}x slower than alone (bound {cfg.slowdown_bound:g}x)"
           + (" were this level of bandwidth, which no shared run has shown, much slower than predicted"
              if explore.get(m) and m not in far else "")
           if slow[m] > cfg.slowdown_bound else
           f"summed bandwidth {_pct(peak_bw)} is more than one step past what any shared run showed"
           if m in far else f"throughput {tp[m]:.2f} {label} vs {wait_tp:.2f} waiting")
    return None, (f"{prefix}co-running on {name} predicted to cost more than it gains: "
                  f"{sat_text + '; ' if sat_text else ''}{why}"), d, False


# ---- learning from what happened (issues 13 and 30) -----------------------------------------
# The daemon and `colo sim` record, at each start, the slowdown plan() predicted for the job
# (details["slowdown_this"], 1.0 alone) and, at its end, how long it really took against its
# profile's alone run time. Alone runs correct the alone time; shared runs, corrected by that,
# give the co-run slowdown the model missed, per (profile, neighbour, mode) and per level of the
# GPU's summed bandwidth, and the spread of the model's error sizes the margin.
# Every learned quantity moves both ways and forgets (invariant 15): a mean over at most
# KEEP_RUNS runs (a new run weighs at least 1/KEEP_RUNS), and what no run has confirmed for FADE
# observations counts half as far from 1 (in log: a 2x factor unconfirmed reads 1.41x, then
# 1.19x), so a share once judged costly is tried again once its evidence is old, the mildest
# first, and what that run shows is learned afresh. No state is absorbing.

_KEEP = 200  # errors kept for the margin (the most recent)
BW_BIN = 0.1  # the bandwidth curve's resolution: summed peak bandwidth of a GPU's jobs, in 10 % steps
MARGIN_QUANTILE = 0.95  # the errors' quantile the margin is: the aim bounds the 95th percentile of slowdown
MARGIN_CAP = 0.4  # the most the learned margin grows to: below the bound's 0.5, so a share the
# model says costs nothing always passes (a margin stuck at the bound would forbid every share,
# and with no share nothing would ever bring it down)
ALONE_DOUBT = 1.25  # how far a profile's alone run time may be off (runs on other data, drivers, clocks)
MIN_SHARED = 0.1  # a run beside others for less of its wall time than this teaches nothing of sharing
EXPLORE_WORST = 3.0  # how much slower than predicted a share into unexplored bandwidth is allowed to be
# Summed bandwidth known to cost nothing before any run here showed it: the MPS study's light pair
# (two jobs of 0.3 each under MPS, 0.74 s as alone; docs/invariants.md). Past it, shares explore.
KNOWN_BW = 0.6
KEEP_RUNS = 8  # a learned mean counts at most this many runs: newer runs move it
FADE = 60.0  # observations (job ends) after which unconfirmed evidence counts half as far from 1
FADE_ERRORS = 60.0  # the same for the errors that size the margins (recency weights)
LIVE_RUN = 60.0  # seconds of a running group's samples that make a whole warning
LIVE_ACTIVITY = 0.2  # the least SM activity expected of a group for its readings to say how fast it runs
LIVE_MAX = 4.0  # the most a group's readings are taken to show (a reading near 0 says "much slower", not how much)
FADE_LIVE = 15.0  # observations after which what a running group showed counts half as far from 1


@dataclass
class Learned:
    corun: dict = field(default_factory=dict)  # (profile, neighbour, mode) -> (runs, mean extra slowdown factor)
    alone: dict = field(default_factory=dict)  # profile -> (runs, mean real / stored alone time)
    errors: list = field(default_factory=list)  # observed / predicted slowdown of shared runs
    # the same, of shared runs started with every pairing of theirs seen before (sizes the margin
    # of seen pairings: seen_margin)
    errors_seen: list = field(default_factory=list)
    max_mem: dict = field(default_factory=dict)  # profile -> the most memory any run used (bytes)
    # (mode, bin of the summed peak bandwidth it started into) -> (runs, mean extra slowdown the
    # pairings do not explain): contention that grows with how much bandwidth the GPU's jobs ask
    # for (L2 and DRAM), whoever they are, so it is learned once for all pairings
    bw: dict = field(default_factory=dict)
    clock: int = 0  # observations so far (job ends): the age of evidence is counted in them
    at: dict = field(default_factory=dict)  # corun or bw key -> the clock when a run last taught it
    live: dict = field(default_factory=dict)  # (mode, bin) -> (slowdown a running group showed, clock)

    def observe(self, name: str, neighbours: Sequence[str], mode: str, predicted: float, wall: float,
                stored_runtime: float, peak_mem: int | None = None, factor: float = 1.0,
                group_bw: float | None = None, unseen: float | None = None, shared: float = 1.0) -> float | None:
        """One job's end: `wall` seconds against its stored alone run time, predicted `predicted`x
        (of which `factor` came from what was learned before), started into a GPU whose jobs'
        summed peak bandwidth was predicted `group_bw`, with `unseen` of its pairings not shown by
        any run then (the decision's details["unseen"]; None: not known), beside others for
        `shared` of its wall time (policy.shared). Returns observed / predicted slowdown (None
        when it cannot say, or it shared less than MIN_SHARED of its run)."""
        if peak_mem:
            self.max_mem[name] = max(self.max_mem.get(name, 0), int(peak_mem))
        if not name or stored_runtime <= 0 or wall <= 0:
            return None
        self.clock += 1
        self.__dict__.pop("_general", None)
        ratio = wall / stored_runtime
        if not neighbours:  # uncontended: what its alone time really is
            self.alone[name] = _blend(self.alone.get(name), ratio, 1.0)
            return ratio / max(predicted, 1e-9)
        if shared < MIN_SHARED:  # beside others for too little of its run to tell what sharing cost
            return None
        # A shared run teaches whether or not its profile was ever seen alone (in a dense queue
        # none is). Its error is against the alone time runs showed, else the stored one; what
        # the profile's own error and sharing's cannot be told apart in goes to its pairings (its
        # own), and only what passes the most a profile is plausibly off (ALONE_DOUBT) to the
        # bandwidth curve, which every pairing reads.
        known = name in self.alone
        residual = ratio / (self.alone[name][1] if known else 1.0) / max(predicted, 1e-9)
        self.errors = (self.errors + [residual])[-_KEEP:]
        if unseen == 0:
            self.errors_seen = (self.errors_seen + [residual])[-_KEEP:]
        missed = residual * factor  # against the model alone: what the co-run model lacks
        # Split between the bandwidth curve (what any jobs asking that much bandwidth pay) and
        # the pairings (what these profiles pay beyond it): the curve takes what the pairings
        # did not already explain, and the pairings what the curve, so updated, does not.
        if group_bw is not None:
            key = (mode, self._bin(group_bw))
            pairs = [self._faded((name, nb, mode)) for nb in set(neighbours) if (name, nb, mode) in self.corun]
            level = missed if known else max(1.0, missed / ALONE_DOUBT)
            self.bw[key] = _blend(self.bw.get(key), max(1.0, level / max(1.0, min(pairs, default=1.0))),
                                  self._decay(key))
            self.at[key] = self.clock
            missed = missed / self.curve(mode, group_bw, live=False)
        for nb in set(neighbours):
            key = (name, nb, mode)
            self.corun[key] = _blend(self.corun.get(key), missed, self._decay(key))
            self.at[key] = self.clock
        return residual

    def checked(self, name: str) -> None:
        """`name`'s profile was made from a run alone here (a first run nobody shared): its alone
        time is its own, nothing to check."""
        self.alone.setdefault(name, (1, 1.0))

    def rebase(self, name: str, old_runtime: float, new_runtime: float) -> None:
        """`name`'s stored alone time moved (a run was merged into its profile): what runs showed
        of its real alone time is kept, against the new one."""
        got = self.alone.get(name)
        if got is not None and old_runtime > 0 and new_runtime > 0:
            self.alone[name] = (got[0], got[1] * old_runtime / new_runtime)

    def observe_live(self, mode: str, group_bw: float, expected: float, observed: float, seconds: float) -> float | None:
        """What a GPU's running jobs did over the last `seconds`, learned while they run (not only
        at their ends): the GPU's SM activity NVML `observed` (its device figure: under MPS no
        client's own is given) against what was `expected` of them (their profiles' SM at where
        each should be, at the rates their starts predicted, learned factors included), in this
        mode, at this summed peak bandwidth. A group running far slower than predicted shows it
        within a minute, and no more jobs are put into that much bandwidth meanwhile. Only what
        passes the most the profiles may be off (ALONE_DOUBT) counts, either way; two minutes of
        samples make a whole warning (LIVE_RUN). Returns the level it warns of (None: none)."""
        if expected < LIVE_ACTIVITY or seconds <= 0:
            return None  # too little expected of them to tell a slow group from an idle one
        f = min(LIVE_MAX, expected / max(observed, 1e-9))
        f = f / ALONE_DOUBT if f > ALONE_DOUBT else f * ALONE_DOUBT if f < 1.0 / ALONE_DOUBT else 1.0
        key = (mode, self._bin(group_bw))
        level = max(1.0, self.curve(mode, group_bw, live=False) * f)
        # An early warning, kept apart from what ends teach (the slowed jobs' own ends will, and
        # fade it): a level that was fine for the runs that ended there can turn costly a little
        # past them (within one 10 % step), and blended with them it would not show until then.
        # Two minutes of samples make the whole warning (LIVE_RUN), less a part of it.
        level = 1.0 + (level - 1.0) * min(1.0, seconds / LIVE_RUN)
        if level > self._live(key):
            self.live[key] = (level, self.clock)
        return level

    def _live(self, key) -> float:
        got = self.live.get(key)
        if got is None:
            return 1.0
        return float(got[0] ** (0.5 ** (max(0, self.clock - got[1]) / FADE_LIVE)))

    def _decay(self, key) -> float:
        """How much of its weight and distance from 1 evidence under `key` keeps, by its age."""
        return 0.5 ** (max(0, self.clock - self.at.get(key, 0)) / FADE)

    def _faded(self, key) -> float:
        """The mean factor under `key` (corun or bw) as its age leaves it (1 where none)."""
        got = self.corun.get(key) if len(key) == 3 else self.bw.get(key)
        if got is None:
            return 1.0
        return float(max(got[1], 1e-9) ** self._decay(key))

    @staticmethod
    def _bin(group_bw: float) -> int:
        return max(0, min(30, int(group_bw / BW_BIN + 1e-9)))

    def explored(self, mode: str, group_bw: float) -> bool:
        """Has a shared run in this mode started into at least this much summed bandwidth (or is
        it within what the published pairs showed costs nothing, KNOWN_BW)?"""
        b = self._bin(group_bw)
        return group_bw <= KNOWN_BW + 1e-9 or any(md == mode and k >= b for md, k in self.bw)

    def beyond(self, mode: str, group_bw: float) -> bool:
        """More than one step past the most summed bandwidth a shared run in this mode (in either,
        while none in this one) started into, or past KNOWN_BW."""
        # a mode no shared run has shown yet: what the other mode showed (the summed bandwidth
        # of the GPU's jobs contends whatever the mode)
        seen = [k for md, k in self.bw if md == mode] or [k for _, k in self.bw]
        return self._bin(group_bw) > max(seen + [self._bin(KNOWN_BW)]) + 1

    def curve(self, mode: str, group_bw: float, live: bool = True) -> float:
        """The extra slowdown runs showed at this much summed bandwidth in this mode, as their
        age leaves it: the most seen at this level or below (more bandwidth never costs less), 1
        where nothing was seen, and at a level not seen itself at least the line to the next
        level seen above it. Each level moves both ways and fades, so the curve does too."""
        if not self.bw and not (live and self.live):
            return 1.0
        b = self._bin(group_bw)
        keys = set(self.bw) | (set(self.live) if live else set())
        seen = sorted((k, max(self._faded((md, k)) if (md, k) in self.bw else 1.0, self._live((md, k)) if live else 1.0))
                      for (md, k) in keys if md == mode)
        below = [(k, m) for k, m in seen if k <= b]
        out = max([m for _, m in below] + [1.0])
        above = [(k, m) for k, m in seen if k > b]
        if above and (not below or below[-1][0] < b):
            # between two steps runs showed (nothing below: 1 at no bandwidth), on the line between
            # them: a knee between them would otherwise be met at full strength unannounced
            (k0, m0), (k1, m1) = below[-1] if below else (0, 1.0), above[0]
            out = max(out, m0 + (m1 - m0) * (b - k0) / (k1 - k0))
        return out

    def factor(self, name: str, other: str, mode: str) -> float:
        """The extra slowdown `name` showed beside `other` in this mode, as its age leaves it; a
        pairing not seen yet takes what `name` showed beside anyone (a profile that suffers from
        sharing suffers with strangers too), else 1."""
        if (name, other, mode) in self.corun:
            return max(1.0, self._faded((name, other, mode)))
        return self.general(name)

    def general(self, name: str) -> float:
        """What `name` showed beside any neighbour in any mode: the runs-weighted mean factor."""
        gen = self.__dict__.get("_general")
        if gen is None:  # rebuilt after every observation
            tot: dict[str, list] = {}
            for key, (n, _) in self.corun.items():
                t = tot.setdefault(key[0], [0.0, 0.0])
                t[0] += n
                t[1] += n * self._faded(key)
            gen = self.__dict__["_general"] = {a: max(1.0, w / n) for a, (n, w) in tot.items() if n}
        return gen.get(name, 1.0)

    def factors(self, resident_names: Sequence[str], cand: str, mode: str, group_bw: float = 0.0) -> np.ndarray:
        """Per row (residents, then the candidate): the learned extra slowdown from this pairing,
        times the bandwidth curve's at the group's summed peak bandwidth."""
        res = [self.factor(r, cand, mode) for r in resident_names]
        out = np.array(res + [max([self.factor(cand, r, mode) for r in resident_names] or [1.0])])
        return out * self.curve(mode, group_bw)

    def among(self, resident_names: Sequence[str], mps: np.ndarray, group_bw: float = 0.0) -> np.ndarray:
        """Per resident: the learned extra slowdown its present neighbours cost it (the largest of
        its pairings, in its own mode, times the bandwidth curve's; 1 alone)."""
        out = np.ones(len(resident_names))
        if len(resident_names) < 2:
            return out
        for i, r in enumerate(resident_names):
            mode = "mps" if mps[i] else "timesliced"
            out[i] = max(self.factor(r, o, mode) for j, o in enumerate(resident_names) if j != i) \
                * self.curve(mode, group_bw)
        return out

    def unseen(self, resident_names: Sequence[str], cand: str, mode: str) -> np.ndarray:
        """Per row (residents, then the candidate): how many of its pairings with the candidate
        (the candidate: with the residents) no run has shown yet in this mode."""
        res = [0.0 if (r, cand, mode) in self.corun else 1.0 for r in resident_names]
        return np.array(res + [float(sum((cand, r, mode) not in self.corun for r in resident_names))])

    def seen_among(self, resident_names: Sequence[str], mps: np.ndarray) -> np.ndarray:
        """Per resident: whether runs have shown every pairing it is in now (True alone)."""
        return np.array([all((r, o, "mps" if mps[i] else "timesliced") in self.corun
                             for j, o in enumerate(resident_names) if j != i) for i, r in enumerate(resident_names)],
                        dtype=bool)

    def margin(self, default: float) -> float:
        """How far predictions (learned factors included) have been wrong: the MARGIN_QUANTILE of
        the errors, recent ones weighing most, 5 % .. MARGIN_CAP. Each shared job's predicted
        rate is discounted by it once, where a pairing of its is unseen (plan())."""
        return self._margin(self.errors, default)

    def seen_margin(self, default: float) -> float:
        """The same from the predictions of pairings runs had all shown: a pairing's share need
        not pay for the errors about strangers, which its learned factors have since taken in.
        Until five such runs ended, `default` (the configured margin) stands for the ones missing:
        the errors that taught the factors say nothing of how far the factors are off, and those
        of all predictions standing in kept a margin at its cap from ever letting the five run
        (an absorbing state). A first seen run far off still counts."""
        seen = self.errors_seen[-_KEEP:]
        return self._margin([1.0 + default] * (5 - len(seen)) + seen, default)

    @staticmethod
    def _margin(errors: list, default: float) -> float:
        if len(errors) < 5:
            return default
        e = np.array(errors) - 1.0
        w = 0.5 ** (np.arange(len(e))[::-1] / FADE_ERRORS)  # the newest weighs 1
        order = np.argsort(e)
        cum = np.cumsum(w[order])
        q = float(e[order][np.searchsorted(cum, MARGIN_QUANTILE * cum[-1])])
        return float(min(MARGIN_CAP, max(0.05, q)))

    def suggest_budget(self, name: str, quantum: int = 256 * 1024**2) -> int | None:
        """The most memory a run of this profile used, plus 10 %, rounded up to `quantum`."""
        peak = self.max_mem.get(name)
        return int(math.ceil(peak * 1.10 / quantum) * quantum) if peak else None


def _blend(old: tuple | None, x: float, keep: float) -> tuple[int, float]:
    """(runs, mean) with one more run showing x: the old mean's weight and its distance from 1 kept
    by `keep` (its age), over at most KEEP_RUNS runs (so newer runs move it, both ways). The runs
    counted stay whole (what `colo profile show` says)."""
    if old is None:
        return 1, float(x)
    n, m = old
    m = max(float(m), 1e-9) ** keep
    w = min(float(n) * keep + 1.0, KEEP_RUNS)
    return min(int(n) + 1, KEEP_RUNS), m + (float(x) - m) / w


# What a running job is compared with at its end. Its start predicted its slowdown beside the
# jobs there then; each job started beside it later predicted it again, from then on, beside one
# more (details["residents"]). Its end is compared with these predictions, each for as long as
# it held (the alone time it said the job would get done meanwhile); otherwise a job joined late would teach its neighbours' slowdown as the model's error,
# and the bandwidth bin it started into as the one that cost it.

def expectation(details: dict, mode: str, t: float) -> dict:
    """What a start decision (its details) predicted for its job, started at `t`."""
    def of(key: str, default: float) -> float:
        v = (details.get(key) or {}).get(mode, default)
        return float(v) if isinstance(v, (int, float)) else default
    pred = details.get("predicted_slowdown")
    return {"slowdown": float(pred) if isinstance(pred, (int, float)) else of("slowdown_this", 1.0),
            "factor": of("learned_factor", 1.0), "unseen": of("unseen", 0.0),
            "group_bw": float(details.get("peak_membw") or 0.0), "since": t, "acc": [0.0, 0.0],
            "sharing": bool((details.get("residents") or {}).get(mode)), "shared": 0.0}


def _fold(e: dict, t: float) -> dict:
    """`e` with the stretch since its last change folded in: the alone time its prediction said
    the job would get done meanwhile, and the seconds it shared its GPU."""
    held = max(0.0, t - float(e["since"]))  # at the slowdown predicted: this much of its alone time
    return dict(e, since=t, acc=[e["acc"][0] + held / e["slowdown"], e["acc"][1] + held * e["factor"] / e["slowdown"]],
                shared=float(e.get("shared", 0.0)) + (held if e.get("sharing", True) else 0.0))


def joined(e: dict, t: float, details: dict, mode: str, job_id: int) -> dict:
    """`e` once a job started at `t` beside this one, from that start's details (and mode): from
    then on, what it predicted for this job; the GPU's summed peak bandwidth is the most it started
    into. A start that predicted nothing for it leaves its prediction stale (unseen: None)."""
    pred = ((details.get("residents") or {}).get(mode) or {}).get(str(job_id))
    out = dict(e, group_bw=max(float(e.get("group_bw") or 0.0), float(details.get("peak_membw") or 0.0)))
    if pred is None:
        out["unseen"] = None
        return out
    out = _fold(out, t)
    out.update(slowdown=float(pred[0]), factor=float(pred[1]), sharing=True,
               unseen=None if e.get("unseen") is None else max(float(e["unseen"]), float(pred[2])))
    return out


def left(e: dict, t: float) -> dict:
    """`e` once the job's last neighbour ended at `t`: from then on it runs alone, as predicted
    by nobody but its profile (1x), and its end is compared with that for the rest of its run."""
    if not e.get("sharing", True):
        return e
    return dict(_fold(e, t), slowdown=1.0, factor=1.0, sharing=False)


def progress(e: dict, t: float) -> float:
    """The alone-seconds of work the predictions said the job has done by `t` (where it should be
    in its profile)."""
    return e["acc"][0] + max(0.0, t - float(e["since"])) / e["slowdown"]


def shared(e: dict, start: float, end: float) -> float:
    """The share of its wall time (0..1) a run spent beside other jobs (1: not known)."""
    if "shared" not in e:
        return 1.0
    s = float(e["shared"]) + (max(0.0, end - float(e["since"])) if e.get("sharing") else 0.0)
    return min(1.0, s / max(end - start, 1e-9))


def expected(e: dict, start: float, end: float) -> tuple[float, float]:
    """(slowdown, learned factor) predicted for the run from `start` to `end`: its wall time over
    the alone time each prediction said it would get done while it held."""
    rest = max(0.0, end - float(e["since"]))
    work = e["acc"][0] + rest / e["slowdown"]
    if work <= 0:
        return e["slowdown"], e["factor"]
    return max(end - start, 1e-9) / work, (e["acc"][1] + rest * e["factor"] / e["slowdown"]) / work


# ---- the pass ---------------------------------------------------------------------------------

def _decision(job_id: int, action: str, gpus: tuple = (), mode: str | None = None, reason: str = "",
              details: dict | None = None, thread_pct: int | None = None) -> Decision:
    """Decision without the frozen dataclass's per-field __setattr__ (10,000 a pass must be cheap)."""
    d = object.__new__(Decision)
    object.__setattr__(d, "__dict__", {"job_id": job_id, "action": action, "gpus": gpus, "mode": mode,
                                       "reason": reason, "details": {} if details is None else details,
                                       "thread_pct": thread_pct})
    return d


def _measured_on(profile: Any, view: GpuView) -> bool:
    """Was the profile's alone time measured on this model of GPU (its runs here, or `colo
    profile record` on one like it)? Then it needs no run alone to be checked (check_alone): its
    doubt is the ordinary one. A shipped profile (from the study's TITAN Xp) or one from another
    model is checked once."""
    gpu = getattr(profile, "gpu", "") or ""
    return bool(gpu) and gpu == view.name


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


def order(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Priority first, then first come first served."""
    out = sorted(candidates, key=attrgetter("seq"))
    out.sort(key=attrgetter("priority"), reverse=True)  # stable: equal priorities keep seq order
    return out


def plan(candidates: Sequence[Candidate], gpus: Sequence[GpuView], placed: Sequence[Placed],
         config: PolicyConfig = PolicyConfig(), now: float | None = None,
         learned: "Learned | dict[int, Learned] | None" = None) -> list[Decision]:
    """One decision per candidate, in queue order; a job that cannot start now lets smaller ones
    behind it start (backfill) when they fit, unless it has waited `hold_after` seconds by `now`
    (then GPUs are held for it; without `now`, never). `learned`: what ends of jobs taught, for
    every job, or per uid (each user's jobs placed with what that user's runs taught only)."""
    # A pass allocates ~3 small objects per candidate and frees none; cyclic GC runs in the
    # middle of it would double its time and find nothing to collect.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(candidates, gpus, placed, config, now, learned)
    finally:
        if was_enabled:
            gc.enable()


def place_now(c: Candidate, gpus: Sequence[GpuView], placed: Sequence[Placed],
              config: PolicyConfig = PolicyConfig(), now: float | None = None) -> Decision:
    """For a job another scheduler (Slurm) has already started on this node: it cannot wait in
    colo's queue. plan()'s choice when plan() starts it; when plan() would rather wait (sharing
    past saturation), time-sliced on the best-fitting GPU that holds its budget (invariant 1
    still holds); WAIT only when no GPU has the memory, which the caller refuses."""
    d = plan([c], gpus, placed, config, now)[0]
    if d.action == START or c.gpus != 1:
        return d
    free = free_budget(gpus, placed)
    fits = [g for g in gpus if g.error is None and g.compute_mode == "default" and free[g.uuid] >= c.budget]
    if not fits:
        return d
    g = min(fits, key=lambda g: (free[g.uuid] - c.budget, g.index))
    return _decision(c.job_id, START, (g.uuid,), "timesliced",
                     f"time-sliced on GPU{g.index} (started by Slurm, so it cannot wait; colo alone would "
                     f"have waited: {d.reason})", dict(d.details))


def _hold_for(c: Candidate, state: dict[str, "_Gpu"]) -> list["_Gpu"] | None:
    """The GPUs to hold for a job that waits: the ones held for it last time while they still
    can take it (a hold that moved as other GPUs freed up would never end), else those with the
    most free budget (so the fewest jobs must end first) among the ones it could fit on."""
    if c.held:
        kept = [g for g in state.values() if g.view.index in c.held and g.view.usable >= c.budget]
        if len(kept) == c.gpus:
            return sorted(kept, key=lambda g: g.view.index)
    can = sorted((g for g in state.values() if g.view.usable >= c.budget and gpu_allowed(g.view, c.gpu_ids, c.gpu_type)),
                 key=lambda g: (-g.free, g.view.index))
    return can[: c.gpus] if len(can) >= c.gpus else None


def _plan(candidates: Sequence[Candidate], gpus: Sequence[GpuView], placed: Sequence[Placed],
          config: PolicyConfig, now: float | None, learned: "Learned | dict | None" = None) -> list[Decision]:
    per_uid = isinstance(learned, dict)
    cfgs: dict = {}

    def for_uid(uid: int) -> tuple["Learned | None", PolicyConfig]:
        """What this candidate's owner has learned, and the margin it sizes (cached per pass)."""
        got = cfgs.get(uid)
        if got is None:
            lrn = learned.get(uid, NOTHING) if per_uid else learned  # a user whose runs taught nothing yet
            c = dataclasses.replace(config, margin=lrn.margin(config.margin), seen_margin=lrn.seen_margin(
                config.margin)) if lrn is not None and lrn.errors else config
            got = cfgs[uid] = (lrn, c)
        return got

    cfg = config
    free = free_budget(gpus, placed)
    state: dict[str, _Gpu] = {g.uuid: _Gpu(g, free[g.uuid], []) for g in gpus
                              if g.compute_mode != "prohibited" and g.error is None}
    # A job that waits while a GPU is out of service is told so: it may be why.
    down = "".join(f"; GPU{g.index} is out of service ({g.error})" for g in gpus if g.error is not None)
    for p in placed:
        arr = _arrays(p.profile, cfg.step, cfg.horizon) if p.profile is not None else None
        for u in p.gpus:
            if u in state:
                state[u].res.append(_Res(p.job_id, arr, int((p.elapsed if p.done is None else p.done) / cfg.step),
                                         p.mode, p.uid, p.alone))
    most_free = max((g.free for g in state.values()), default=0)
    # profiles whose alone time is being checked now (one run at a time each)
    checking = {p.profile.name for p in placed if p.alone and p.profile is not None}
    memo: dict[tuple, tuple] = {}
    refused: dict[tuple, tuple] = {}
    refused_like: dict[tuple, tuple] = {}
    wait_text: dict[tuple[int, int, int], str] = {}
    out: list[Decision] = []
    append = out.append
    may_hold = now is not None and cfg.hold_after > 0
    strangers_wait = not cfg.unprofiled_share
    stranger_text = (f"waiting: this job has no profile: it runs alone or beside one well-known job (a profile "
                     f"of {cfg.well_known_runs}+ runs), so that its profile is clean, and no GPU with its budget "
                     f"free is empty or runs just one such job; {WAYS_OUT}")
    prev_c: Candidate | None = None
    for c in [*order(candidates), None]:  # None: a last turn, to look at the last one's decision
        if may_hold and prev_c is not None and out[-1].action == WAIT and now - prev_c.queued_at >= cfg.hold_after:
            held = _hold_for(prev_c, state)
            if held:
                may_hold = False
                names = ", ".join(f"GPU{g.view.index}" for g in held)
                waited = _duration(now - prev_c.queued_at)
                out[-1] = dataclasses.replace(out[-1], reason=f"{out[-1].reason}; {names} held for it (waiting "
                                              f"{waited}): nothing new starts there until it does",
                                              details={**out[-1].details, "held": [g.view.index for g in held]})
                for g in held:
                    del state[g.view.uuid]
                down += "".join(f"; GPU{g.view.index} is held for job {prev_c.job_id}" for g in held)
                most_free = max((g.free for g in state.values()), default=0)
                wait_text.clear()
                refused_like.clear()
        if c is None:
            break
        prev_c = c
        if c.gpus == 0:
            append(_decision(c.job_id, START, (), "none", "needs no GPU"))
            continue
        only = c.gpu_ids or c.gpu_type  # --gpu-id/--gpu-type: GPUs it may not use are not looked at
        if c.budget > most_free or c.gpus > len(state):  # the common case in a long queue: no numpy
            key = (c.budget, c.gpus, most_free)
            text = wait_text.get(key)
            if text is None:
                text = wait_text[key] = (f"waiting for memory: needs {format_size(c.budget)} on {c.gpus} GPU(s), "
                                         f"most free budget on one GPU is {format_size(most_free)}{down}")
            append(_decision(c.job_id, WAIT, reason=text, details={"need": c.budget, "most_free": most_free}))
            continue
        # Within a pass GPUs only fill up: a job like one already refused (same profile, uid and
        # GPU count) with at least its budget is refused for the same reason, without more work.
        same = (id(c.profile), c.uid, c.gpus, c.gpu_ids, c.gpu_type)
        prev = refused_like.get(same)
        if prev is not None and c.budget >= prev[0]:
            append(_decision(c.job_id, WAIT, reason=prev[1], details=dict(prev[2])))
            continue
        if c.profile is None and strangers_wait and not any(
                g.free >= c.budget and (not g.res or (len(g.res) == 1 and g.res[0].arr is not None
                                                      and g.res[0].arr.runs >= cfg.well_known_runs))
                for g in state.values()):
            # no profile (rule 2): only an empty GPU or one running a single well-known job can
            # take it, and none with its budget free is either; no per-GPU assessment needed
            append(_decision(c.job_id, WAIT, reason=stranger_text + down, details={"need": c.budget}))
            continue
        fitting = [g for g in state.values() if g.free >= c.budget and (not only or gpu_allowed(g.view, c.gpu_ids,
                                                                                                c.gpu_type))]
        if len(fitting) < c.gpus:
            among = f" among the GPUs it may use ({_only_text(c.gpu_ids, c.gpu_type)})" if only else ""
            append(Decision(c.job_id, WAIT, reason=(
                f"waiting for memory: needs {format_size(c.budget)} on {c.gpus} GPU(s), "
                f"{len(fitting)} GPU(s){among} have that much free budget{down}"),
                details={"need": c.budget, "most_free": most_free}))
            continue
        arr = _arrays(c.profile, cfg.step, cfg.horizon) if c.profile is not None else None
        # Best fit first; the first placement predicted to cost nobody anything is the answer,
        # so most candidates are assessed on one or two GPUs, and each assessment is memoised.
        fitting.sort(key=lambda g: (g.free - c.budget, g.view.index))
        options, free_ones = [], 0
        for g in fitting:
            uid_ok = cfg.multi_user_mps or all(r.uid == c.uid for r in g.res if r.mode == "mps")
            # the uid matters only through uid_ok, and through what its owner learned when per user
            rk = (id(c.profile), uid_ok, g.view.uuid, c.uid if per_uid else None)
            got = refused.get(rk)  # within a pass a GPU only gets busier: a refusal stands
            if got is None:
                k = rk + (g.version,)
                got = memo.get(k)
                if got is None:
                    lrn, ccfg = for_uid(c.uid) if learned is not None else (None, cfg)
                    got = memo[k] = _assess(arr, c.uid, g, ccfg, lrn)
                    if got[0] is None:
                        refused[rk] = got
            options.append((g, got))
            if got[0] is not None and not got[3]:
                free_ones += 1
                if free_ones >= c.gpus:
                    break
        ok = [(g, a) for g, a in options if a[0] is not None]
        if len(ok) < c.gpus:
            g, a = options[0]
            text = f"waiting: {a[1]}"
            append(_decision(c.job_id, WAIT, reason=text, details=dict(a[2])))
            if prev is None or c.budget < prev[0]:
                refused_like[same] = (c.budget, text, a[2])
            continue
        # predicted-free placements first, then best fit (least budget left over)
        ok.sort(key=lambda ga: (ga[1][3], ga[0].free - c.budget, ga[0].view.index))
        chosen = ok[: c.gpus]
        modes = {a[0] for _, a in chosen}
        mode = modes.pop() if len(modes) == 1 else "timesliced"
        if mode == "timesliced" and any(g.view.compute_mode != "default" for g, _ in chosen):
            append(Decision(c.job_id, WAIT, reason="waiting: no set of GPUs takes this job in one mode"))
            continue
        # A profile no run has shown alone here is measured against a stored alone time nobody
        # has checked, so the slowdown its shared runs show may be off by as much as that time is
        # (ALONE_DOUBT, which the check must then assume). Once, when it would start on an empty
        # GPU anyway, it runs alone there to the end, and its end teaches its alone time.
        check = (cfg.check_alone and learned is not None and len(chosen) == 1 and not chosen[0][0].res and arr is not None and arr.name
                 and not getattr(c.profile, "provisional", False) and arr.name not in checking
                 and arr.name not in for_uid(c.uid)[0].alone and not _measured_on(c.profile, chosen[0][0].view))
        if check:
            checking.add(arr.name)
        for g, _ in chosen:
            g.free -= c.budget
            g.res.append(_Res(c.job_id, arr, 0, mode, c.uid, bool(check)))
            g.version += 1
        most_free = max((g.free for g in state.values()), default=0)
        g0, a0 = chosen[0]
        reason = a0[1] if a0[0] == mode else f"time-sliced on {', '.join(f'GPU{g.view.index}' for g, _ in chosen)}"
        details = dict(a0[2], mode=mode, budget=c.budget, left=g0.free, usable=g0.view.usable,
                       predicted_slowdown=max(float(a[2].get("slowdown_this", {}).get(mode, 1.0)) for _, a in chosen))
        if c.grow:
            details["grow"] = True
        if check:
            details["check_alone"] = True
            reason += "; alone this once, so that how long its profile takes alone here is learned"
        tp = thread_pct(arr, cfg) if (mode == "mps" and arr is not None) else None
        if tp is not None:
            details["thread_pct"] = tp
        append(Decision(c.job_id, START, tuple(g.view.uuid for g, _ in chosen), mode,
                        f"{reason}; {_mem_text(g0, g0.free)}", details, tp))
    if cfg.lend > 1.0 and any(c.grow for c in candidates):
        _lend(out, candidates, state, cfg)
    return out


def _lend(out: list[Decision], candidates: Sequence[Candidate], state: dict[str, "_Gpu"], cfg: PolicyConfig) -> None:
    """Memory left on a GPU after this pass that no job still queued fits in goes to the --grow
    jobs started there, up to `lend` x their budget (in 256 MiB steps): invariant 1 holds (the
    budgets it raises are what the GPU had free), and nobody waits for it."""
    started = {d.job_id for d in out if d.action == START}
    smallest = min((c.budget for c in candidates if c.gpus and c.job_id not in started), default=None)
    q = 256 * 1024**2
    for i, d in enumerate(out):
        if d.action != START or len(d.gpus) != 1 or not d.details.get("grow"):
            continue
        g = state.get(d.gpus[0])
        if g is None or (smallest is not None and g.free >= smallest):
            continue
        budget = d.details["budget"]
        extra = min(g.free, int(math.ceil(budget * cfg.lend / q) * q) - budget) // q * q
        if extra <= 0:
            continue
        g.free -= extra
        out[i] = dataclasses.replace(d, reason=f"{d.reason}; {format_size(extra)} more lent (--grow: no queued job fits in it)",
                                     details={**d.details, "budget": budget + extra, "asked": budget, "left": g.free})


NOTHING = Learned()  # what a node that has learned nothing yet knows (never changed: plan() only reads)
