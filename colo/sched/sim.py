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
--grow`): GROW_FACTOR x the budget, at least GROW_FACTOR x the refused use, at most the GPU's.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .. import profiles as profs
from ..config import Config
from ..profiles import Profile, ProfileStore, shipped_dir
from ..units import format_size, parse_size
from . import fairshare, learning
from . import policy as pol
from . import truth as simtruth

GiB = 1024**3
MiB = 1024**2
MAX_TRIES = 3
REPLAN_EVERY = 10.0  # seconds: the daemon re-plans on events and on a periodic tick
LIVE_MIN = 20.0  # seconds of a running group's samples from which colo learns from them
WORKLOAD_FORMAT = "colo-workload"
WORKLOAD_VERSION = 1
DEFAULT_GPU_MEM = 12 * GiB  # the study's TITAN Xp
GROW_FACTOR = 1.25
FAIR_HALF_LIFE = Config.fair_share_half_life  # the daemon's default
# colo places as a daemon with the default configuration does (a profile never seen alone here is
# run alone once only where Config.check_alone is on: Placed.alone is passed as the daemon does)
DAEMON_CONFIG = pol.config_of(Config())


class SimError(ValueError):
    pass


@dataclass
class SimJob:
    id: int
    profile: Profile  # its stored profile: what policies see (the Truth realises what it really does)
    arrival: float = 0.0
    budget: int | None = None  # bytes; None: colo budgets the profile's peak
    uid: int = 0
    priority: int = 0
    known: bool = True  # colo's policy sees the profile (False: a first run, unprofiled)
    name: str = ""


@dataclass
class Workload:
    name: str
    jobs: list[SimJob]
    gpu_mem: int = DEFAULT_GPU_MEM
    seed: int | None = None


# ---- workload files -------------------------------------------------------------------------

def budget_for(p: Profile) -> int:
    """Peak use plus 5 %, rounded up to 256 MiB: the budget a careful user would ask for."""
    q = 256 * MiB
    return int(math.ceil(p.peak_mem * 1.05 / q) * q) or q


def dumps_workload(w: Workload) -> str:
    lines = [f"{WORKLOAD_FORMAT} {WORKLOAD_VERSION}", f"name {w.name}", f"gpu_mem {w.gpu_mem // MiB}MiB"]
    if w.seed is not None:
        lines.append(f"seed {w.seed}")
    lines.append("# job ARRIVAL_S PROFILE BUDGET [uid=N] [priority=N] [known=no]")
    for j in w.jobs:
        extra = "".join([f" uid={j.uid}" if j.uid else "", f" priority={j.priority}" if j.priority else "",
                         "" if j.known else " known=no"])
        b = "-" if j.budget is None else f"{j.budget // MiB}MiB"
        lines.append(f"job {j.arrival:g} {j.profile.name} {b}{extra}")
    return "\n".join(lines) + "\n"


def loads_workload(text: str, store: ProfileStore, origin: str = "<workload>") -> Workload:
    name, gpu_mem, seed, jobs, seen = Path(origin).stem, DEFAULT_GPU_MEM, None, [], False
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        where = f"{origin}:{n}"
        if not seen:
            if parts[:1] != [WORKLOAD_FORMAT] or len(parts) != 2 or not parts[1].isdigit():
                raise SimError(f"{where}: not a workload (first line must be '{WORKLOAD_FORMAT} {WORKLOAD_VERSION}')")
            if int(parts[1]) > WORKLOAD_VERSION:
                raise SimError(f"{where}: workload format {parts[1]} is newer than this colo reads")
            seen = True
            continue
        try:
            if parts[0] == "name":
                name = parts[1]
            elif parts[0] == "gpu_mem":
                gpu_mem = parse_size(parts[1])
            elif parts[0] == "seed":
                seed = int(parts[1])
            elif parts[0] == "job":
                if len(parts) < 4:
                    raise SimError(f"{where}: use 'job ARRIVAL PROFILE BUDGET [key=value ...]'")
                prof = store.get(parts[2])
                if prof is None:
                    raise SimError(f"{where}: no profile named {parts[2]!r}")
                opts = dict(kv.split("=", 1) for kv in parts[4:])
                jobs.append(SimJob(id=len(jobs) + 1, profile=prof, arrival=float(parts[1]),
                                   budget=None if parts[3] == "-" else parse_size(parts[3]),
                                   uid=int(opts.get("uid", 0)), priority=int(opts.get("priority", 0)),
                                   known=opts.get("known", "yes") != "no", name=parts[2]))
            else:
                raise SimError(f"{where}: unknown line {parts[0]!r}")
        except (ValueError, IndexError) as e:
            if isinstance(e, SimError):
                raise
            raise SimError(f"{where}: {e}") from None
    if not seen:
        raise SimError(f"{origin}: empty workload")
    return Workload(name, jobs, gpu_mem, seed)


def workloads_dir() -> Path:
    pkg = Path(__file__).resolve().parent.parent  # the colo package (this is colo/sched/)
    packaged = pkg / "data" / "workloads"  # a wheel's copy (setup.py)
    return packaged if packaged.is_dir() else pkg.parent / "workloads"


MIXES = ("heavy", "light", "memory-heavy", "memory-light", "random", "fits")


def load_workload(name_or_path: str, store: ProfileStore | None = None) -> Workload:
    """A path, or the name of a shipped mix (heavy, light, memory-heavy, memory-light, random, fits)."""
    store = store or ProfileStore([shipped_dir()])
    p = Path(name_or_path)
    if not p.is_file():
        shipped = workloads_dir() / f"{name_or_path}.workload"
        if re.fullmatch(r"[A-Za-z0-9_-]+", name_or_path) and shipped.is_file():
            p = shipped
        else:
            raise SimError(f"no workload file {name_or_path!r} (shipped mixes: {', '.join(MIXES)})")
    return loads_workload(p.read_text(), store, str(p))


# The classes of docs/invariants.md "Figures from the studies".
CLASSES = {
    "heavy": ["vgg11", "vgg16", "resnet50", "resnet101", "resnet152", "qmcpack", "hoomd", "lammps"],
    "light": ["alexnet", "gromacs"],
    "memory-heavy": ["vgg11", "vgg16", "resnet50", "resnet101", "resnet152"],
    "memory-light": ["alexnet", "googlenet", "qmcpack", "hoomd", "gromacs"],
    "random": ["vgg11", "vgg16", "resnet50", "resnet101", "resnet152", "alexnet", "googlenet",
               "lammps", "qmcpack", "hoomd", "gromacs"],
    # not the study's: a queue whose memory all fits (12 memory-light jobs on an 80 GiB GPU), where
    # plain sharing (naive) loses no job, as the H200's 6 light jobs (docs/gpu.md)
    "fits": ["alexnet", "googlenet", "qmcpack", "hoomd", "gromacs"],
}
SIZES = {"fits": (12, 80 * GiB)}  # (jobs, GPU memory) where a class is not 30 jobs on DEFAULT_GPU_MEM


def make_mix(kind: str, seed: int, store: ProfileStore | None = None, n: int | None = None) -> Workload:
    """n jobs drawn at random from a class, all arriving at once (as in the study)."""
    store = store or ProfileStore([shipped_dir()])
    if kind not in CLASSES:
        raise SimError(f"unknown mix {kind!r}: one of {', '.join(CLASSES)}")
    size, gpu_mem = SIZES.get(kind, (30, DEFAULT_GPU_MEM))
    n = n or size
    rng = np.random.default_rng(seed)
    names = [CLASSES[kind][i] for i in rng.integers(0, len(CLASSES[kind]), n)]
    jobs = []
    for i, nm in enumerate(names, 1):
        p = store.get(nm)
        if p is None:
            raise SimError(f"mix {kind}: profile {nm!r} missing")
        jobs.append(SimJob(i, p, 0.0, budget_for(p), name=nm))
    return Workload(kind, jobs, gpu_mem, seed)


def jobs_from_history(rows: list[dict], store: ProfileStore | None = None) -> list[SimJob]:
    """SimJobs from the daemon's job rows (colo.jobs.Job.to_dict()). A job's profile is the one it
    ran under when the store has it (its run time alone); else a flat profile made from its budget
    and measured run time (SM unknown: 0.5). Jobs that never started or need no GPU are skipped."""
    store = store or ProfileStore([shipped_dir()])
    ran = [r for r in rows if r.get("started_at") is not None and r.get("ended_at") is not None
           and (r.get("spec") or {}).get("gpus", 1) > 0]
    if not ran:
        return []
    t0 = min(float(r.get("submitted_at") or r["started_at"]) for r in ran)
    out = []
    for i, r in enumerate(sorted(ran, key=lambda r: (r.get("submitted_at") or 0, r.get("id", 0))), 1):
        spec = r.get("spec") or {}
        name = spec.get("profile")
        prof = store.get(name) if name else None
        budget = int(spec.get("gpu_mem") or 0) or None
        known = prof is not None
        if prof is None:
            runtime = max(1.0, float(r["ended_at"]) - float(r["started_at"]))
            step = max(1.0, runtime / 500)
            npts = max(1, math.ceil(runtime / step))
            mem = int(budget * 0.8) if budget else 1 * GiB
            prof = Profile(name=name or f"job{r.get('id', i)}", step=step, runtime=runtime, sm=np.full(npts, 0.5),
                           mem=np.full(npts, mem, dtype=np.int64), membw=np.full(npts, 0.3))
        out.append(SimJob(id=int(r.get("id", i)), profile=prof,
                          arrival=float(r.get("submitted_at") or r["started_at"]) - t0, budget=budget,
                          uid=int(r.get("uid", 0)), priority=int(spec.get("priority", 0)), known=known,
                          name=prof.name))
    return out


# ---- the simulated node ---------------------------------------------------------------------

class _Run:
    """One job in the simulation (and its current attempt)."""

    def __init__(self, job: SimJob, seq: int, real: simtruth.Real, truth: simtruth.Truth):
        self.job, self.seq = job, seq
        self.held: tuple[int, ...] = ()  # GPUs colo's policy held for it in its last pass
        self.sm, self.mem, self.membw = real.sm, real.mem, real.membw  # the truth, never shown to policies
        # what it allocates (the interposer's count): its use as sampled alone, less the ordinary
        # context every stored profile holds; its context is counted by the mode it runs in
        self.alloc = np.maximum(0, real.mem - truth.ctx_mem)
        self.seen: Profile | None = None  # the profile the policy places it with now
        self.ran = 0.0  # wall seconds of all its attempts: what its slowdown counts
        self.noise = np.random.default_rng([truth.seed, job.id, 17])  # its NVML readings' noise
        self.provisioned = 0.0  # how much of this attempt a provisional profile was made from
        self.step, self.runtime, self.n = real.step, real.runtime, len(real.sm)
        self.cache_bound, self.corun = real.cache_bound, real.corun
        self.ask = job.budget or budget_for(job.profile)  # the budget colo places it with
        self.grown = False
        self.decision: tuple = ({}, "")  # colo's start decision (details, mode), as the daemon stores it
        self.expect: dict | None = None  # what colo predicted for it (policy.expectation), folded at joins
        self.neighbours: set[str] = set()  # profiles of the jobs that shared its GPU during this attempt
        self.peak = 0  # the most memory it used (bytes), as the daemon's samples would show
        self.trace: list[tuple] = []  # (t0, t1, SM, memory, bandwidth) from its start: what NVML shows
        self.p = 0.0  # progress in seconds of alone work
        self.state = "pending"
        self.gpu: int | None = None
        self.mode = ""
        self.budget: int | None = None  # enforced budget of this attempt (None: no budget)
        self.start = self.end = None
        self.tries = 0
        self.ooms = 0
        self.seg = 0
        self.reason = ""

    def segment(self) -> int:
        return min(int(self.p / self.step + 1e-9), self.n - 1)

    def next_boundary(self) -> float:
        return min(self.runtime, (self.segment() + 1) * self.step)


@dataclass
class SimGpu:
    index: int
    capacity: int
    usable: int
    runs: list = field(default_factory=list)


Start = tuple  # (run, gpu index, mode, enforced budget or None)
PolicyFn = Callable[[float, list, list, list, pol.PolicyConfig], list]


@dataclass
class Result:
    policy: str
    makespan: float
    mean_jct: float
    p95_jct: float
    p95_slowdown: float
    sm_util: float
    mem_util: float
    oom: int  # OOM failures (each attempt counted)
    lost: int  # jobs that never completed
    unslowed: int  # jobs that ran with no slowdown (< 1 %)
    max_slowdown: float = 1.0
    over_bound: int = 0  # completed jobs slowed past the slowdown bound (config.slowdown_bound)
    completed: int = 0
    ratio: float | None = None  # makespan / exclusive SJF's in the same run; None: a failure (lost jobs)
    seed: int | None = None
    truth: str = "exact"
    jobs: list[dict] = field(default_factory=list)
    timeline: list[tuple] = field(default_factory=list)  # (t0, t1, gpu, sm use, jobs running)

    def summary(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("policy", "truth", "seed", "makespan", "ratio", "mean_jct", "p95_jct",
                                              "p95_slowdown", "max_slowdown", "sm_util", "mem_util", "oom",
                                              "lost", "unslowed", "over_bound", "completed")}

    @property
    def failed(self) -> bool:
        return self.lost > 0


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
    runs = [_Run(j, i, truth.realise(j.id, j.profile), truth)
            for i, j in enumerate(sorted(jobs, key=lambda j: (j.arrival, j.id)))]
    pending = list(runs)
    queue: list[_Run] = []
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
        stretch: what a group with time-sliced jobs shows costs what it showed."""
        rs = g.runs
        if not (is_colo and learned is not None) or len(rs) < 2 or any(
                r.expect is None or r.seen is None or r.seen.provisional for r in rs):
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
        if acc is None or t - acc[0] < LIVE_MIN:
            if final:
                live.pop(g.index, None)
            return
        learned.observe_live(acc[4], acc[3], acc[1] / (t - acc[0]), acc[2] / (t - acc[0]), t - acc[0],
                             acc[5] / (t - acc[0]))
        del live[g.index]

    def left_alone(g: SimGpu) -> None:
        if len(g.runs) == 1 and g.runs[0].expect is not None:  # a job's last neighbour has gone
            g.runs[0].expect = pol.left(g.runs[0].expect, t)

    def holds(r: _Run) -> int:
        """Device memory it holds now: what it allocated and its context."""
        return int(r.alloc[r.segment()]) + truth.context_mem(r.mode == "mps")

    def fail(r: _Run, why: str, used: int = 0) -> None:
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
        if learned is not None and used and r.job.known:  # the refused allocation shows what it needs
            name = r.job.profile.name
            learned.max_mem[name] = max(learned.max_mem.get(name, 0), used)
        if grow and used and not r.grown and r.budget is not None and max(r.ask, r.budget) < usable:
            q = 256 * MiB  # requeued once, with a larger budget (submitted with --grow)
            r.ask = min(usable, int(math.ceil(max(r.ask, r.budget, used) * GROW_FACTOR / q) * q))
            r.grown, r.tries = True, r.tries - 1  # the grown run is a new attempt, not a retry
            why += f"; requeued with budget {format_size(r.ask)} (--grow)"
        if r.tries >= MAX_TRIES:
            r.state, r.reason, r.end = "lost", why, t
        else:
            r.state, r.p, r.reason = "queued", 0.0, why
            queue.append(r)
            queue.sort(key=lambda x: x.seq)

    def check_memory(g: SimGpu, grown: list[_Run]) -> None:
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

    def sampled(r: _Run) -> bool:
        """Are its samples kept: colo learns every run it can; the baselines only a job they
        have no profile for."""
        return (is_colo and profiles is not None) or r.seen is None or r.seen.provisional

    def provision(now: float) -> None:
        """A running job placed with no profile (or a provisional one) gets one made from its
        samples so far (profiles.provisional), so that queued jobs can be placed beside it."""
        for g in node:
            for r in g.runs:
                elapsed = now - r.start
                if profiles is None or not r.trace or elapsed < max(profs.PROVISIONAL_AFTER, r.provisioned + 30.0) \
                        or elapsed > profs.PROVISIONAL_HOLD or (r.seen is not None and not r.seen.provisional):
                    continue
                got = profiles.get(r.job.profile.name)
                if got is not None and not got.provisional:
                    continue  # an earlier run of it was learned meanwhile
                times = [x[0] for x in r.trace]
                made = profs.provisional(r.job.profile.name, {
                    "times": times, "sm": [x[2] for x in r.trace], "mem": [x[3] for x in r.trace],
                    "membw": [x[4] for x in r.trace]}, elapsed=elapsed)
                if made is not None:
                    profiles[made.name] = made
                    r.provisioned = elapsed

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
                    r.peak = max(r.peak, holds(r))
            if grown:
                check_memory(g, grown)
    res = _result(label, runs, t, sm_area, mem_area, oom, gpus, timeline, config.slowdown_bound)
    res.seed, res.truth = truth.seed if truth.kind != "exact" else None, truth.kind
    return res


def seen_profile(r: _Run, profiles: dict[str, Profile] | None) -> Profile | None:
    """The profile a policy places a run with: what it learned of that application (profiles),
    else the stored one; None for a job without one (known=no) until a run of it was sampled."""
    got = profiles.get(r.job.profile.name) if profiles else None
    return got if got is not None else (r.job.profile if r.job.known else None)


def learn_profile(profiles: dict[str, Profile], r: _Run, seen: Profile | None, wall: float,
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


def _result(label, runs, t_end, sm_area, mem_area, oom, gpus, timeline, bound: float = 1.5) -> Result:
    done = [r for r in runs if r.state == "done"]
    makespan = max((r.end for r in runs if r.end is not None), default=0.0)  # lost jobs end too
    jct = np.array([r.end - r.job.arrival for r in done]) if done else np.zeros(1)
    slow = np.array([r.ran / r.runtime for r in done]) if done else np.ones(1)  # every attempt counts
    span = max(t_end, 1e-9) * gpus
    jobs = [{"id": r.job.id, "profile": r.job.profile.name, "state": r.state, "arrival": r.job.arrival,
             "start": r.start, "end": r.end, "mode": r.mode, "gpu": r.gpu, "tries": r.tries,
             "ooms": r.ooms, "reason": r.reason, "budget": r.budget, "alone": r.runtime, "ran": r.ran} for r in runs]
    return Result(label, float(makespan), float(jct.mean()), float(np.percentile(jct, 95)),
                  float(np.percentile(slow, 95)), sm_area / span, mem_area / span, oom,
                  sum(r.state == "lost" for r in runs), int((slow < 1.01).sum()) if done else 0,
                  max_slowdown=float(slow.max()), over_bound=int((slow > bound + 1e-6).sum()) if done else 0,
                  completed=len(done), jobs=jobs, timeline=timeline)


# ---- policies ---------------------------------------------------------------------------------

def colo(now, queue, running, node, cfg, learned: pol.Learned | None = None,
         ledger: fairshare.Ledger | None = None, grow: bool = False, profiles: dict | None = None):
    """colo's own policy: policy.plan(), unchanged, fed as the daemon's scheduler feeds it: the
    queue in fair-share order (Candidate.seq, priority within each user's own queue), what was
    learned (co-run slowdowns, and the profiles learned so far); budgets enforced (the interposer)."""
    views = [pol.GpuView(f"sim-gpu{g.index}", g.index, g.usable, mps="active") for g in node]
    placed = [pol.Placed(r.job.id, (f"sim-gpu{r.gpu}",), r.budget or 0, r.job.uid, r.mode,
                         seen_profile(r, profiles), now - r.start,
                         None if r.expect is None else pol.progress(r.expect, now),
                         bool(r.decision[0].get("check_alone"))) for r in running]
    by_id = {r.job.id: r for r in queue}
    usage = (ledger or fairshare.Ledger(FAIR_HALF_LIFE)).usage(
        now, [(r.job.uid, fairshare.weight(r.budget or 0, 1), r.start) for r in running])
    fair = fairshare.fair_order([(r.job.id, r.job.uid, r.job.priority, r.seq) for r in queue], usage)
    cands = []
    for seq, job_id in enumerate(fair):
        r = by_id[job_id]
        seen = seen_profile(r, profiles)
        if grow and learned is not None and seen is not None:  # --grow: start with what earlier runs needed
            got = learned.suggest_budget(r.job.profile.name)
            if got and got > r.ask:
                r.ask = min(got, max(g.usable for g in node))
        cands.append(pol.Candidate(r.job.id, r.ask, 1, r.job.uid, 0, seq, seen, r.job.arrival, r.held, grow))
    out = []
    for d in pol.plan(cands, views, placed, cfg, now=now, learned=learned):
        by_id[d.job_id].held = tuple(d.details.get("held", ()))  # as the daemon keeps its last decision
        if d.action == pol.START:
            r = by_id[d.job_id]
            r.decision = (d.details, d.mode)
            out.append((r, int(d.gpus[0].removeprefix("sim-gpu")), d.mode, int(d.details.get("budget", r.ask))))
    return out


def _exclusive(key):
    def fn(now, queue, running, node, cfg):
        idle = [g for g in node if not g.runs]
        q = sorted(queue, key=key)
        return [(r, g.index, "timesliced", None) for g, r in zip(idle, q)]
    return fn


exclusive_fifo = _exclusive(lambda r: r.seq)
# SJF by the stored run time (the real one is unknown until the job ends); unprofiled jobs last
exclusive_sjf = _exclusive(lambda r: (r.seen.runtime if r.seen is not None and not r.seen.provisional else math.inf,
                                      r.seq))


def _pack(sm_of, mem_of, tetris: bool):
    """Co-locate under MPS while the summed SM (per job: sm_of) stays <= 1 and the summed memory
    (mem_of) within capacity. No budgets: a job may grow past what it was packed by."""
    def fn(now, queue, running, node, cfg):
        load = {g.index: [sum(sm_of(r) for r in g.runs), sum(mem_of(r) for r in g.runs)] for g in node}
        out, q = [], sorted(queue, key=lambda r: r.seq)
        for g in node:
            while q:
                free_sm, free_mem = 1.0 - load[g.index][0], g.capacity - load[g.index][1]
                fits = [r for r in q if (sm_of(r) <= free_sm + 1e-9 or not (g.runs or load[g.index][1]))
                        and mem_of(r) <= free_mem]
                if not fits:
                    break
                # Tetris: the best-aligned job (demand . free); else first fit in arrival order
                r = max(fits, key=lambda r: sm_of(r) * free_sm + mem_of(r) / g.capacity * free_mem / g.capacity) if tetris else fits[0]
                q.remove(r)
                load[g.index][0] += sm_of(r)
                load[g.index][1] += mem_of(r)
                out.append((r, g.index, "mps", None))
        return out
    return fn


# Baselines pack by the profile they have (stored, or learned from a job's run as colo learns it);
# a job without one counts as a full GPU's SM and its budget.
def _stored(attr: str, unknown: Callable[[_Run], float]) -> Callable[[_Run], float]:
    return lambda r: getattr(r.seen, attr) if r.seen is not None else unknown(r)


tetris = _pack(_stored("peak_sm", lambda r: 1.0), _stored("peak_mem", lambda r: r.ask), True)
max_pack = _pack(_stored("peak_sm", lambda r: 1.0), _stored("peak_mem", lambda r: r.ask), False)
mean_pack = _pack(_stored("mean_sm", lambda r: 1.0), _stored("mean_mem", lambda r: r.ask), False)


def naive(now, queue, running, node, cfg):
    """Time-slicing replicas: everything starts at once, no budgets."""
    counts = {g.index: len(g.runs) for g in node}
    out = []
    for r in sorted(queue, key=lambda r: r.seq):
        gi = min(counts, key=lambda i: (counts[i], i))
        counts[gi] += 1
        out.append((r, gi, "timesliced", None))
    return out


def mps_all(now, queue, running, node, cfg):
    """Everything at once under MPS, with budgets; for calibration, not a contender."""
    return [(r, i % len(node), "mps", r.job.budget) for i, r in enumerate(sorted(queue, key=lambda r: r.seq))]


def forecast(truth: simtruth.Truth, members: Sequence[tuple], now: float, capacity: int,
             memo: dict | None = None, deadlines: np.ndarray | None = None) -> np.ndarray | None:
    """When each of `members` ((run, progress, mode) on one GPU, from now, nobody else starting)
    really ends under the truth's own physics, stepping as simulate() does; None when their real
    memory passes `capacity` at some instant on the way. The last one left runs alone (rate 1).
    memo: the truth's rates per (run, point, mode) set, kept by the caller across calls (the same
    sets come back at every re-plan). deadlines: None as soon as one of them must end after its
    own (no job runs faster than alone), which spares following a set that cannot pass."""
    memo = {} if memo is None else memo
    k = len(members)
    p = np.array([m[1] for m in members], dtype=float)
    runs = [m[0] for m in members]
    rt = np.array([r.runtime for r in runs])
    step = np.array([r.step for r in runs])
    npts = np.array([r.n for r in runs])
    cb = np.array([r.cache_bound for r in runs])
    mps = np.array([m[2] == "mps" for m in members])
    corun = np.array([r.corun for r in runs])
    end = np.full(k, np.nan)
    alive = np.array([x < y - 1e-6 for x, y in zip(p, rt)])
    end[~alive] = now
    t = now
    while alive.sum() >= 2:
        idx = np.flatnonzero(alive)
        if deadlines is not None and (t + rt[idx] - p[idx] > deadlines[idx] + 1e-6).any():
            return None
        seg = np.minimum((p[idx] / step[idx] + 1e-9).astype(int), npts[idx] - 1)
        if sum(int(runs[i].mem[s]) for i, s in zip(idx, seg)) > capacity:
            return None
        key = tuple((runs[i].seq, int(s), bool(mps[i])) for i, s in zip(idx, seg))
        rate = memo.get(key)
        if rate is None:
            sm = np.array([runs[i].sm[s] for i, s in zip(idx, seg)])
            bw = np.array([runs[i].membw[s] for i, s in zip(idx, seg)])
            rate = memo[key] = truth.rates(sm, bw, cb[idx], mps[idx], corun[idx])[:, 0]
        bound = np.minimum(rt[idx], (seg + 1) * step[idx])
        dt = max(0.0, float(np.min((bound - p[idx]) / rate)))
        p[idx] = np.minimum(rt[idx], p[idx] + rate * dt)
        t += dt
        done = idx[p[idx] >= rt[idx] - 1e-6]
        end[done] = t
        alive[done] = False
    for i in np.flatnonzero(alive):  # alone: every truth runs a job alone at its alone speed
        end[i] = t + rt[i] - p[i]
    if deadlines is not None and (end > deadlines + 1e-6).any():
        return None
    return end


def _realisation(r: _Run) -> tuple:
    key = r.__dict__.get("_realisation")
    if key is None:
        key = r.__dict__["_realisation"] = (r.runtime, r.step, r.cache_bound, r.corun, r.sm.tobytes(),
                                             r.membw.tobytes(), r.mem.tobytes())
    return key


def oracle_bound(now, queue, running, node, cfg, truth: simtruth.Truth, memo: dict | None = None):
    """A reference, not a policy (it reads the truth; calibration only, never a baseline): the
    makespan a packer reaches while keeping every job within `slowdown_bound`, to tell whether an
    aim is reachable at all with the bound kept. Shortest *real* run time first; on each GPU, a
    job starts beside those there when, by the truth's own physics from where each of them is
    now (forecast()), their real memory fits the GPU at every instant, every one of them (the
    newcomer included) ends within the bound of its real alone time counted from its own start
    (so no later start can push an earlier job past it: a start re-checks everyone's whole run),
    and the GPU drains no later than if the newcomer waited for the others to end; under MPS or
    time-sliced, whichever drains sooner. No budgets (it knows what each job uses). Greedy, so
    its makespan is what keeping the bound certainly allows, not the best that could."""
    bound = cfg.slowdown_bound
    out = []
    q = sorted(queue, key=lambda r: (r.runtime, r.seq))
    for g in node:
        here = [(r, r.p, r.mode) for r in g.runs]
        starts = [r.start for r in g.runs]
        drain = None
        tried = set()
        for r in list(q):
            if int(r.mem.max()) > g.capacity:
                continue  # never fits: stays queued (lost at the end, as under any policy)
            same = _realisation(r)  # a job identical to one refused here in this pass is refused too
            if same in tried:
                continue
            if not here:
                choice = "mps"
            else:
                if drain is None:  # when those already here end, nobody else starting
                    ends = forecast(truth, here, now, g.capacity, memo)
                    drain = float(ends.max()) if ends is not None else now
                drain_after = drain + r.runtime
                choice, best = None, math.inf
                # each job within the bound from its own start, and nobody past the drain of waiting
                deadlines = np.minimum(np.array(starts + [now]) + bound * np.array([m[0].runtime for m in here] + [r.runtime]),
                                       drain_after)
                for mode in ("mps", "timesliced"):
                    e = forecast(truth, here + [(r, 0.0, mode)], now, g.capacity, memo, deadlines)
                    if e is not None and e.max() < best:
                        choice, best = mode, float(e.max())
                if choice is None:
                    tried.add(same)
                    continue
            here.append((r, 0.0, choice))
            starts.append(now)
            drain, tried = None, set()
            q.remove(r)
            out.append((r, g.index, choice, None))
    return out


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


# ---- output -------------------------------------------------------------------------------------

def table(results: Sequence[Result]) -> str:
    head = (f"{'policy':15s} {'makespan':>9s} {'vs SJF':>7s} {'mean JCT':>9s} {'p95 JCT':>8s} {'p95 slow':>8s} "
            f"{'max slow':>8s} {'SM util':>7s} {'mem util':>8s} {'OOM':>4s} {'lost':>4s}")
    lines = [head]
    for r in results:
        if r.failed:  # lost jobs end early: a short makespan there is no achievement
            span, rel = f"{'FAILED':>9s}", f"{'-':>7s}"
        else:
            span, rel = f"{r.makespan:8.0f}s", f"{r.ratio:7.3f}" if r.ratio is not None else f"{'-':>7s}"
        lines.append(f"{r.policy:15s} {span} {rel} {r.mean_jct:8.0f}s {r.p95_jct:7.0f}s "
                     f"{r.p95_slowdown:7.2f}x {r.max_slowdown:7.2f}x {r.sm_util * 100:6.0f}% {r.mem_util * 100:7.0f}% "
                     f"{r.oom:4d} {r.lost:4d}")
    if any(r.failed for r in results):
        lines.append("FAILED: jobs were lost (OOM more than MAX_TRIES times, or never fit); JCT and slowdown cover the rest")
    if any(r.policy == "oracle-bound" for r in results):
        lines.append("oracle-bound reads the truth (what jobs really do): a reference for what keeping the slowdown bound "
                     "allows, not a baseline")
    return "\n".join(lines)


def seeds_table(per_seed: Sequence[Sequence[Result]]) -> str:
    """Per policy over seeds: median and worst ratio to SJF, failed seeds, worst p95 and max slowdown."""
    lines = [f"{'policy':15s} {'median vs SJF':>13s} {'worst':>7s} {'failed':>7s} {'OOM':>5s} {'p95 slow':>8s} {'max slow':>8s}"]
    for i, r0 in enumerate(per_seed[0]):
        rs = [rs[i] for rs in per_seed]
        ok = [r.ratio for r in rs if r.ratio is not None]
        med = f"{float(np.median(ok)):13.3f}" if ok else f"{'-':>13s}"
        worst = f"{max(ok):7.3f}" if ok else f"{'-':>7s}"
        lines.append(f"{r0.policy:15s} {med} {worst} {sum(r.failed for r in rs):4d}/{len(rs):<2d} "
                     f"{sum(r.oom for r in rs):5d} {max(r.p95_slowdown for r in rs):7.2f}x "
                     f"{max(r.max_slowdown for r in rs):7.2f}x")
    return "\n".join(lines)


_SHADES = " .:-=+*#%@"


def plot(result: Result, gpus: int, width: int = 72) -> str:
    """Text occupancy: per GPU, mean SM use over time (shade) and jobs running (digit)."""
    end = max((t1 for _, t1, *_ in result.timeline), default=0.0)
    if end <= 0:
        return f"{result.policy}: nothing ran"
    sm = np.zeros((gpus, width))
    cnt = np.zeros((gpus, width))
    for t0, t1, g, use, n in result.timeline:
        a, b = t0 / end * width, t1 / end * width
        for col in range(int(a), min(width, int(math.ceil(b)))):
            w = min(b, col + 1) - max(a, col)
            if w > 0:
                sm[g, col] += use * w
                cnt[g, col] = max(cnt[g, col], n)
    lines = [f"{result.policy}: 0 .. {end:.0f}s, shade = SM use, digit = jobs running"]
    for g in range(gpus):
        lines.append(f"GPU{g} SM   |" + "".join(_SHADES[min(9, int(x * 9.999))] for x in sm[g]) + "|")
        lines.append(f"GPU{g} jobs |" + "".join(" " if c == 0 else (str(int(c)) if c < 10 else "+") for c in cnt[g]) + "|")
    return "\n".join(lines)
