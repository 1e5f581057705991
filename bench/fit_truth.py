"""Fit the `h200` truth's physics (colo/sched/fitted.py) to what GPU checks measured.

    python bench/fit_truth.py bench/results/gpu-2026-11-28/run*.json [--write]

Reads each report's parts `colocation` and `groups` (bench/gpu_parts.py): the light jobs one after another
(per-job alone times, their NVML SM), all at once time-sliced, colo's runs of them (each job's
start, end and mode: jobs that overlapped are a group), the saturating pair back to back,
time-sliced and under MPS; and, where the check ran part `groups`, n like jobs at once in a mode
against one of them alone times n. Each is an observation: n jobs with an SM
reading, their alone times, a mode, and the measured throughput over one after another. The
physics' four constants are fitted by grid search (coarse, then twice finer) on the squared log
error of throughput; the context memories are read from the reports as measured. Prints every
observation with its residual; --write puts the constants and the table into
colo/sched/truth_h200.json, which the truth reads (docs/sim.md keeps the table).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

import checkout  # noqa: E402
checkout.use_colo()
from colo.sched import fitted  # noqa: E402

MiB = 1024**2
HEAVY_SM = 1.0  # a saturating matmul loop's NVML reading where the report has no sample of it


@dataclass
class Obs:
    what: str
    n: int
    sm: float
    mode: str  # timesliced | mps
    alone: list  # each job's alone time (s)
    measured: float  # throughput over one after another (sum of alone / wall)
    source: str

    def predicted(self, p: fitted.Params) -> float:
        """As the simulator runs them: all start at once, each slowed alike; wall = slowest."""
        s = fitted.group_slowdown(self.n, self.sm, self.mode, p)
        return sum(self.alone) / (max(self.alone) * s)


def observations(report: dict, source: str) -> list[Obs]:
    res = (report.get("parts", {}).get("colocation") or {}).get("results") or {}
    out: list[Obs] = []
    alone = (res.get("exclusive") or {}).get("per_job_s") or []
    prof = res.get("seeded_profile") or {}
    sm = float(prof.get("mean_sm") or 0.0)
    ts = (res.get("timesliced") or {}).get("wall_s")
    if alone and ts and sm:
        out.append(Obs(f"{len(alone)} light, time-sliced", len(alone), sm, "timesliced", alone,
                       sum(alone) / ts, source))
    if alone and sm:
        mean = sum(alone) / len(alone)
        for key in ("colo_seeded", "colo_cold"):
            out += _colo_groups(res.get(key) or {}, sm, mean, f"{source} {key}")
    pair = res.get("pair") or {}
    heavy_sm = float((pair.get("profile") or {}).get("mean_sm") or HEAVY_SM)
    ex = pair.get("exclusive_s")
    for mode, key in (("timesliced", "timesliced_s"), ("mps", "mps_s")):
        if ex and pair.get(key):
            out.append(Obs(f"saturating pair, {mode}", 2, heavy_sm, mode, [ex / 2, ex / 2], ex / pair[key], source))
    groups = ((report.get("parts", {}).get("groups") or {}).get("results") or {}).get("groups") or []
    for g in groups:  # part groups: n like jobs at once vs one alone times n
        if g.get("together_s") and g.get("serial_s") and g.get("n"):
            n = int(g["n"])
            a = g.get("per_job_s") or [g["serial_s"] / n] * n
            sm_g = g.get("mean_sm")
            out.append(Obs(f"{n} {g.get('kind', '?')}, {g['mode']}", n, HEAVY_SM if sm_g is None else float(sm_g),
                           g["mode"], a, g["serial_s"] / g["together_s"], f"{source} groups"))
    return out


def _colo_groups(run: dict, sm: float, mean_alone: float, source: str) -> list[Obs]:
    """colo's runs of the light jobs: jobs whose runs overlapped most of their time are a group of
    that many in their mode; its throughput is n * the mean alone time over their mean wall. The
    alone times were measured at another moment of the check (without colo), and spread 17-19 %
    from fastest to slowest within one report: these figures carry that noise."""
    rows = [r for r in run.get("rows") or [] if r.get("started_at") and r.get("ended_at") and r.get("state") == "succeeded"]
    groups: dict = {}
    for r in rows:
        a, b = r["started_at"], r["ended_at"]
        n = sum(1 for o in rows if min(b, o["ended_at"]) - max(a, o["started_at"]) > 0.5 * (b - a))
        if n >= 2:
            groups.setdefault((n, r.get("mode") or "timesliced"), []).append(b - a)
    return [Obs(f"{n} light under colo, {mode}", n, sm, mode, [mean_alone] * n,
                n * mean_alone / (sum(w) / len(w)), source) for (n, mode), w in sorted(groups.items())]


def context_memory(reports: list[dict]) -> dict:
    """What the reports measured of contexts' memory outside a budget: an MPS client's (its pinned
    limit less what it saw free at init) and the MPS server's (NVML)."""
    out = {}
    for rep in reports:
        mps = (rep.get("parts", {}).get("mps") or {}).get("results") or {}
        a = (mps.get("client_A") or {})
        init = a.get("init") or {}
        if a.get("limit") and init.get("free"):
            out["mps_client_mem"] = int(a["limit"] - init["free"])
        for p in (mps.get("nvml") or {}).get("compute") or []:
            if p.get("role") == "server":
                out["mps_server_mem"] = int(p["used"])
    return out


