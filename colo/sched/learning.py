"""What ends of jobs teach and how it is kept (Learned: co-run factors, alone times, the
bandwidth curve, the margins), what a running job is compared with at its end (expectation,
joined, left, expected), and the end-of-job learning rule, the same for the daemon
(colo/daemon/learner.py) and the simulator (colo/sched/sim.py), so that what `colo sim` judges is
what the daemon does. Pure: the callers gather the facts of the run, this decides.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .budgets import STEP, step_up

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
# Contexts taking turns (time-sliced jobs, and an MPS group beside them as one context): the
# summed peak SM of a GPU's jobs a share may reach before any group here ran at that level as
# predicted (a light pair's), and the resolution of the levels groups showed (TS_BIN). Past the
# most a group showed, a share adds one job at a time (Learned.ts_beyond). The model says light
# contexts take turns for free, as on the H200; on a GPU where they do not (the placement study's
# light pair: 2x time-sliced) the first pass would otherwise crowd 4-5 of them onto one GPU, every
# job 5-60x slower in the stress worlds of `colo sim` until the crowd drains.
KNOWN_TS = 0.5
TS_BIN = 0.25
# A newcomer whose profile's peak SM (its whole run: an idle stretch of a busy job's profile
# takes turns once it ends, `colo sim`'s stress worlds) is at most this (NVML's 1 % resolution)
# launches no kernels to speak of: it takes no turns, and its share leaves the level of taking
# turns where the residents have it, so no step past any level is taken (an idle notebook kernel
# restarted beside a saturating job waited for that job's whole run).
TS_IDLE = 0.01
KEEP_RUNS = 8  # a learned mean counts at most this many runs: newer runs move it
FADE = 60.0  # observations (job ends) after which unconfirmed evidence counts half as far from 1
FADE_ERRORS = 60.0  # the same for the errors that size the margins (recency weights)
LIVE_MIN = 20.0  # seconds of a running group's readings from which it is learned (the daemon's watch and colo sim's)
LIVE_RUN = 60.0  # seconds of a running group's samples that make a whole warning
LIVE_ACTIVITY = 0.2  # the least SM activity expected of a group for its readings to say how fast it runs
LIVE_MAX = 4.0  # the most a group's readings are taken to show (a reading near 0 says "much slower", not how much)
# A running group with contexts taking turns shows that its level costs more than the model says
# only when its readings pass the profiles' doubt by this factor (noise and phases aside)
LIVE_TS_SLOW = 1.25
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
    # bin of a level of taking turns (turns_level, TS_BIN steps) -> the clock when a running group
    # with time-sliced jobs took turns at it, on average over its watch, as predicted: explored
    ts: dict = field(default_factory=dict)
    # the same -> the clock when a group there ran slower than predicted (live, or a time-sliced
    # run's end past the margin's cap): no share goes there while it is recent (_ts_ceiling)
    ts_slow: dict = field(default_factory=dict)

    def observe(self, name: str, neighbours: Sequence[str], mode: str, predicted: float, wall: float,
                stored_runtime: float, peak_mem: int | None = None, factor: float = 1.0,
                group_bw: float | None = None, unseen: float | None = None, shared: float = 1.0,
                group_sm: float | None = None) -> float | None:
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
        if group_sm is not None and mode == "timesliced" and residual > 1.0 + MARGIN_CAP:
            # a time-sliced run that ended slower than the margin's cap takes the level it started
            # into back, and every level above (explored afresh, a job at a time). One that ended
            # as predicted explores nothing: the level its start predicted need not be the one it
            # ran at (a neighbour loading data takes no turns); running groups show that (observe_live)
            self._ts_seen(group_sm, False)
        # Split between the bandwidth curve (what any jobs asking that much bandwidth pay) and
        # the pairings (what these profiles pay beyond it): the curve takes what the pairings
        # did not already explain, and the pairings what the curve, so updated, does not.
        # Only under MPS: there kernels of different jobs run at once and their bandwidth sums;
        # time-sliced contexts take turns, and what they cost each other is the pairing's.
        if group_bw is not None and mode == "mps":
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

    def observe_live(self, mode: str, group_bw: float, expected: float, observed: float, seconds: float,
                     group_sm: float | None = None) -> float | None:
        """What a GPU's running jobs did over the last `seconds`, learned while they run (not only
        at their ends): the GPU's SM activity NVML `observed` (its device figure: under MPS no
        client's own is given) against what was `expected` of them (their profiles' SM at where
        each should be, at the rates their starts predicted, learned factors included), in this
        mode ("timesliced": any of them is), at this summed peak bandwidth, taking turns at
        `group_sm` on average (turns_level; a group with time-sliced jobs teaches only that). A
        group running far slower than predicted shows it within a minute, and no more jobs are
        put into that much bandwidth meanwhile. Only what
        passes the most the profiles may be off (ALONE_DOUBT) counts, either way; two minutes of
        samples make a whole warning (LIVE_RUN). Returns the level it warns of (None: none)."""
        if expected < LIVE_ACTIVITY or seconds <= 0:
            return None  # too little expected of them to tell a slow group from an idle one
        f = min(LIVE_MAX, expected / max(observed, 1e-9))
        f = f / ALONE_DOUBT if f > ALONE_DOUBT else f * ALONE_DOUBT if f < 1.0 / ALONE_DOUBT else 1.0
        if mode == "timesliced":
            # a group with time-sliced contexts: taking turns as predicted explores its level at
            # once (ends come minutes later); running slower takes it and the levels above back.
            # Its bandwidth teaches nothing (time-sliced contexts' bandwidth does not sum).
            if group_sm is not None and (f > LIVE_TS_SLOW or f <= 1.0):
                self._ts_seen(group_sm, f <= 1.0)
            return None
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

    @staticmethod
    def _ts_bin(group_sm: float) -> int:
        return max(0, min(40, int(group_sm / TS_BIN + 1e-9)))

    def _ts_seen(self, group_sm: float, as_predicted: bool) -> None:
        b = self._ts_bin(group_sm)
        if as_predicted:
            self.ts[b] = self.clock
            self.ts_slow = {k: c for k, c in self.ts_slow.items() if k > b}
        else:
            self.ts = {k: c for k, c in self.ts.items() if k < b}
            self.ts_slow[b] = self.clock

    def _ts_ceiling(self) -> int:
        """The lowest level a time-sliced group ran slower than predicted at, while that is
        recent (FADE observations): no share goes there, KNOWN_TS included. Then it is
        explored again, a step at a time."""
        return min([k for k, c in self.ts_slow.items() if self.clock - c < FADE] + [1 << 30])

    def ts_explored(self, group_sm: float) -> bool:
        """Has a running group taken turns at this level or above as predicted (or is it within
        KNOWN_TS), with no slower group at or below it lately?"""
        b = self._ts_bin(group_sm)
        return b < self._ts_ceiling() and (group_sm <= KNOWN_TS + 1e-9 or any(k >= b for k in self.ts))

    def ts_beyond(self, group_sm: float, step: float = TS_BIN) -> bool:
        """More than one job (`step`: the newcomer's own peak SM, at least TS_BIN) past the
        highest level of taking turns groups showed costs nothing (or KNOWN_TS), or at a level
        one ran slower at lately."""
        b = self._ts_bin(group_sm)
        top = max([(k + 1) * TS_BIN for k in self.ts] + [KNOWN_TS])
        return group_sm > top + max(TS_BIN, step) + 1e-9 or b >= self._ts_ceiling()

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

    def suggest_budget(self, name: str, quantum: int = STEP) -> int | None:
        """The most memory a run of this profile used, plus 10 %, rounded up to `quantum`."""
        peak = self.max_mem.get(name)
        return step_up(peak * 1.10, quantum) if peak else None


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

def turns_level(sm: Sequence, mps: Sequence[bool], newcomer: Any = 0.0) -> Any:
    """The level of taking turns of jobs whose SM is `sm`: each time-sliced job's SM, plus the MPS
    clients' summed SM up to the whole GPU (one context), plus `newcomer`, the SM of one more job
    as a context of its own. Per job a number (now: a running group's watch, in the daemon and in
    `colo sim`) or an array over grid steps (assess: a share's level per step, the candidate the
    newcomer in either mode, the cautious reading; its busiest step is details["ts_level"]). Summed
    in job order, then the MPS context, then the newcomer."""
    group = sum(x if isinstance(x, np.ndarray) else float(x) for x, m in zip(sm, mps) if m)
    ts = sum(x if isinstance(x, np.ndarray) else float(x) for x, m in zip(sm, mps) if not m)
    return ts + (np.minimum(1.0, group) if isinstance(group, np.ndarray) else min(1.0, group)) + newcomer


def expectation(details: dict, mode: str, t: float) -> dict:
    """What a start decision (its details) predicted for its job, started at `t`."""
    def of(key: str, default: float) -> float:
        v = (details.get(key) or {}).get(mode, default)
        return float(v) if isinstance(v, (int, float)) else default
    pred = details.get("predicted_slowdown")
    return {"slowdown": float(pred) if isinstance(pred, (int, float)) else of("slowdown_this", 1.0),
            "factor": of("learned_factor", 1.0), "unseen": of("unseen", 0.0),
            "group_bw": float(details.get("peak_membw") or 0.0), "group_sm": float(details.get("ts_level") or 0.0),
            "since": t, "acc": [0.0, 0.0],
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
    out = dict(e, group_bw=max(float(e.get("group_bw") or 0.0), float(details.get("peak_membw") or 0.0)),
               group_sm=max(float(e.get("group_sm") or 0.0), float(details.get("ts_level") or 0.0)))
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


NOTHING = Learned()  # what a node that has learned nothing yet knows (never changed: plan() only reads)


# ---- the end-of-job rule ---------------------------------------------------------------------

def end_of_job(learned: Learned, name: str, neighbours: Sequence[str], mode: str | None,
               decision: dict, started_at: float, ended_at: float, stored_runtime: float,
               peak_mem: int | None) -> float | None:
    """A run of profile `name` from `started_at` to `ended_at`, beside `neighbours` (their profile
    names) in `mode`, placed by `decision` (its start decision as stored: "mode", and "details"
    with the "expect" its neighbours' starts and ends kept up to date; built from the details when
    missing), against the profile's stored alone time. Returns observed / predicted slowdown
    (Learned.observe). The GPU's summed bandwidth is learned from only when the start recorded
    one; `shared` counts only when it had neighbours."""
    details = decision.get("details") or {}
    e = details.get("expect") or expectation(details, decision.get("mode") or "", started_at)
    predicted, factor = expected(e, started_at, ended_at)
    group_bw = float(e["group_bw"]) if isinstance(details.get("peak_membw"), (int, float)) else None
    group_sm = float(e["group_sm"]) if "group_sm" in e and isinstance(details.get("ts_level"), (int, float)) else None
    return learned.observe(name, sorted(neighbours), str(mode or "timesliced"), predicted, ended_at - started_at,
                           stored_runtime, peak_mem, factor, group_bw, e.get("unseen"),
                           shared(e, started_at, ended_at) if neighbours else 1.0, group_sm)


def profile_learned(learned: Learned, name: str, old_runtime: float | None, new_runtime: float,
                    shared: bool) -> None:
    """A run was merged into `name`'s profile (its alone time moved from old_runtime, None: it had
    none, to new_runtime): what runs showed of its real alone time is kept against the new one; a
    first profile made from a run nobody shared is its alone time here, checked."""
    if old_runtime is not None:
        learned.rebase(name, old_runtime, new_runtime)
    elif not shared:
        learned.checked(name)
