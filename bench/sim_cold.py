"""colo cold, quickly: a policy change's first check before the whole of bench/sim_bench.py.

Per mix and seed, the mix and truth sim_bench draws for that seed (mix seed 1000 + seed, truth
seed seed), colo cold (--grow, no learning carried in) and exclusive SJF; prints colo's makespan
over SJF per seed with its p95 slowdown (every attempt counted) and lost jobs, the median, the
worst p95, and the seconds it took. No baselines but SJF and no learning sequence: a few minutes
for 8 seeds of every mix where sim_bench takes an hour. Run it on two checkouts side by side
(`--colo DIR` puts that checkout's colo first) the same hour: the figures are only compared so.

    python bench/sim_cold.py [--seeds 8] [--truth h200] [--mix M ...] [--gpus 1] [--colo DIR]
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


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gpus", type=int, default=1)
    a = ap.parse_args()
    checkout.use_colo(a.colo)
    from colo.sched import sim, truth as simtruth

    import colo
    print(f"colo from {colo.__file__}, truth {a.truth}, {a.seeds} seeds, {a.gpus} GPU(s)")
    t0 = time.monotonic()
    for kind in a.mix or sim.MIXES:
        rows = []
        for seed in range(a.seeds):
            w, t = sim.make_mix(kind, 1000 + seed), simtruth.Truth(a.truth, seed)
            sjf = sim.simulate(w.jobs, "exclusive-sjf", a.gpus, w.gpu_mem, truth=t).makespan
            g = sim.simulate(w.jobs, "colo", a.gpus, w.gpu_mem, truth=t, grow=True)
            rows.append((g.makespan / sjf, g.p95_slowdown, g.lost))
        ratios = sorted(r[0] for r in rows)
        median = (ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2
        cells = "  ".join(f"{r:.3f}/{p:.2f}x" + (f"/{n} lost" if n else "") for r, p, n in rows)
        print(f"{kind:13s} median {median:.3f}  worst p95 {max(r[1] for r in rows):.2f}x  "
              f"lost {sum(r[2] for r in rows)}  per seed (makespan/SJF, p95): {cells}", flush=True)
    print(f"{time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
