"""`colo history` and `colo report` (as Slurm's sacct/sreport): ended jobs over a period, and what
sharing the GPUs saved. Pure: rows in (the daemon's `history` op), figures out.

GPU-hours of a job "run one per GPU" = its GPUs x its run time (less the time it was suspended,
`colo suspend`: its memory in host memory, nothing running): what the same job costs when it
has each GPU to itself (the placement study's exclusive-instance baseline). GPU-hours the node
actually spent = for each GPU, the time at least one job ran on it. Their difference is what
co-location saved (jobs that overlapped on a GPU were paid for once).

Slowdown against alone = a succeeded job's run time / its profile's run time alone (the profile
colo placed it with, learned from earlier runs; colo/daemon/learner.py records it at the job's
end). None ("—" in tables) for a job with no profile, or one that did not succeed (it stopped
early, so its run time says nothing about speed).
"""
from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # no typing (nor re) at run time: `colo history` loads this module
    from typing import Iterable


def job_figures(row: dict) -> dict:
    """One ended job: waited, ran, GPU-hours held (one per GPU) and GiB-hours budgeted."""
    spec = row.get("spec") or {}
    start, end, sub = row.get("started_at"), row.get("ended_at"), row.get("submitted_at") or 0.0
    started = start is not None
    ran = max(0.0, (end if end is not None else start) - start) if started else 0.0
    held = max(0.0, ran - (row.get("off_gpu") or 0.0))  # suspended time (colo suspend) held no GPU
    ngpus = len(row.get("gpus") or []) or ((spec.get("gpus") or 0) if started else 0)
    budget = spec.get("gpu_mem") or 0
    alone = row.get("alone_s")
    slow = ran / alone if alone and ran > 0 and row.get("state") == "succeeded" else None
    return {"id": row["id"], "name": spec.get("name"), "user": row.get("user"), "state": row.get("state"),
            "exit_code": row.get("exit_code"), "submitted_at": sub, "started_at": start, "ended_at": end,
            "waited": max(0.0, (start if started else (end if end is not None else sub)) - sub), "ran": ran, "gpus": ngpus,
            "gpu_hours": ngpus * held / 3600.0, "budget": budget, "suspended_s": ran - held,
            "gib_hours_budgeted": budget * ngpus * held / 3600.0 / 1024**3,
            "alone_s": alone, "slowdown": slow, "predicted_slowdown": row.get("predicted_slowdown")}


def _spans(rows: Iterable[dict]) -> list[tuple[str, float, float]]:
    """(GPU, start, end) of each job that ran, once per GPU it held, by GPU then start."""
    return sorted((g, r["started_at"], r["ended_at"]) for r in rows
                  if r.get("started_at") is not None and r.get("ended_at") is not None
                  and r["ended_at"] > r["started_at"] for g in r.get("gpus") or [])


def spans_figures(spans: Iterable[tuple[str, float, float]]) -> tuple[float, list[dict]]:
    """From (GPU, start, end) sorted by GPU then start, read once (the store's cursor: a long
    history is never all in memory): the GPU-hours at least one job ran on each GPU (intervals
    merged), and per local day the GPU-hours one job per GPU would take, busy, and saved."""
    excl: dict[str, float] = {}
    busy: dict[str, float] = {}
    total = 0.0
    gpu, cur = None, None  # the merged interval being grown on GPU `gpu`

    def close(span) -> float:
        for day, secs in _days(*span):
            busy[day] = busy.get(day, 0.0) + secs / 3600.0
        return span[1] - span[0]

    for g, s, e in spans:
        for day, secs in _days(s, e):
            excl[day] = excl.get(day, 0.0) + secs / 3600.0
        if cur is not None and g == gpu and s <= cur[1]:
            cur[1] = max(cur[1], e)
            continue
        if cur is not None:
            total += close(cur)
        gpu, cur = g, [s, e]
    if cur is not None:
        total += close(cur)
    return total / 3600.0, [{"day": d, "gpu_hours_one_per_gpu": excl[d], "gpu_hours_busy": busy.get(d, 0.0),
                             "gpu_hours_saved": max(0.0, excl[d] - busy.get(d, 0.0))} for d in sorted(excl)]


def busy_gpu_hours(rows: Iterable[dict]) -> float:
    """For each GPU, the time at least one of these jobs ran on it (intervals merged), in hours."""
    return spans_figures(_spans(rows))[0]


