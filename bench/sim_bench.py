"""Scheduling benchmark: colo's policy vs the baselines (colo sim) under truths that are not colo's
model (noisy, study; colo/simtruth.py), on fresh 30-job mixes of each class, one per seed, with
the issue-13 aims checked and printed as MET or MISSED; and the time of one plan() pass with 10,000 queued jobs over 8 GPUs (target: < 20 ms; measured here, not
in the tests: a timed test fails on a slow machine).

    python bench/sim_bench.py [--seeds 8] [--truth noisy --truth study] [--gpus N] [--no-plan]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from colo import policy as pol, sim, simtruth  # noqa: E402
from colo.profiles import ProfileStore, shipped_dir  # noqa: E402

GiB = 1024**3


def plan_time(full: bool, reps: int = 7) -> tuple[float, int]:
    """Best-of-reps seconds for one pass. full=True: GPUs mostly budgeted (the usual long queue);
    False: GPUs with room, so many candidates need the profile comparison."""
    profs = ProfileStore([shipped_dir()]).ls()
    gpus = [pol.GpuView(f"u{i}", i, 80 * GiB, mps="active") for i in range(8)]
    rng = np.random.default_rng(1)
    if full:
        placed = [pol.Placed(i, (f"u{i % 8}",), 70 * GiB, mode="mps", profile=profs[i % len(profs)], elapsed=5.0)
                  for i in range(8)]
    else:
        placed = [pol.Placed(i, (f"u{i % 8}",), int(rng.integers(2, 8)) * GiB, uid=1000, mode="mps",
                             profile=profs[i % len(profs)], elapsed=float(rng.integers(0, 100))) for i in range(16)]
    cands = [pol.Candidate(100 + i, int(rng.integers(1, 40)) * GiB, seq=i, uid=1000 + int(rng.integers(0, 3)),
                           priority=int(rng.integers(0, 2)), profile=profs[i % len(profs)] if i % 5 else None)
             for i in range(10_000)]
    best, started = 1e9, 0
    for _ in range(reps):
        t = time.perf_counter()
        d = pol.plan(cands, gpus, placed)
        best = min(best, time.perf_counter() - t)
        started = sum(x.action == pol.START for x in d)
    return best, started


BASELINES = ["exclusive-sjf", "tetris", "max-pack", "mean-pack"]
HEAVY = ("heavy", "memory-heavy")


def truth_runs(truth: str, seeds: int, gpus: int) -> dict:
    """Per mix, per seed: a fresh 30-job mix drawn with that seed (not only the shipped ones) run
    under the truth with that seed, by the baselines, colo, colo with --grow, and colo with --grow
    that has learned from two earlier mixes of the same class in the same world (truth seed)."""
    out = {}
    for kind in sim.MIXES:
        rows = []
        for seed in range(seeds):
            w = sim.make_mix(kind, 1000 + seed)
            t = simtruth.Truth(truth, seed)
            res = {r.policy: r for r in sim.compare(w.jobs, BASELINES + ["colo"], gpus, w.gpu_mem, truth=t)}
            g = sim.simulate(w.jobs, "colo", gpus, w.gpu_mem, truth=t, grow=True)
            g.ratio = None if g.failed else g.makespan / res["exclusive-sjf"].makespan
            res["colo+grow"] = g
            learned = pol.Learned()
            for k in (1, 2):
                sim.simulate(sim.make_mix(kind, 2000 + 10 * seed + k).jobs, "colo", gpus, w.gpu_mem, truth=t,
                             grow=True, learned=learned)
            lr = sim.simulate(w.jobs, "colo", gpus, w.gpu_mem, truth=t, grow=True, learned=learned)
            lr.ratio = None if lr.failed else lr.makespan / res["exclusive-sjf"].makespan
            res["colo+learn"] = lr
            rows.append(res)
        out[kind] = rows
    return out


def fmt_ratio(rs: list) -> str:
    ok = [r.ratio for r in rs if r.ratio is not None]
    failed = sum(r.failed for r in rs)
    med = f"{np.median(ok):.3f}" if ok else "  -  "
    return f"{med}{'' if not failed else f' ({failed} failed)'}"


def report(truth: str, runs: dict, seeds: int) -> list[str]:
    """Side by side per mix, then the issue's aims checked for colo with --grow, without and with
    what it learned from earlier mixes."""
    pols = BASELINES + ["colo", "colo+grow", "colo+learn"]
    print(f"\ntruth {truth}: median makespan / exclusive SJF over {seeds} seeds (failed: seeds with lost jobs)")
    print(f"{'mix':13s} " + " ".join(f"{p:>17s}" for p in pols))
    for kind, rows in runs.items():
        print(f"{kind:13s} " + " ".join(f"{fmt_ratio([r[p] for r in rows]):>17s}" for p in pols))
    print(f"\ntruth {truth}: worst p95 / max slowdown over seeds, lost jobs in all seeds")
    print(f"{'mix':13s} " + " ".join(f"{p:>17s}" for p in pols))
    for kind, rows in runs.items():
        cells = []
        for p in pols:
            rs = [r[p] for r in rows]
            cells.append(f"{max(r.p95_slowdown for r in rs):.2f}/{max(r.max_slowdown for r in rs):.1f}x {sum(r.lost for r in rs):3d}")
        print(f"{kind:13s} " + " ".join(f"{c:>17s}" for c in cells))
    lines = []
    for (kind, rows), who in [(kr, w) for w in ("colo+grow", "colo+learn") for kr in runs.items()]:
        colo = [r[who] for r in rows]
        tag = f"{truth:5s} {who:10s}"
        if kind in HEAVY:
            n = sum(r.ratio is not None and r.ratio <= 1.0 + 1e-9 for r in colo)
            ok = n >= 0.95 * len(colo)
            lines.append(f"{tag} {kind:13s} <= 1.0x SJF in >= 95 % of seeds: {n}/{len(colo)} "
                         f"{'MET' if ok else 'MISSED'}")
        else:
            gaps = []
            for r in rows:
                best = min(r[p].ratio for p in BASELINES if r[p].ratio is not None)
                gaps.append(math.inf if r[who].ratio is None else r[who].ratio - best)
            n = sum(gp <= 0.03 + 1e-9 for gp in gaps)
            lines.append(f"{tag} {kind:13s} within 0.03 of the best baseline: {n}/{len(gaps)} seeds, "
                         f"median gap {np.median(gaps):+.3f} {'MET' if n == len(gaps) else 'MISSED'}")
        p95 = max(r.p95_slowdown for r in colo)
        lines.append(f"{tag} {kind:13s} p95 slowdown <= 1.5x: worst {p95:.2f}x {'MET' if p95 <= 1.5 else 'MISSED'}")
        lost = sum(r.lost for r in colo)
        lines.append(f"{tag} {kind:13s} 0 jobs lost with --grow: {lost} lost {'MET' if lost == 0 else 'MISSED'}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--truth", action="append", choices=simtruth.TRUTHS, help="default: noisy and study")
    ap.add_argument("--no-plan", action="store_true", help="skip the plan() timing")
    a = ap.parse_args()
    aims = []
    for truth in a.truth or ["noisy", "study"]:
        aims += report(truth, truth_runs(truth, a.seeds, a.gpus), a.seeds)
    print("\naims (issue 13), for colo with --grow (colo+grow) and with what it learned (colo+learn):")
    print("\n".join(aims))
    if not a.no_plan:
        for full in (True, False):
            t, n = plan_time(full)
            label = "GPUs mostly budgeted" if full else "GPUs with room      "
            print(f"\nplan(): 10,000 queued, 8 GPUs, {label}: {t * 1000:.1f} ms per pass (best of 7; {n} started; target < 20 ms)", end="")
        print()


if __name__ == "__main__":
    main()
