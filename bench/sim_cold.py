"""colo cold, quickly: a policy change's first check before the whole of bench/sim_bench.py.

Per mix and seed, the mix and truth sim_bench draws for that seed (mix seed 1000 + seed, truth
seed seed), colo cold (--grow, no learning carried in) and exclusive SJF; prints colo's makespan
over SJF per seed with its p95 slowdown (every attempt counted) and lost jobs, the median, the
worst p95, and the seconds it took. No baselines but SJF and no learning sequence: a few minutes
for 8 seeds of every mix where sim_bench takes an hour. Run it on two checkouts side by side
(`--colo DIR` puts that checkout's colo first) the same hour: the figures are only compared so.

--unknown hides every job's profile (known=no: a first run of each family, what a fresh daemon
meets from users who never profiled), from colo and the baselines alike. --baselines also runs
tetris, max-pack, mean-pack and naive (plain sharing), and prints colo's gap to the best of them
(SJF included) that keeps p95 <= 1.5x and loses no job.

    python bench/sim_cold.py [--seeds 8] [--truth h200] [--mix M ...] [--gpus 1] [--colo DIR]
                             [--unknown] [--baselines]
"""
from __future__ import annotations

import argparse
import time

import checkout  # noqa: E402


def parser(doc: str, mixes: str = "every mix") -> argparse.ArgumentParser:
    """The options of a bench of colo cold in the simulator (this one's, bench/sim_refusals.py's)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--truth", default="h200")
    ap.add_argument("--mix", action="append", help=f"default: {mixes}")
    ap.add_argument("--colo", help="a checkout whose colo/ is used instead of this one's")
    return ap


BASELINES = ("tetris", "max-pack", "mean-pack", "naive")


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--unknown", action="store_true", help="every job's profile hidden (known=no)")
    ap.add_argument("--baselines", action="store_true", help="colo's gap to the best baseline keeping the bound")
    a = ap.parse_args()
    checkout.use_colo(a.colo)
    import dataclasses

    from colo.sched import sim, truth as simtruth

    import colo
    print(f"colo from {colo.__file__}, truth {a.truth}, {a.seeds} seeds, {a.gpus} GPU(s)"
          + (", every profile unknown" if a.unknown else ""))
    t0 = time.monotonic()
    for kind in a.mix or sim.MIXES:
        rows, gaps = [], []
        for seed in range(a.seeds):
            w, t = sim.make_mix(kind, 1000 + seed), simtruth.Truth(a.truth, seed)
            jobs = [dataclasses.replace(j, known=False) for j in w.jobs] if a.unknown else w.jobs
            sjf = sim.simulate(jobs, "exclusive-sjf", a.gpus, w.gpu_mem, truth=t).makespan
            g = sim.simulate(jobs, "colo", a.gpus, w.gpu_mem, truth=t, grow=True)
            rows.append((g.makespan / sjf, g.p95_slowdown, g.lost))
            if a.baselines:
                kept = [1.0] + [b.makespan / sjf for b in (sim.simulate(jobs, p, a.gpus, w.gpu_mem, truth=t)
                                                           for p in BASELINES)
                                if not b.lost and b.p95_slowdown <= 1.5 + 1e-9]
                gaps.append(g.makespan / sjf - min(kept))
        cells = "  ".join(f"{r:.3f}/{p:.2f}x" + (f"/{n} lost" if n else "") for r, p, n in rows)
        gap = f"  gap to the best keeping p95 <= 1.5x: median {median(gaps):+.3f}, worst {max(gaps):+.3f}" if gaps else ""
        print(f"{kind:13s} median {median([r[0] for r in rows]):.3f}  worst p95 {max(r[1] for r in rows):.2f}x  "
              f"lost {sum(r[2] for r in rows)}{gap}  per seed (makespan/SJF, p95): {cells}", flush=True)
    print(f"{time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
