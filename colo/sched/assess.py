"""One GPU as the placement pass sees it (its residents' profiles aligned on now) and the check
of one candidate on it (_assess): which mode, if any, passes the slowdown bound and beats
waiting, and the reason `colo explain` shows."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import interference
from .grid import _Arr, _unknown
from .learning import ALONE_DOUBT, EXPLORE_WORST, MARGIN_CAP, TS_IDLE, Learned, turns_level
from .views import GiB, GpuView, PolicyConfig

# What a job with no profile can do about waiting (its reason says it: `colo explain`)
WAYS_OUT = ("ways out: --profile NAME (a profile you recorded with `colo profile record`, or one an admin "
            "shared with `colo profile share`), `unprofiled_share = true` in the daemon's config, or wait: "
            "once a job like it (the same image or program and script) has run half a minute, jobs like it "
            "are placed beside others from its samples")


# ---- the GPU as the pass sees it ---------------------------------------------------------------

PROVISIONAL_GROUP = 3  # jobs placed on provisional profiles on one GPU at once


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

    if arr.provisional and sum(r.arr is not None and r.arr.provisional for r in g.res) >= PROVISIONAL_GROUP:
        # no run of theirs has ended (their expectations are guesses, and the watch needs LIVE_MIN
        # to tell): a crowd of a family on its first minute's levels ran 200x slow under `study`
        # before anything could tell (docs/sim.md, issue 39, seventh round); with the watch, 4 gains
        # light queues on 4 GPUs (0.401 -> 0.369 of SJF) and costs memory-light there (0.609 -> 0.625,
        # 4 seeds) and `study` light (0.602 -> 0.626): kept at 3 (docs/sim.md, eighth round)
        return None, (f"{name} runs {PROVISIONAL_GROUP} jobs placed on provisional profiles, the most at once until "
                      "a run of theirs ends"), {"gpu": v.index}, False
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
    # the level of taking turns were the candidate one more, at the busiest step
    ts_level = float(turns_level(r_sm[:, :overlap], r_mps, c_sm).max())
    per_job = dict(zip(map(str, ids), r_sm[:, :overlap].max(axis=1).tolist()))
    per_job["this"] = float(c_sm.max())
    d = {"gpu": v.index, "overlap_s": overlap * cfg.step, "peak_sm": peak_sm, "peak_membw": peak_bw,
         "sm_by_job": per_job, "saturation": cfg.saturation, "ts_level": ts_level}
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
    ts_step: dict[str, bool] = {}  # modes whose share goes past the level of taking turns groups showed
    far_ts: set[str] = set()  # of `far`, those past it by taking turns (not by bandwidth)
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
            # each one's mean rate over its own part of the overlap: a resident that ends within
            # it is not averaged with the stretch after its end, which would hide its slowdown
            own = np.minimum(np.append(r_left, overlap), overlap)
            per = np.cumsum(rate, axis=1)[np.arange(n), np.maximum(own, 1) - 1] / np.maximum(own, 1)
        if fac is not None:  # co-run slowdowns the model missed, as observed
            d.setdefault("learned_factor", {})[m] = float(fac[-1])
        # throughput: the residents as they are discounted now, the newcomer by its own margin
        tp[m] = float((per[:-1] / now_doubt).sum() + per[-1] / doubt[-1])
        # An unchecked alone time's doubt never takes the discount past the learned margin's cap:
        # a margin at its cap times that doubt (1.4 x 1.118 = 1.57x) refused every share the
        # model says costs nothing, and with no share run nothing brought the margin down again
        # (colo demo's step 6: one run compared with the alone time a shorter run of its
        # profile taught had pushed it there).
        discount = np.maximum(doubt, np.minimum(doubt * unchecked, 1.0 + MARGIN_CAP))
        slow[m] = float((discount / np.maximum(per, 1e-9)).max())
        if m == "mps" and learned is not None and not learned.explored(m, peak_bw):
            # More summed bandwidth than any MPS group started into: contention can rise steeply
            # past a knee no profile shows (the study's cache-bound pair: 3.6x slower under MPS,
            # not time-sliced; time-sliced contexts take turns and their bandwidth does not sum). Never more than one step past it
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
        if ((m == "timesliced" or not all_mps) and learned is not None and arr.peak_sm > TS_IDLE
                and not learned.ts_explored(ts_level)):
            # More summed SM taking turns than any group here ran at as predicted: the model says
            # light contexts take turns for free (as on the H200), a GPU where they do not (the
            # placement study's light pair: 2x time-sliced) would be crowded at once, each job
            # 2-30x slower until the crowd drains. So one job at a time past the level groups
            # showed (an MPS client joining a GPU with time-sliced contexts too: the MPS context
            # then needs more of the turns); a group that runs slower stops it (Learned.ts_beyond).
            # A newcomer whose whole profile launches no kernels (TS_IDLE) takes no turns: nothing to step past
            ts_step[m] = True
            if learned.ts_beyond(ts_level, float(c_sm.max())) and m not in far:
                far.add(m)
                far_ts.add(m)
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
        if ts_step.get(best):
            d["ts_step"] = True
            tail += (f"; contexts taking turns at {_pct(ts_level)} summed SM, one job past what any group "
                     "here ran at as predicted")
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
           (f"contexts taking turns at {_pct(ts_level)} summed SM is more than one job past what any group "
            "here ran at as predicted, or where one ran slower lately" if m in far_ts else
            f"summed bandwidth {_pct(peak_bw)} is more than one step past what any shared run showed")
           if m in far else f"throughput {tp[m]:.2f} {label} vs {wait_tp:.2f} waiting")
    return None, (f"{prefix}co-running on {name} predicted to cost more than it gains: "
                  f"{sat_text + '; ' if sat_text else ''}{why}"), d, False