def loss(obs: list[Obs], p: fitted.Params) -> float:
    return sum(math.log(o.predicted(p) / o.measured) ** 2 for o in obs)


def fit(obs: list[Obs], base: fitted.Params) -> fitted.Params:
    ranges = {"duty": (0.4, 1.0), "mps_gain": (1.0, 1.8), "c_ts": (0.0, 0.1), "c_mps": (0.0, 0.1)}
    best = base
    for _ in range(3):
        axes = {k: np.linspace(lo, hi, 9) for k, (lo, hi) in ranges.items()}
        cands = (replace(best, **dict(zip(axes, v))) for v in itertools.product(*axes.values()))
        best = min(cands, key=lambda p: (round(loss(obs, p), 9), p.c_ts + p.c_mps))  # ties: the fewest costs
        ranges = {k: (max(lo, getattr(best, k) - (hi - lo) / 8), min(hi, getattr(best, k) + (hi - lo) / 8))
                  for k, (lo, hi) in ranges.items()}
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path, help="gpu-report.json files of bench/gpu_check.py")
    ap.add_argument("--write", action="store_true", help=f"write the fit to {fitted.FIT_FILE}")
    a = ap.parse_args()
    reports, obs = [], []
    for path in a.reports:
        try:
            rep = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"fit_truth: cannot read {path}: {e}")
        reports.append(rep)
        obs += observations(rep, path.stem)
    if not obs:
        sys.exit("fit_truth: no co-location figures in these reports (part colocation did not finish)")
    mem = context_memory(reports)
    p = fit(obs, replace(fitted.Params(), **mem))
    rows = []
    print(f"fitted: {', '.join(f'{k} {v:.4g}' for k, v in asdict(p).items() if not k.endswith('_mem'))}; "
          + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in asdict(p).items() if k.endswith('_mem')))
    print(f"{'observation':34s} {'source':22s} {'measured':>9s} {'fitted':>8s} {'residual':>9s}")
    for o in obs:
        got = o.predicted(p)
        rows.append({"what": o.what, "source": o.source, "measured": round(o.measured, 3), "fitted": round(got, 3),
                     "residual": round(got / o.measured - 1, 4)})
        print(f"{o.what:34s} {o.source:22s} {o.measured:8.2f}x {got:7.2f}x {got / o.measured - 1:+9.1%}")
    for label, pick in (("side by side in one run (groups, pairs)", lambda r: "under colo" not in r["what"]),
                        ("colo's groups, against alone runs made at another moment", lambda r: "under colo" in r["what"])):
        got = [abs(r["residual"]) for r in rows if pick(r)]
        if got:
            print(f"worst residual, {label}: {max(got):.1%} ({'within' if max(got) <= 0.10 else 'PAST'} 10 %)")
    if a.write:
        fitted.FIT_FILE.write_text(json.dumps({"sources": [str(x) for x in a.reports], "params": asdict(p),
                                               "residuals": rows}, indent=1) + "\n")
        print(f"written: {fitted.FIT_FILE}")


if __name__ == "__main__":
    main()
