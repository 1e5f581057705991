"""`colo sim`: replay a workload through colo's own policy (policy.plan, unchanged) and through
baseline policies, on a discrete-event model of the GPUs, and compare.

What the jobs really do (their run time, SM, bandwidth, memory, and how co-running slows them) is
the Truth's (colo/sched/truth.py); every policy, baselines included, sees only the stored profiles.

Events: arrivals, job ends and failures, profile step boundaries (a job's demand changes), and a
re-plan tick. Between events every demand is constant, so progress is exact.
Memory: a job whose use passes its budget fails (the interposer makes its allocation fail);
without budgets, a job whose allocation passes the device's capacity fails. A job that fails by
OOM is re-run from the start, at most MAX_TRIES times in all, as the study's baselines were;
after that it is lost, and a result with lost jobs is a failure, whatever its makespan.
With `grow`, colo requeues a job refused by its budget once with a larger budget (`colo submit
--grow`): budgets.GROW x the budget, at least that x the refused use, at most the GPU's.

The simulator's parts, each a module: workloads.py (what it replays), simnode.py (the runs and
GPUs), simpolicies.py (colo and the baselines), oracle.py (the reference that reads the truth),
simresult.py (what a run gives, and how it prints); this module runs them (simulate, compare).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .. import profiles as profs
from ..config import Config
from ..profiles import Profile
from ..units import format_size
from . import fairshare, learning
from . import policy as pol
from . import truth as simtruth
from .budgets import GROW, step_up
from .oracle import oracle_bound
from .simnode import PolicyFn, SimGpu, SimRun, seen_profile
from .simpolicies import (FAIR_HALF_LIFE, colo, exclusive_fifo, exclusive_sjf, max_pack, mean_pack, mps_all,
                          naive, tetris)
from .simresult import Result, result_of
from .workloads import DEFAULT_GPU_MEM, SimError, SimJob

# what callers name as sim.X (colo/cli/sim.py, bench/, workloads/, tests/test_sim.py), held where it is imported from
from .simresult import plot, seeds_table, table  # noqa: F401
from .workloads import (CLASSES, MIXES, SIZES, Workload, dumps_workload, jobs_from_history,  # noqa: F401
                        load_workload, loads_workload, make_mix, workloads_dir)

MAX_TRIES = 3
REPLAN_EVERY = 10.0  # seconds: the daemon re-plans on events and on a periodic tick
# colo places as a daemon with the default configuration does (a profile never seen alone here is
# run alone once only where Config.check_alone is on: Placed.alone is passed as the daemon does)
DAEMON_CONFIG = pol.config_of(Config())


def simulate(jobs: Sequence[SimJob], policy: str | PolicyFn = "colo", gpus: int = 1,
             gpu_mem: int = DEFAULT_GPU_MEM, config: pol.PolicyConfig | None = None,
             replan_every: float | None = REPLAN_EVERY, name: str | None = None,
             truth: simtruth.Truth | None = None, grow: bool = False,
             learned: pol.Learned | None = None, learn: bool = True,
             half_life: float = FAIR_HALF_LIFE, profiles: dict[str, Profile] | None = None) -> Result:
    """colo runs as the daemon does: the queue in fair-share order (colo/sched/fairshare.py, use decaying
    with `half_life`), learning from every job's end into `learned` (what earlier runs taught,
    carried by the caller; a fresh one when None; `learn=False`: a colo that never learns), and
    learning profiles into `profiles` (name -> the profile colo places that application with
    now, as the daemon's learned copies; carried by the caller with `learned`, a fresh one when
    None): see learn_profile()."""
    config = config or DAEMON_CONFIG
    truth = truth or simtruth.Truth("exact")
    fn = POLICIES[policy] if isinstance(policy, str) else policy
    ledger = fairshare.Ledger(half_life)
    is_colo = fn is colo
    if is_colo:
        if learned is None and learn:
            learned = pol.Learned()
        if learned is None:
            profiles = None  # a colo that never learns keeps its profiles as stored
        elif profiles is None:
            profiles = {}
        fn = lambda *a: colo(*a, learned=learned, ledger=ledger, grow=grow, profiles=profiles)  # noqa: E731
    else:
        # the baselines learn a job that has no profile from its run as colo may (the same
        # samples, provisional ones included), and nothing else (into `profiles` when given)
        profiles = {} if profiles is None else profiles
        if fn is oracle_bound:
            memo: dict = {}
            fn = lambda *a: oracle_bound(*a, truth=truth, memo=memo)  # noqa: E731
    label = policy if isinstance(policy, str) else (name or getattr(policy, "__name__", "custom"))
    node = [SimGpu(i, gpu_mem, gpu_mem - config.reserve) for i in range(gpus)]
    g_noise = np.random.default_rng([truth.seed, 23])  # NVML's device readings' noise
    runs = [SimRun(j, i, truth.realise(j.id, j.profile), truth)
            for i, j in enumerate(sorted(jobs, key=lambda j: (j.arrival, j.id)))]
    pending = list(runs)
    queue: list[SimRun] = []
    t = 0.0
    oom = 0
    sm_area = mem_area = 0.0
    timeline: list[tuple] = []
    next_tick = 0.0
    replan = True

    def record(g: SimGpu, rate: dict, dt: float) -> None:
        """What NVML shows of each job on `g` over the next dt seconds: memory per process; SM and
        bandwidth per process for ordinary contexts, while MPS clients' are their server's, split
        equally among them (as the daemon apportions them, colo/daemon/learner.py) unless the
        driver attributes them; each reading noisy, averaged over the 1 s samples of the stretch."""
        keep = [r for r in g.runs if sampled(r)]
        if not keep:
            return
        mps = [r for r in g.runs if r.mode == "mps"]
        split = None
        if mps and not truth.nvml_per_client:
            split = (sum(r.sm[r.segment()] * rate[id(r)] for r in mps) / len(mps),
                     sum(r.membw[r.segment()] * rate[id(r)] for r in mps) / len(mps))
        spread = truth.sample_noise / math.sqrt(max(1.0, dt))
        for r in keep:
            s, x = r.segment(), rate[id(r)]
            sm, bw = split if (split is not None and r.mode == "mps") else (r.sm[s] * x, r.membw[s] * x)
            if spread > 0:
                sm, bw = (max(0.0, v * (1.0 + spread * float(r.noise.standard_normal()))) for v in (sm, bw))
            r.trace.append((t - r.start, t + dt - r.start, min(1.0, sm), holds(r), min(1.0, bw)))

    live: dict[int, list] = {}  # per GPU: [since, expected SM area, observed SM area, summed bandwidth]

    def watch(g: SimGpu, rate: dict, dt: float) -> None:
        """colo learns a group while it runs (Learned.observe_live): the GPU's SM activity as NVML
        gives it (its device figure, noisy) against what their profiles and the predictions of
        their starts expect, accumulated here and taught every re-plan tick; with it, the level
        of taking turns their profiles put them at (learning.turns_level), its mean over the
        stretch: what a group with time-sliced jobs shows costs what it showed. Provisional
        profiles count as the pass placed them: a family's first minute is watched too."""
        rs = g.runs
        if not (is_colo and learned is not None) or len(rs) < 2 or any(r.expect is None or r.seen is None for r in rs):
            live.pop(g.index, None)
            return
        acc = live.setdefault(g.index, [t, 0.0, 0.0, 0.0, "mps" if all(r.mode == "mps" for r in rs) else "timesliced", 0.0])
        obs = min(1.0, sum(r.sm[r.segment()] * rate[id(r)] for r in rs))
        spread = truth.sample_noise / math.sqrt(max(1.0, dt))
        if spread > 0:
            obs = max(0.0, obs * (1.0 + spread * float(g_noise.standard_normal())))
        now_sm = [float(r.seen.sm[min(len(r.seen.sm) - 1, int(pol.progress(r.expect, t) / r.seen.step))]) for r in rs]
        exp = min(1.0, sum(x / r.expect["slowdown"] for x, r in zip(now_sm, rs)))
        acc[1] += exp * dt
        acc[2] += obs * dt
        acc[3] = max([acc[3]] + [float(r.expect.get("group_bw") or 0.0) for r in rs])
        acc[5] += pol.turns_level(now_sm, [r.mode == "mps" for r in rs]) * dt  # the level they took turns at

    def teach_live(g: SimGpu, final: bool = False) -> None:
        acc = live.get(g.index)
        if acc is None or t - acc[0] < learning.LIVE_MIN:
            if final:
                live.pop(g.index, None)
            return
        learned.observe_live(acc[4], acc[3], acc[1] / (t - acc[0]), acc[2] / (t - acc[0]), t - acc[0],
                             acc[5] / (t - acc[0]))
        del live[g.index]

    def left_alone(g: SimGpu) -> None:
        if len(g.runs) == 1 and g.runs[0].expect is not None:  # a job's last neighbour has gone
            g.runs[0].expect = pol.left(g.runs[0].expect, t)

    def holds(r: SimRun) -> int:
        """Device memory it holds now: what it allocated and its context."""
        return int(r.alloc[r.segment()]) + truth.context_mem(r.mode == "mps")

    def fail(r: SimRun, why: str, used: int = 0) -> None:
        nonlocal oom, replan
        oom += 1
        r.ooms += 1
        r.ran += t - r.start
        ledger.add(r.job.uid, fairshare.weight(r.budget or 0, 1), r.start, t)
        usable = node[r.gpu].usable
        teach_live(node[r.gpu], final=True)
        node[r.gpu].runs.remove(r)
        left_alone(node[r.gpu])
        r.gpu, replan = None, True
        if learned is not None and used:  # as Learner.grown_budget: its samples' peak, and its budget
            name = r.job.profile.name     # (too small); not what was asked, which no reading shows
            need = max(r.peak, used if r.budget is None else min(used, r.budget))
            learned.max_mem[name] = max(learned.max_mem.get(name, 0), need)
        if grow and used and not r.grown and r.budget is not None and max(r.ask, r.budget) < usable:
            # requeued once, with a larger budget (submitted with --grow)
            r.ask = min(usable, step_up(max(r.ask, r.budget, used) * GROW))
            r.grown, r.tries = True, r.tries - 1  # the grown run is a new attempt, not a retry
            why += f"; requeued with budget {format_size(r.ask)} (--grow)"
        if r.tries >= MAX_TRIES:
            r.state, r.reason, r.end = "lost", why, t
        else:
            r.state, r.p, r.reason = "queued", 0.0, why
            queue.append(r)
            queue.sort(key=lambda x: x.seq)

    def check_memory(g: SimGpu, grown: list[SimRun]) -> None:
        for r in list(grown):  # the interposer refuses an allocation past the budget
            if r.budget is not None and r.alloc[r.segment()] > r.budget:
                fail(r, f"OOM: {format_size(int(r.alloc[r.segment()]))} passes its budget {format_size(r.budget)}",
                     int(r.alloc[r.segment()]))
        # the device: allocations, every context, and the MPS server's while it has clients
        used = sum(holds(r) for r in g.runs) + (truth.mps_server_mem if any(r.mode == "mps" for r in g.runs) else 0)
        for r in [r for r in grown if r in g.runs]:
            if used <= g.capacity:
                break
            used -= holds(r)
            fail(r, f"OOM: GPU{g.index} memory exhausted")

    def sampled(r: SimRun) -> bool:
        """Are its samples kept: colo learns every run it can; the baselines only a job they
        have no profile for."""
        return (is_colo and profiles is not None) or r.seen is None or r.seen.provisional

    speaker: dict[str, int] = {}  # profile name -> the job whose samples made its provisional profile

    def provision(now: float) -> None:
        """A running job placed with no profile (or a provisional one) gets one made from its
        samples so far (profiles.provisional), so that queued jobs can be placed beside it. The
        first running job of a name speaks for it while it runs, as in the daemon (a second one,
        started beside it, samples only its share of the GPU)."""
        running = {r.job.id for g in node for r in g.runs}
        for g in node:
            for r in g.runs:
                elapsed = now - r.start
                if profiles is None or not r.trace or elapsed < max(profs.PROVISIONAL_AFTER, r.provisioned + 30.0) \
                        or elapsed > profs.PROVISIONAL_HOLD or (r.seen is not None and not r.seen.provisional):
                    continue
                got, who = profiles.get(r.job.profile.name), speaker.get(r.job.profile.name)
                if got is not None and (not got.provisional or who != r.job.id and who in running):
                    continue  # an earlier run of it was learned meanwhile, or another speaks for it
                times = [x[0] for x in r.trace]
                made = profs.provisional(r.job.profile.name, {
                    "times": times, "sm": [x[2] for x in r.trace], "mem": [x[3] for x in r.trace],
                    "membw": [x[4] for x in r.trace]}, elapsed=elapsed)
                r.provisioned = elapsed  # (none yet: it has computed nothing) looked at again in half a minute
                if made is not None:
                    profiles[made.name], speaker[made.name] = made, r.job.id

    while True:
        while pending and pending[0].job.arrival <= t + 1e-9:
            r = pending.pop(0)
            r.state = "queued"
            queue.append(r)
            replan = True
        if replan_every is not None and t >= next_tick - 1e-9:
            replan, next_tick = True, t + replan_every
        if replan and queue:
            replan = False  # a start that fails at once (OOM) sets it again: re-plan at this instant
            provision(t)
            for g in node:
                teach_live(g)
            running = [r for g in node for r in g.runs]
            for r in queue + running:
                r.seen = seen_profile(r, profiles)
            for r, gi, mode, budget in fn(t, list(queue), running, node, config):
                queue.remove(r)
                g = node[gi]
                r.state, r.gpu, r.mode, r.budget, r.start, r.p = "running", gi, mode, budget, t, 0.0
                r.tries += 1
                r.seg = 0
                r.neighbours = {o.job.profile.name for o in g.runs}
                r.expect = pol.expectation(r.decision[0], r.decision[1], t) if is_colo else None
                for o in g.runs:
                    o.neighbours.add(r.job.profile.name)
                    if o.expect is not None:
                        o.expect = pol.joined(o.expect, t, r.decision[0], r.decision[1], o.job.id)
                r.peak = holds(r)
                r.trace, r.provisioned = [], 0.0
                teach_live(g, final=True)  # a new group from now on
                g.runs.append(r)
                check_memory(g, [r])
        else:
            replan = False
        running = [r for g in node for r in g.runs]
        if not running and not pending:
            if replan and queue:  # jobs failed as they started: the queue is not stuck, re-plan
                continue
            for r in queue:
                r.state, r.reason, r.end = "lost", "never started: no GPU can take it", t
            break
        # rates of everyone, per GPU
        rate: dict[int, float] = {}
        for g in node:
            if not g.runs:
                continue
            seg = [r.segment() for r in g.runs]
            sm = np.array([r.sm[s] for r, s in zip(g.runs, seg)])
            bw = np.array([r.membw[s] for r, s in zip(g.runs, seg)])
            cb = np.array([r.cache_bound for r in g.runs])
            mps = np.array([r.mode == "mps" for r in g.runs])
            rr = truth.rates(sm, bw, cb, mps, np.array([r.corun for r in g.runs]))[:, 0]
            for r, x in zip(g.runs, rr):
                rate[id(r)] = float(x)
        dt = math.inf
        if pending:
            dt = pending[0].job.arrival - t
        if replan_every is not None and queue:
            dt = min(dt, next_tick - t)
        for r in running:
            dt = min(dt, (r.next_boundary() - r.p) / rate[id(r)])
        dt = max(dt, 0.0)
        if dt > 0:
            for g in node:
                record(g, rate, dt)
                watch(g, rate, dt)
        for g in node:
            if g.runs:
                use = min(1.0, sum(r.sm[r.segment()] * rate[id(r)] for r in g.runs))
                memu = sum(int(r.mem[r.segment()]) for r in g.runs) / g.capacity
                sm_area += use * dt
                mem_area += min(1.0, memu) * dt
                if dt > 0:
                    timeline.append((t, t + dt, g.index, use, len(g.runs)))
        t += dt
        for g in node:
            grown = []
            for r in list(g.runs):
                before = r.segment()
                r.p = min(r.runtime, r.p + rate[id(r)] * dt)
                if r.p >= r.runtime - 1e-6:
                    teach_live(g, final=True)
                    g.runs.remove(r)
                    r.state, r.end, r.gpu, replan = "done", t, None, True
                    r.ran += t - r.start
                    left_alone(g)
                    ledger.add(r.job.uid, fairshare.weight(r.budget or 0, 1), r.start, t)
                    seen = seen_profile(r, profiles)  # as the daemon's learn(): observe, then the profile
                    if seen is not None and seen.provisional:
                        seen = None  # its run time was a guess: nothing to compare with
                    if learned is not None and seen is not None and is_colo:
                        learning.end_of_job(learned, r.job.profile.name, r.neighbours, r.mode,
                                            {"action": pol.START, "mode": r.mode,
                                             "details": dict(r.decision[0], expect=r.expect)},
                                            r.start, t, seen.runtime, r.peak)
                    if profiles is not None and (is_colo or seen is None):
                        learn_profile(profiles, r, seen, t - r.start, learned)
                elif r.segment() != before and r.alloc[r.segment()] > r.alloc[before]:
                    grown.append(r)
            if grown:
                check_memory(g, grown)
                for r in grown:  # an allocation refused never shows in its samples
                    if r in g.runs:
                        r.peak = max(r.peak, holds(r))
    res = result_of(label, runs, t, sm_area, mem_area, oom, gpus, timeline, config.slowdown_bound)
    res.seed, res.truth = truth.seed if truth.kind != "exact" else None, truth.kind
    return res


