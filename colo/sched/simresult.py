"""What a simulation gives (Result: a policy's makespan, completion times, slowdowns, use of
the GPUs, OOM failures and lost jobs, each job's record and the occupancy timeline), how it is
counted from the runs (result_of), and how `colo sim` prints it: tables and a text plot."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


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


def result_of(label, runs, t_end, sm_area, mem_area, oom, gpus, timeline, bound: float = 1.5) -> Result:
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