def per_day(rows: Iterable[dict]) -> list[dict]:
    """Per local day: GPU-hours one job per GPU would take, GPU-hours the GPUs were busy, saved."""
    return spans_figures(_spans(rows))[1]


def report(rows: list[dict]) -> dict:
    """Per user and for the node: jobs, GPU-hours one per GPU, waiting, and what sharing saved
    (from rows as `history` gives them; the daemon adds them up in SQL instead: Store.report_users)."""
    figs = [job_figures(r) for r in rows]
    users: dict[str, dict] = {}
    for f in figs:
        u = users.setdefault(f["user"], {"user": f["user"], "jobs": 0, "succeeded": 0, "failed": 0,
                                         "gpu_hours": 0.0, "gib_hours_budgeted": 0.0, "waits": [], "slow": []})
        u["jobs"] += 1
        u["succeeded"] += f["state"] == "succeeded"
        u["failed"] += f["state"] in ("failed", "lost")
        u["gpu_hours"] += f["gpu_hours"]
        u["gib_hours_budgeted"] += f["gib_hours_budgeted"]
        u["waits"].append(f["waited"])
        if f["slowdown"] is not None:
            u["slow"].append(f["slowdown"])
    for u in users.values():
        w = sorted(u.pop("waits"))
        u["wait_median"] = w[len(w) // 2] if w else 0.0
        u["wait_max"] = w[-1] if w else 0.0
        sl = sorted(u.pop("slow"))  # over the jobs whose slowdown is known (slowdown_jobs of them)
        u["slowdown_jobs"] = len(sl)
        u["slowdown_median"] = sl[len(sl) // 2] if sl else None
        u["slowdown_max"] = sl[-1] if sl else None
    return assemble(list(users.values()), _spans(rows))


def held_idle(sm: float | None, mem: int | None) -> bool:
    """A sample of a job holding GPU memory with no GPU activity (an unknown SM is not idle)."""
    return sm is not None and sm <= 0 and (mem or 0) > 0


def idle_hours(samples: Iterable[tuple], idle_after: float, gap: float = 60.0) -> dict[str, float]:
    """Per user, GPU-hours held idle: from (user, job, GPUs, at, SM, memory) by job then time (the
    store's cursor), each stretch of a job's samples that held memory with no activity for at
    least `idle_after` seconds, times its GPUs. A gap past `gap` seconds between two samples (the
    daemon was away) ends a stretch. idle_after 0: nothing is counted."""
    out: dict[str, float] = {}
    job = start = last = None
    user, ngpus = "", 1

    def close() -> None:
        if start is not None and idle_after > 0 and last - start >= idle_after:
            out[user] = out.get(user, 0.0) + (last - start) * ngpus / 3600.0

    for u, j, n, at, sm, mem in samples:
        if j != job or not held_idle(sm, mem) or at - last > gap:
            close()
            start = None
        job, user, ngpus, last = j, u, n, at
        if start is None and held_idle(sm, mem):
            start = at
    close()
    return out


def assemble(users: list[dict], spans: Iterable[tuple[str, float, float]], idle: dict[str, float] | None = None) -> dict:
    """The report from its per-user sums, the jobs' (GPU, start, end) spans (see spans_figures) and
    the GPU-hours each user's jobs held idle (see idle_hours)."""
    busy, days = spans_figures(spans)
    exclusive = sum(u["gpu_hours"] for u in users)
    for u in users:
        u["gpu_hours_idle"] = (idle or {}).get(u["user"], 0.0)
    return {"jobs": sum(u["jobs"] for u in users), "users": sorted(users, key=lambda u: -u["gpu_hours"]),
            "gpu_hours_idle": sum(u["gpu_hours_idle"] for u in users),
            "gpu_hours_one_per_gpu": exclusive, "gpu_hours_busy": busy,
            "gpu_hours_saved": max(0.0, exclusive - busy),
            "saved_fraction": (exclusive - busy) / exclusive if exclusive > 0 else 0.0,
            "days": days}


def _days(s: float, e: float) -> Iterable[tuple[str, float]]:
    """(local date, seconds) of the span [s, e) cut at local midnights."""
    from datetime import datetime, timedelta

    t = s
    while t < e:
        d = datetime.fromtimestamp(t)
        nxt = (d.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)).timestamp()
        yield d.date().isoformat(), min(e, nxt) - t
        t = nxt


def bars(items: list[tuple[str, float]], width: int = 40, unit: str = "") -> list[str]:
    """A terminal bar chart: one line per (label, value)."""
    top = max((v for _, v in items), default=0.0)
    lw = max((len(label) for label, _ in items), default=0)
    return [f"{label:<{lw}}  {'█' * (round(v / top * width) if top > 0 else 0):<{width}}  {v:.2f}{unit}"
            for label, v in items]


def times(x: float | None) -> str:
    """A slowdown as tables show it: 1.23x, or — where unknown."""
    return "—" if x is None else f"{x:.2f}x"


def _esc(text: str) -> str:
    return (str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
            .encode("ascii", "xmlcharrefreplace").decode())


def svg(r: dict, title: str = "colo report") -> str:
    """The report as an SVG image, plain text written here (no plotting library): per user,
    GPU-hours and GiB-hours budgeted; per day, GPU-hours one job per GPU would take against
    those the GPUs were busy (the gap is what sharing saved)."""
    W, left, bar, gap = 760, 150, 14, 6
    out: list[str] = []
    y = 40

    def text(x: float, yy: float, t: str, size: int = 12, anchor: str = "start", weight: str = "normal") -> None:
        out.append(f'<text x="{x:.1f}" y="{yy:.1f}" font-size="{size}" text-anchor="{anchor}" '
                   f'font-weight="{weight}">{_esc(t)}</text>')

    def rect(x: float, yy: float, w: float, h: float, color: str, tip: str) -> None:
        out.append(f'<rect x="{x:.1f}" y="{yy:.1f}" width="{max(w, 0.0):.1f}" height="{h}" fill="{color}">'
                   f"<title>{_esc(tip)}</title></rect>")

    def chart(heading: str, items: list[tuple[str, list[tuple[float, str, str]]]], unit: str) -> None:
        nonlocal y
        text(10, y, heading, 14, weight="bold")
        y += 12
        top = max((v for _, vals in items for v, _, _ in vals), default=0.0) or 1.0
        span = W - left - 90
        for label, vals in items:
            text(left - 8, y + bar * len(vals) / 2 + 4, label, anchor="end")
            for v, color, what in vals:
                rect(left, y, v / top * span, bar - 2, color, f"{label}: {what} {v:.2f} {unit}")
                text(left + v / top * span + 4, y + bar - 4, f"{v:.2f}", 10)
                y += bar
            y += gap
        y += 18

    def legend(entries: list[tuple[str, str]]) -> None:
        nonlocal y
        x = left
        for color, what in entries:
            rect(x, y - 10, 12, 12, color, what)
            text(x + 16, y, what, 11)
            x += 20 + 7 * len(what)
        y += 22

    text(10, 22, f"{title}: {r['jobs']} jobs; sharing saved {r['gpu_hours_saved']:.2f} of "
                 f"{r['gpu_hours_one_per_gpu']:.2f} GPU-hours ({r['saved_fraction'] * 100:.1f} %)", 15, weight="bold")
    y = 50
    legend([("#4878a8", "GPU-hours"), ("#c05050", "of them held idle (memory, no GPU activity)")])
    chart("GPU-hours per user (each job counted one per GPU)",
          [(u["user"], [(u["gpu_hours"], "#4878a8", "GPU-hours"),
                        (u.get("gpu_hours_idle", 0.0), "#c05050", "GPU-hours held idle")]) for u in r["users"]],
          "GPU-hours")
    chart("GiB-hours of GPU memory budgeted per user",
          [(u["user"], [(u["gib_hours_budgeted"], "#e0a040", "GiB-hours")]) for u in r["users"]], "GiB-hours")
    legend([("#9aa7b4", "one job per GPU would take"), ("#4878a8", "GPUs busy (shared)"),
            ("#58a058", "saved")])
    chart("Per day (GPU-hours)", [(d["day"], [(d["gpu_hours_one_per_gpu"], "#9aa7b4", "one job per GPU"),
                                               (d["gpu_hours_busy"], "#4878a8", "GPUs busy"),
                                               (d["gpu_hours_saved"], "#58a058", "saved")])
                                  for d in r.get("days", [])], "GPU-hours")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{y:.0f}" viewBox="0 0 {W} {y:.0f}" '
            'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(out) + "\n</svg>\n")