def learn_profile(profiles: dict[str, Profile], r: SimRun, seen: Profile | None, wall: float,
                  learned: pol.Learned | None = None) -> None:
    """At a job's end, what the daemon's learn() does (colo/daemon/learner.py): the series a
    sampler saw of this run become one run merged into the profile it ran under (profiles.merge),
    when the run shared its GPU with nobody; a job that had no profile learns its first from its
    run even when shared (there is nothing cleaner to keep). The samples are what NVML gave
    (record(): noisy, an MPS client's SM its server's split among its clients): SM and bandwidth
    at the realised levels times the job's progress rate (its share of its alone speed: 1 when
    uncontended), memory as used; its run time is its wall time (its real alone time when
    uncontended). What runs showed of its real alone time is kept against the merged profile's
    (Learned.rebase); a first profile made from a run alone is its alone time (Learned.checked)."""
    if r.neighbours and seen is not None:
        return  # a shared run's wall time is not its alone time
    if not r.trace:
        return
    n = len(r.sm)
    step = wall / n
    sm, bw, mem, cover = np.zeros(n), np.zeros(n), np.zeros(n, dtype=np.int64), np.zeros(n)
    for t0, t1, s, m, b in r.trace:  # time-weighted means per point (peak memory), on the run's own grid
        for i in range(max(0, int(t0 / step + 1e-9)), min(n, int(math.ceil(t1 / step - 1e-9)))):
            w = min(t1, (i + 1) * step) - max(t0, i * step)
            if w > 0:
                sm[i] += s * w
                bw[i] += b * w
                cover[i] += w
                mem[i] = max(mem[i], m)
    sm, bw = sm / np.maximum(cover, 1e-12), bw / np.maximum(cover, 1e-12)
    new = Profile(name=r.job.profile.name, step=step, sm=sm, mem=mem, membw=bw, runtime=wall,
                  cache_bound=bool(bw.mean() >= profs.CACHE_BOUND_MEMBW), runs=1)
    profiles[new.name] = profs.merge(seen, new) if seen is not None else new
    if learned is not None:
        learning.profile_learned(learned, new.name, None if seen is None else seen.runtime,
                                 profiles[new.name].runtime, bool(r.neighbours))


