"""`colo history` and `colo report` (as Slurm's sacct/sreport): ended jobs over a period, and what
sharing the GPUs saved. Pure: rows in (the daemon's `history` op), figures out.

GPU-hours of a job "run one per GPU" = its GPUs x its run time: what the same job costs when it
has each GPU to itself (the placement study's exclusive-instance baseline). GPU-hours the node
actually spent = for each GPU, the time at least one job ran on it. Their difference is what
co-location saved (jobs that overlapped on a GPU were paid for once).
"""
from __future__ import annotations

import re
import time
from typing import Iterable

_PERIOD = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_period(text: str) -> float:
    """Seconds from "90m", "12h", "7d", "2w"."""
    m = _PERIOD.match(text or "")
    if not m:
        raise ValueError(f"malformed period {text!r}: use a number and s, m, h, d or w, e.g. 7d")
    return float(m.group(1)) * _UNIT[m.group(2)]


def job_figures(row: dict) -> dict:
    """One ended job: waited, ran, GPU-hours held (one per GPU) and GiB-hours budgeted."""
    spec = row.get("spec") or {}
    start, end, sub = row.get("started_at"), row.get("ended_at"), row.get("submitted_at") or 0.0
    started = start is not None
    ran = max(0.0, (end if end is not None else start) - start) if started else 0.0
    ngpus = len(row.get("gpus") or []) or ((spec.get("gpus") or 0) if started else 0)
    budget = spec.get("gpu_mem") or 0
    return {"id": row["id"], "name": spec.get("name"), "user": row.get("user"), "state": row.get("state"),
            "exit_code": row.get("exit_code"), "submitted_at": sub, "started_at": start, "ended_at": end,
            "waited": max(0.0, (start if started else (end if end is not None else sub)) - sub), "ran": ran, "gpus": ngpus,
            "gpu_hours": ngpus * ran / 3600.0, "budget": budget,
            "gib_hours_budgeted": budget * ngpus * ran / 3600.0 / 1024**3}


def select(rows: Iterable[dict], since: float | None = None, users: list[str] | None = None,
           now: float | None = None) -> list[dict]:
    """Ended jobs that ended within `since` seconds of now (all when None), of these users."""
    now = time.time() if now is None else now
    out = []
    for r in rows:
        if since is not None and (r.get("ended_at") or 0) < now - since:
            continue
        if users and r.get("user") not in users:
            continue
        out.append(r)
    return sorted(out, key=lambda r: r["id"])


def busy_gpu_hours(rows: Iterable[dict]) -> float:
    """For each GPU, the time at least one of these jobs ran on it (intervals merged), in hours."""
    per: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("started_at") is not None and r.get("ended_at") is not None:
            for g in r.get("gpus") or []:
                per.setdefault(g, []).append((r["started_at"], r["ended_at"]))
    total = 0.0
    for spans in per.values():
        spans.sort()
        cur_s, cur_e = spans[0]
        for s, e in spans[1:]:
            if s > cur_e:
                total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        total += cur_e - cur_s
    return total / 3600.0


def report(rows: list[dict]) -> dict:
    """Per user and for the node: jobs, GPU-hours one per GPU, waiting, and what sharing saved."""
    figs = [job_figures(r) for r in rows]
    users: dict[str, dict] = {}
    for f in figs:
        u = users.setdefault(f["user"], {"user": f["user"], "jobs": 0, "succeeded": 0, "failed": 0,
                                         "gpu_hours": 0.0, "gib_hours_budgeted": 0.0, "waits": []})
        u["jobs"] += 1
        u["succeeded"] += f["state"] == "succeeded"
        u["failed"] += f["state"] in ("failed", "lost")
        u["gpu_hours"] += f["gpu_hours"]
        u["gib_hours_budgeted"] += f["gib_hours_budgeted"]
        u["waits"].append(f["waited"])
    for u in users.values():
        w = sorted(u.pop("waits"))
        u["wait_median"] = w[len(w) // 2] if w else 0.0
        u["wait_max"] = w[-1] if w else 0.0
    exclusive = sum(f["gpu_hours"] for f in figs)
    busy = busy_gpu_hours(rows)
    return {"jobs": len(figs), "users": sorted(users.values(), key=lambda u: -u["gpu_hours"]),
            "gpu_hours_one_per_gpu": exclusive, "gpu_hours_busy": busy,
            "gpu_hours_saved": max(0.0, exclusive - busy),
            "saved_fraction": (exclusive - busy) / exclusive if exclusive > 0 else 0.0}


def bars(items: list[tuple[str, float]], width: int = 40, unit: str = "") -> list[str]:
    """A terminal bar chart: one line per (label, value)."""
    top = max((v for _, v in items), default=0.0)
    lw = max((len(label) for label, _ in items), default=0)
    return [f"{label:<{lw}}  {'█' * (round(v / top * width) if top > 0 else 0):<{width}}  {v:.2f}{unit}"
            for label, v in items]
