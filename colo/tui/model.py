"""Turns one `client.top()` snapshot into rows, bars and sparklines. Pure: no Textual, no I/O.

Both the live app and the plain `--once` frame are drawn from these functions, so they agree.
"""
from __future__ import annotations

from ..units import format_duration, format_size

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Iterable

ACTIVE = ("starting", "running")
ENDED = ("succeeded", "failed", "cancelled", "lost")

STATE_STYLE = {
    "queued": "cyan", "starting": "yellow", "running": "green", "succeeded": "dim",
    "failed": "red", "cancelled": "dim yellow", "lost": "magenta", "foreign": "bright_red",
}
# A job keeps its colour in the table and in the GPU bars, so the eye can link them.
PALETTE = ("dodger_blue1", "green3", "orange1", "medium_purple1", "turquoise2", "gold1",
           "hot_pink", "chartreuse3")
FOREIGN_STYLE = "bright_red"
MPS_SERVER_STYLE = "grey62"
MODE_LABEL = {"mps": "MPS", "timesliced": "TS", "exclusive": "alone", "none": "cpu", None: "-"}

JOB_COLUMNS = (("id", "ID"), ("name", "NAME"), ("user", "USER"), ("gpu", "GPU"), ("mode", "MODE"),
               ("budget", "BUDGET"), ("used", "USED"), ("sm", "SM%"), ("time", "TIME"), ("state", "STATE"))
QUEUE_COLUMNS = (("pos", "#"), ("id", "ID"), ("name", "NAME"), ("user", "USER"), ("budget", "BUDGET"),
                 ("wait", "WAIT"), ("reason", "REASON"))
SORTS = ("default", "id", "user", "gpu", "budget", "used", "time", "state")

SPARK = "▁▂▃▄▅▆▇█"


def job_colour(job_id: int) -> str:
    return PALETTE[job_id % len(PALETTE)]


