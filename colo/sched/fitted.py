"""A physics fitted to a real GPU's measurements (the `h200` truth of colo/sched/truth.py).

Only the simulator's truth uses it: the policy never imports it (tests/test_layout.py), and it
shares nothing with the policy's model (colo/sched/interference.py) but the shapes of its arrays.

Model. A job's SM reading `sm` (NVML: the share of time a kernel of it ran, 0..1) is turned into
the share of the GPU's time it needs, u = DUTY * sm (a saturating 4096² matmul loop reads ~100 %
and yet two of them time-sliced ran 1.21x faster than back to back: it leaves gaps another context
fills). Contexts (every time-sliced job; all MPS clients of a GPU together, whose summed need is
divided by MPS_GAIN, the extra work concurrent kernels get done) share the GPU's time max-min
fairly (water-filling: a context needing less than its fair share gets all it needs, the rest
split what is left); a job's rate is what its context got over what it needed. Each further busy
context costs everyone C_TS, each further MPS client C_MPS (switching and host-side contention).
Memory bandwidth is not in it: no measurement yet separates a cache-bound pair (the GPU check's
heavy pairs will; docs/gpu.md).

The constants live in truth_h200.json next to this file, written by `python bench/fit_truth.py
REPORT.json ... --write` from the GPU check's reports (docs/sim.md has the fit and residuals).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

FIT_FILE = Path(__file__).with_name("truth_h200.json")
MiB = 1024**2


@dataclass(frozen=True)
class Params:
    duty: float = 0.83  # GPU time a context needs per unit of its SM reading
    mps_gain: float = 1.10  # work concurrent MPS kernels get done over the same kernels time-sliced
    c_ts: float = 0.0  # slowdown per further busy context
    c_mps: float = 0.0  # slowdown per further busy MPS client
    ctx_mem: int = 518 * MiB  # device memory of an ordinary context, outside any budget (measured)
    mps_client_mem: int = 145 * MiB  # of an MPS client's context (measured: what its pinned limit lost at init)
    mps_server_mem: int = 66 * MiB  # of the MPS server (measured: NVML's process list)


def load(path: Path = FIT_FILE) -> Params:
    """The fitted constants (the defaults above when no fit file is there)."""
    try:
        got = json.loads(path.read_text())["params"]
    except (OSError, ValueError, KeyError):
        return Params()
    names = {f.name for f in fields(Params)}
    return Params(**{k: (int(v) if k.endswith("_mem") else float(v)) for k, v in got.items() if k in names})


def waterfill(need: np.ndarray) -> np.ndarray:
    """Max-min fair shares of a capacity of 1 among contexts needing `need` (contexts, T): each
    gets min(need, L), with L the level at which the shares sum to 1 (every need, if they fit)."""
    c, t = need.shape
    if c == 0:
        return need
    s = np.sort(need, axis=0)
    before = np.cumsum(s, axis=0) - s
    level = (1.0 - before) / (c - np.arange(c))[:, None]
    ok = s >= level
    first = np.argmax(ok, axis=0)
    cap = np.where(ok.any(axis=0), level[first, np.arange(t)], np.inf)
    return np.minimum(need, cap[None, :])


def rates(sm, membw, cache_bound, mps, p: Params) -> np.ndarray:
    """Progress rate of each job at each instant (sm, membw: (jobs, T) or (jobs,); mps: (jobs,))."""
    sm = np.asarray(sm, dtype=float)
    if sm.ndim == 1:
        sm = sm[:, None]
    mps = np.asarray(mps, dtype=bool).reshape(-1)
    active = sm > 0
    u = p.duty * np.clip(sm, 0.0, 1.0) * active
    ts = u[~mps]
    group = u[mps].sum(axis=0) / p.mps_gain
    need = np.vstack([ts, group[None, :]]) if mps.any() else ts
    got = waterfill(need)
    frac = np.where(need > 0, got / np.maximum(need, 1e-12), 1.0)
    out = np.empty_like(sm)
    out[~mps] = frac[: ts.shape[0]]
    if mps.any():
        out[mps] = frac[-1][None, :]
    n_ctx = (ts > 0).sum(axis=0) + (group > 0)
    n_mps = active[mps].sum(axis=0)
    over = 1.0 + p.c_ts * np.maximum(0, n_ctx - 1) + p.c_mps * np.maximum(0, n_mps - 1)
    return np.where(active, out / over[None, :], 1.0)


def group_slowdown(n: int, sm: float, mode: str, p: Params) -> float:
    """The slowdown of each of n like jobs (constant SM reading `sm`) run at once in `mode`."""
    r = rates(np.full((n, 1), sm), np.zeros((n, 1)), np.zeros(n, bool), np.full(n, mode == "mps"), p)
    return float(1.0 / r[0, 0])
