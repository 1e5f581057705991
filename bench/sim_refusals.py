"""What keeps a GPU idle under colo: the pass's own refusals while jobs wait.

Per mix and seed (the mix and truth bench/sim_bench.py draws: mix seed 1000 + seed, truth seed
seed), colo cold (--grow, one GPU) runs with every plan() pass and every _assess of a refused
candidate watched. While the GPU's SM reading is under --below and a job waits, the capacity left
idle until the next pass (seconds x (1 - reading)) is put on what stopped each waiting profile's
best mode: `bound` (a job predicted past the slowdown bound), `turns` (the level of taking turns
more than one job past what groups showed), `bandwidth` (the MPS bandwidth exploration more than
one step past what runs showed), `gain` (no throughput gained), joined with + when more than one
did. Prints colo's makespan / SJF, p95, and the idle seconds per blocker, per seed and summed.
Run it on two checkouts (`--colo DIR`) to see what a policy change moved.

    python bench/sim_refusals.py [--seeds 8] [--truth h200] [--mix fits ...] [--below 0.95] [--colo DIR]
"""
from __future__ import annotations

import collections

import checkout  # noqa: E402
from sim_cold import parser


def main() -> None:
    ap = parser(__doc__, "fits")
    ap.add_argument("--below", type=float, default=0.95, help="an SM reading under this is an underused GPU")
    a = ap.parse_args()
    checkout.use_colo(a.colo)
    from colo.sched import policy as pol, sim, truth as simtruth
    from colo.sched.learning import TS_IDLE

    refused: list[tuple[str, str]] = []  # (profile, blockers) of the pass under way
    passes: list[tuple[float, list]] = []  # (now, its refusals) per pass
    assess, plan = pol._assess, pol.plan

    def blockers(arr, g, cfg, learned, d) -> str:
        """What stopped each mode, for the mode stopped by the fewest."""
        out = []
        all_mps = all(r.mode == "mps" for r in g.res)
        step = float(arr.sm[:max(1, int(d["overlap_s"] / cfg.step))].max())
        for m, slow in d["slowdown"].items():
            b = ["bound"] if slow > cfg.slowdown_bound else []
            if learned is not None and m == "mps" and not learned.explored(m, d["peak_membw"]) \
                    and learned.beyond(m, d["peak_membw"]):
                b.append("bandwidth")
            if learned is not None and (m == "timesliced" or not all_mps) and arr.peak_sm > TS_IDLE \
                    and not learned.ts_explored(d["ts_level"]) and learned.ts_beyond(d["ts_level"], step):
                b.append("turns")
            if d["throughput"][m] <= d["throughput"]["wait"]:
                b.append("gain")
            out.append(b)
        return "+".join(sorted(min(out, key=len))) or "other"

    def watched_assess(arr, uid, g, cfg, learned=None):
        got = assess(arr, uid, g, cfg, learned)
        if got[0] is None and arr is not None:
            d = got[2]
            refused.append((arr.name, blockers(arr, g, cfg, learned, d) if "slowdown" in d else "other"))
        return got

    def watched_plan(cands, views, placed, cfg, now=None, learned=None):
        refused.clear()
        out = plan(cands, views, placed, cfg, now=now, learned=learned)
        passes.append((now, list(refused)))
        return out

    pol._assess, pol.plan = watched_assess, watched_plan  # the pass's own, only watched
    print(f"truth {a.truth}, {a.seeds} seeds, idle while the SM reading < {a.below}")
    for kind in a.mix or ["fits"]:
        total: collections.Counter = collections.Counter()
        for seed in range(a.seeds):
            passes.clear()
            w, t = sim.make_mix(kind, 1000 + seed), simtruth.Truth(a.truth, seed)
            sjf = sim.simulate(w.jobs, "exclusive-sjf", 1, w.gpu_mem, truth=t).makespan
            passes.clear()
            g = sim.simulate(w.jobs, "colo", 1, w.gpu_mem, truth=t, grow=True)
            spans = sorted((t0, t1, use) for t0, t1, _, use, _ in g.timeline)
            idle: collections.Counter = collections.Counter()
            for i, (now, why) in enumerate(passes):
                use = next((u for t0, t1, u in spans if t0 <= now + 1e-6 < t1), 0.0)
                if use >= a.below or not why:
                    continue
                until = passes[i + 1][0] if i + 1 < len(passes) else now
                first = dict(reversed(why))  # per profile, the first refusal of the pass
                for b in set(first.values()):
                    idle[b] += (until - now) * (1.0 - use)
            total.update(idle)
            cells = ", ".join(f"{b} {s:.0f}" for b, s in idle.most_common())
            print(f"{kind} seed {seed}: colo {g.makespan / sjf:.3f} of SJF, p95 {g.p95_slowdown:.2f}x; "
                  f"idle s by blocker: {cells or 'none'}", flush=True)
        print(f"{kind} all seeds: " + ", ".join(f"{b} {s:.0f}" for b, s in total.most_common()))


if __name__ == "__main__":
    main()
