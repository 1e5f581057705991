"""Part `queues` of bench/gpu_check.py (issue 39; docs/gpu.md): colo against what a lab does without
it, on two queues of mixed real PyTorch jobs, each run four ways in one call:

  serial   one after another, no colo
  plain    all at once, time-sliced, no budgets, no colo (plain sharing: `naive` in `colo sim`)
  cold     under colo: a fresh daemon with the real defaults, no profile of any job
  learned  the same queue again on that daemon, which learned from the cold run

The queues:
  fits     4 light training loops and 2 medium jobs: their memory all fits, so plain sharing loses
           nothing and is what colo has to keep up with (issue 39's aim: >= 0.9x its throughput)
  over     6 light loops each holding HOLD of the GPU's memory (1.8 GPUs in all): plain sharing
           loses jobs to out-of-memory errors; colo, each job's budget its hold and a margin, must
           lose none

A way's throughput is the serial wall time over its own. A job that failed ended early and did
not do its work: a way that lost jobs has its lost count beside its throughput, which then
overstates it (plain sharing on `over`).
"""
from __future__ import annotations

import time

from gpu_parts import colo_run, job_argv, run_one, run_queue, run_together
from gpu_partlib import GiB, Part, gpu0

HOLD = 0.3  # of the GPU's memory, held by each job of queue `over`
MARGIN = 1 * GiB  # a hold job's budget past its hold: the model, its gradients, cuBLAS's workspace
WAYS = (("serial", "one after another, no colo"), ("plain", "all at once, no colo (plain sharing)"),
        ("cold", "colo, cold (a fresh daemon)"), ("learned", "colo, the same queue again (learned)"))


def queues(part: Part) -> dict[str, list[tuple[str, int, int]]]:
    """Each queue's jobs: (kind, steps, bytes held)."""
    light = part.ctx["light_steps"] // 2
    hold = int(gpu0(part.ctx)["total"] * HOLD)
    return {"fits": [("light", light, 0)] * 4 + [("medium", 3000, 0)] * 2,
            "over": [("hold", light, hold)] * 6}


def part_queues(part: Part) -> None:
    from colo.node import mps

    null = mps.timesliced_env(part.tmp / "ts")
    use_mps = bool(part.ctx.get("mps_ok"))
    qs = queues(part)
    part.put("setup", {"queues": {q: [f"{k} x{s}" + (f", holding {h / GiB:.1f} GiB" if h else "") for k, s, h in js]
                                  for q, js in qs.items()},
                       "mps": "colo may run jobs under MPS" if use_mps else f"MPS not used: {part.ctx.get('mps_why')}"})
    for name, jobs in qs.items():
        argvs = [job_argv(part, kind, steps, hold) for kind, steps, hold in jobs]
        res: dict = {"jobs": len(jobs)}
        t0 = time.perf_counter()
        rcs = [run_one(a, part.env, part.left()) for a in argvs]
        res["serial"] = {"wall_s": time.perf_counter() - t0, "lost": sum(rc != 0 for rc in rcs)}
        part.put(name, res)
        part.check(f"queue {name}, one after another: every job succeeds", not res["serial"]["lost"], rcs)
        wall, rcs, errs = run_together(argvs, [{**part.env, **null}] * len(argvs), part.left())
        res["plain"] = {"wall_s": wall, "lost": sum(rc != 0 for rc in rcs),
                        "errors": [e.strip().splitlines()[-1:] for e, rc in zip(errs, rcs) if rc and e.strip()][:2]}
        part.put(name, res)
        if name == "fits":
            part.check("queue fits, all at once without colo: every job succeeds (their memory fits)",
                       not res["plain"]["lost"], [rcs, errs[:1]])
        specs = [{"argv": a, "gpu_mem": hold + MARGIN if hold else 1 * GiB, "name": f"{name}{i}"}
                 for i, (a, (_, _, hold)) in enumerate(zip(argvs, jobs))]

        def again(d, out: dict, specs=specs, name=name) -> None:
            out["again"] = run_queue(part, d, specs, f"{name}, again")

        out = colo_run(part, name, argvs[0], 0, use_mps, then=again, jobs=specs)
        for way, run in (("cold", out), ("learned", out.get("again") or {})):
            rows = run.get("rows") or []
            res[way] = {"wall_s": run.get("wall_s"), "lost": sum(r["state"] != "succeeded" for r in rows),
                        "modes": run.get("modes"), "rows": rows}
            part.check(f"queue {name} under colo, {way}: every job succeeds", bool(rows) and not res[way]["lost"]
                       and "error" not in out, out.get("error") or rows)
        res["daemon_log_tail"] = out.get("daemon_log_tail")
        serial = res["serial"]["wall_s"]
        for way, _ in WAYS:
            w = res[way].get("wall_s")
            res[way]["throughput"] = round(serial / w, 3) if w else None
        part.put(name, res)


def queues_md(parts: dict) -> list[str]:
    res = parts.get("queues", {}).get("results", {})
    qs = [q for q in ("fits", "over") if q in res]
    if not qs:
        return []
    L = ["", "## Queues of mixed jobs: colo against plain sharing", "", (res.get("setup") or {}).get("mps", ""), "",
         "| queue | how they ran | wall | throughput vs one after another | lost | how colo ran them |",
         "|---|---|---|---|---|---|"]
    for q in qs:
        for way, label in WAYS:
            r = res[q].get(way) or {}
            w, tp, modes = r.get("wall_s"), r.get("throughput"), r.get("modes")
            L.append(f"| {q} | {label} | {f'{w:.1f} s' if w else '-'} | {f'{tp:.2f}x' if tp else '-'} | "
                     f"{r.get('lost', '-')} | {', '.join(f'{k}: {v}' for k, v in modes.items()) if modes else '-'} |")
    return L
