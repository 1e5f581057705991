"""A profile on the placement pass's grid (peak SM and bandwidth per step, each point widened by
PHASE so that a run's phases may come a little early or late), cached per profile object; the
stand-in for a job with no profile; the MPS thread share a profile gets."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .views import PolicyConfig

@dataclass(frozen=True)
class _Arr:
    sm: np.ndarray
    membw: np.ndarray
    cache_bound: bool
    peak_sm: float
    peak_membw: float
    runs: int = 1
    name: str = ""
    provisional: bool = False  # made from the first samples of a run still going (profiles.provisional)


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
               int(getattr(profile, "runs", 1) or 1), str(getattr(profile, "name", "")),
               bool(getattr(profile, "provisional", False)))
    if len(_CACHE) > 4096:
        _CACHE.clear()
    _CACHE[key] = (profile, arr)
    return arr


# What a job with no profile can do about waiting (its reason says it: `colo explain`)


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