class Row:
    """One table row: `cells` are (text, style) pairs, so a change is a plain comparison. (A plain
    class: `colo top --once` loads this module, and dataclasses costs more than the frame.)"""

    __slots__ = ("key", "cells", "order", "job", "search")

    def __init__(self, key: str, cells: tuple, order: dict | None = None, job: dict | None = None,
                 search: str = ""):
        self.key, self.cells, self.order, self.job, self.search = key, cells, order or {}, job, search

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Row) and all(getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value (as the dataclass was)

    def matches(self, needle: str) -> bool:
        return not needle or needle.lower() in self.search


def gpu_indexes(snap: dict) -> dict[str, int]:
    return {g["uuid"]: g["index"] for g in snap.get("gpus", [])}


def gpu_label(uuids: Iterable[str], index: dict[str, int]) -> str:
    return ",".join(str(index.get(u, "?")) for u in uuids) or "-"


def run_seconds(job: dict, now: float) -> float | None:
    start = job.get("started_at")
    if start is None:
        return None
    end = job.get("ended_at") or now
    return max(0.0, end - start)


def job_sm(job: dict) -> int | None:
    v = job.get("sm_util")  # per-job SM % when the daemon reports it
    return v if isinstance(v, int) else None


def job_rows(snap: dict, now: float, gpu: str | None = None) -> list[Row]:
    """Started and ended jobs, then GPU processes colo does not manage; `gpu` keeps one GPU's only."""
    index = gpu_indexes(snap)
    rows = []
    for j in snap.get("jobs", []):
        if j["state"] == "queued" or (gpu and gpu not in (j.get("gpus") or [])):
            continue
        used = j.get("used")
        nvml = j.get("nvml_used")  # its processes as NVML sees them: past the ledger when it bypassed it
        over = nvml is not None and nvml > max(used or 0, j.get("budget") or 0)
        if over:
            used = nvml
        secs = run_seconds(j, now)
        sm = job_sm(j)
        ended = j["state"] in ENDED
        cells = (
            (str(j["id"]), job_colour(j["id"])),
            (_short(j.get("name") or _argv0(j)), ""),
            (j.get("user") or "?", ""),
            (gpu_label(j.get("gpus") or [], index), ""),
            (MODE_LABEL.get(j.get("mode"), str(j.get("mode"))), ""),
            (format_size(j["budget"]) if j.get("budget") else "-", ""),
            (format_size(used) if used is not None else "-", "bold red" if j.get("refused") or over else ""),
            (f"{sm}" if sm is not None else "-", ""),
            (format_duration(secs), ""),
            # a job holding GPU memory with no GPU activity for idle_after (the daemon's mark)
            ("suspended", "bold cyan") if j.get("suspended") and j["state"] == "running"  # colo suspend
            else ("idle", "bold yellow") if j.get("idle_since") and j["state"] == "running"
            else (j["state"], STATE_STYLE.get(j["state"], "")),
        )
        rows.append(Row(
            key=f"j{j['id']}", cells=cells, job=j,
            order={"default": (2 if ended else 0, -(j.get("ended_at") or 0) if ended else j["id"]),
                   "id": j["id"], "user": (j.get("user") or "", j["id"]),
                   "gpu": (cells[3][0], j["id"]), "budget": -(j.get("budget") or 0), "used": -(used or 0),
                   "time": -(secs or 0), "state": (j["state"], j["id"])},
            search=" ".join(c for c, _ in cells).lower() + " " + " ".join(j.get("argv") or []).lower()))
    for f in snap.get("foreign", []):
        if gpu and f["gpu"] != gpu:
            continue
        g = index.get(f["gpu"], "?")
        srv = is_mps_server(f)
        style = MPS_SERVER_STYLE if srv else FOREIGN_STYLE
        cells = ((str(f["pid"]), style), (_short(_command(f.get("command"))), "dim"), (f.get("user") or "?", ""),
                 (str(g), ""), ("-", ""), ("-", ""), (format_size(f.get("used")), style), ("-", ""),
                 ("-", ""), ("mps-server" if srv else "foreign", style))
        rows.append(Row(
            key=f"p{f['gpu']}:{f['pid']}", cells=cells, job=None,
            order={"default": (1, f["pid"]), "id": 1 << 62, "user": (f.get("user") or "", 0),
                   "gpu": (str(g), 0), "budget": 0, "used": -(f.get("used") or 0), "time": 0,
                   "state": ("foreign", 0)},
            search=" ".join(c for c, _ in cells).lower()))
    return rows


def queue(snap: dict) -> list[dict]:
    """Waiting jobs in the order the scheduler considers them: priority, then first come."""
    q = [j for j in snap.get("jobs", []) if j["state"] == "queued"]
    return sorted(q, key=lambda j: (-(j.get("priority") or 0), j.get("submitted_at") or 0, j["id"]))


def queue_rows(snap: dict, now: float) -> list[Row]:
    rows = []
    for pos, j in enumerate(queue(snap), 1):
        cells = ((str(pos), "dim"), (str(j["id"]), STATE_STYLE["queued"]), (_short(j.get("name") or _argv0(j)), ""),
                 (j.get("user") or "?", ""), (format_size(j["budget"]) if j.get("budget") else "-", ""),
                 (format_duration(now - j["submitted_at"]) if j.get("submitted_at") else "-", ""),
                 (j.get("reason") or "", "italic"))
        rows.append(Row(key=f"j{j['id']}", cells=cells, job=j, order={"default": pos},
                        search=" ".join(c for c, _ in cells[1:]).lower()))
    return rows


def _short(text: str, width: int = 14) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _command(cmdline: str | None) -> str:
    """A process's command line with the program's directory left out: the name is what tells."""
    words = (cmdline or "").split(" ", 1)
    return " ".join([words[0].rsplit("/", 1)[-1], *words[1:]]) if words[0] else "?"


def _argv0(j: dict) -> str:
    argv = j.get("argv") or []
    return argv[0].rsplit("/", 1)[-1] if argv else "-"


# GPUs ------------------------------------------------------------------------------------------

def gpu_jobs(snap: dict, g: dict) -> list[dict]:
    return [j for j in snap.get("jobs", []) if j["state"] in ACTIVE and g["uuid"] in (j.get("gpus") or [])]


def is_mps_server(f: dict) -> bool:
    """An MPS server or control daemon: colo's own overhead, not someone else's process."""
    return _command(f.get("command")).startswith("nvidia-cuda-mps")


def foreign_used(snap: dict, g: dict, mps_servers: bool = False) -> int:
    return sum(f.get("used") or 0 for f in snap.get("foreign", [])
               if f["gpu"] == g["uuid"] and is_mps_server(f) == mps_servers)


def mps_clients(g: dict) -> int:
    return sum(1 for p in g.get("processes", []) if p.get("mps"))


def mps_label(g: dict) -> tuple[str, str]:
    """The GPU's state word: its MPS server, that the driver stopped answering for it, or that an
    admin drained it."""
    if g.get("error"):
        return "NVML ERR", "bold white on red"
    if g.get("drained"):  # colo drain: what the admin wrote is in colo gpus
        return "DRAINED", "bold black on yellow"
    state = g.get("mps") or "off"
    if state == "active":
        return f"MPS {mps_clients(g)}", "green"
    if state == "fault":
        return "MPS FAULT", "bold white on red"
    return "MPS off", "dim"


def bar_parts(snap: dict, g: dict) -> list[tuple[int, str, str]]:
    """(bytes, glyph, style) from left to right: each job's use then the rest of its budget,
    foreign use, free, and the reserve colo keeps back."""
    parts = []
    for j in sorted(gpu_jobs(snap, g), key=lambda j: j["id"]):
        budget = j.get("budget") or 0
        used = j.get("used")
        per_gpu = min(budget, (used or 0) // max(1, len(j.get("gpus") or [1])))
        colour = job_colour(j["id"])
        parts += [(per_gpu, "█", colour), (budget - per_gpu, "▒", colour)]
    total = g.get("total") or 0
    usable = min(g.get("usable") or total, total)
    srv = foreign_used(snap, g, mps_servers=True)
    fu = foreign_used(snap, g) + srv
    parts.append((srv, "█", MPS_SERVER_STYLE))
    parts.append((fu - srv, "█", FOREIGN_STYLE))
    budgeted = sum(p[0] for p in parts) - fu
    parts.append((max(0, usable - budgeted - fu), "·", "grey37"))
    parts.append((max(0, total - max(usable, budgeted + fu)), "╳", "grey23"))
    return parts


def bar_cells(parts: list[tuple[int, str, str]], width: int) -> list[tuple[str, str]]:
    """Cut `width` cells at the rounded cumulative boundaries, so the widths always add up."""
    total = sum(max(0, p[0]) for p in parts)
    if width <= 0:
        return []
    if total <= 0:
        return [("·" * width, "grey37")]
    out, cum, edge = [], 0, 0
    for size, glyph, style in parts:
        cum += max(0, size)
        nxt = round(cum * width / total)
        if nxt > edge:
            out.append((glyph * (nxt - edge), style))
        edge = nxt
    return out


def spark(values: Iterable[int | None], width: int) -> str:
    vals = list(values)[-width:] if width > 0 else []
    s = "".join(" " if v is None else SPARK[min(len(SPARK) - 1, max(0, int(v)) * len(SPARK) // 101)] for v in vals)
    return s.rjust(width)


def pct(v: int | None) -> str:
    return "  -" if v is None else f"{v:>3d}"


def mem_text(g: dict) -> str:
    return f"{format_size(g.get('used'))}/{format_size(g.get('total'))}"


def counts(snap: dict) -> dict[str, int]:
    """Jobs per state; the queued ones as the daemon counts them (it sends the front of the queue only)."""
    c: dict[str, int] = {}
    for j in snap.get("jobs", []):
        c[j["state"]] = c.get(j["state"], 0) + 1
    if "queued" in snap:
        c["queued"] = snap["queued"]
    return c
