"""The simulated node: each job in the simulation with its current attempt (SimRun: what it
really does, which policies never see, and what they do see), the GPUs, and the shape of a policy
(what simulate() calls to place queued runs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..profiles import Profile
from . import policy as pol
from . import truth as simtruth
from .workloads import SimJob, budget_for


class SimRun:
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
        self.provisioned = 0.0  # how much of this attempt a provisional profile was made (or looked for) from
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


def seen_profile(r: SimRun, profiles: dict[str, Profile] | None) -> Profile | None:
    """The profile a policy places a run with: what it learned of that application (profiles),
    else the stored one; None for a job without one (known=no) until a run of it was sampled."""
    got = profiles.get(r.job.profile.name) if profiles else None
    return got if got is not None else (r.job.profile if r.job.known else None)