POLICIES: dict[str, PolicyFn] = {"exclusive-fifo": exclusive_fifo, "exclusive-sjf": exclusive_sjf,
                                 "tetris": tetris, "max-pack": max_pack, "mean-pack": mean_pack, "naive": naive,
                                 "colo": colo, "mps-all": mps_all, "oracle-bound": oracle_bound}
REFERENCES = ("mps-all", "oracle-bound")  # calibration only: never a baseline (oracle-bound reads the truth)
DEFAULT_POLICIES = ["exclusive-fifo", "exclusive-sjf", "tetris", "max-pack", "mean-pack", "naive", "colo"]


def compare(jobs: Sequence[SimJob], policies: Sequence[str] = DEFAULT_POLICIES, gpus: int = 1,
            gpu_mem: int = DEFAULT_GPU_MEM, config: pol.PolicyConfig | None = None,
            truth: simtruth.Truth | None = None, grow: bool = False) -> list[Result]:
    """Each policy on the same jobs and the same truth; `ratio` against exclusive SJF run alongside
    (run for the ratio even when not asked for). A result with lost jobs has no ratio: it failed."""
    for p in policies:
        if p not in POLICIES:
            raise SimError(f"unknown policy {p!r}: one of {', '.join(POLICIES)}")
    out = [simulate(jobs, p, gpus, gpu_mem, config, truth=truth, grow=grow) for p in policies]
    sjf = next((r for r in out if r.policy == "exclusive-sjf"), None)
    if sjf is None:
        sjf = simulate(jobs, "exclusive-sjf", gpus, gpu_mem, config, truth=truth)
    for r in out:
        r.ratio = None if (r.failed or sjf.failed or not sjf.makespan) else r.makespan / sjf.makespan
    return out
