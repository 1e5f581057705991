"""`colo top --once`: one plain-text frame (no Textual, no colour) for scripts, ssh and bug reports."""
from __future__ import annotations

import time

from ..textsafe import safe_tree
from . import model


def header(snap: dict, now: float) -> str:
    c = model.counts(snap)
    parts = [f"colo top · {snap.get('you', '?')}", f"{len(snap.get('gpus', []))} GPU(s)",
             f"{c.get('running', 0) + c.get('starting', 0)} running", f"{c.get('queued', 0)} queued",
             time.strftime("%H:%M:%S", time.localtime(now))]
    if snap.get("fake"):
        parts.append("simulated GPUs")
    return " · ".join(parts)


def gpu_line(snap: dict, g: dict, width: int, sm_hist=(), bw_hist=(), spark_w: int = 0) -> list[tuple[str, str]]:
    """One GPU as (text, style) pieces: index, name, memory bar, use, SM/BW %, MPS."""
    name_w = 18 if width >= 100 else 10
    mps_text, mps_style = model.mps_label(g)
    mem = model.mem_text(g)
    tail = [(f" {mem:>15} ", ""), ("SM ", "dim"), (model.pct(g.get("sm_util")) + "%", "")]
    if spark_w:
        tail.append((model.spark(sm_hist, spark_w), "green"))
    tail += [(" BW ", "dim"), (model.pct(g.get("mem_util")) + "%", "")]
    if spark_w:
        tail.append((model.spark(bw_hist, spark_w), "cyan"))
    tail.append((f" {mps_text:<9}", mps_style))
    name = (g.get("name") or "?").removeprefix("NVIDIA ")
    head = [(f"{g['index']:>2} ", "bold"), (f"{name[:name_w]:<{name_w}} ", "")]
    fixed = sum(len(t) for t, _ in head + tail) + 2
    bar = model.bar_cells(model.bar_parts(snap, g), max(4, width - fixed))
    return head + [("▕", "dim")] + bar + [("▏", "dim")] + tail


def table(columns, rows: list[model.Row], width: int, flex: int | None = None) -> list[str]:
    """Aligned columns; column `flex` is cut short when the line would pass `width`."""
    titles = [t for _, t in columns]
    widths = [max([len(t)] + [len(r.cells[i][0]) for r in rows]) for i, t in enumerate(titles)]
    excess = sum(widths) + 2 * (len(widths) - 1) - width
    if flex is not None and excess > 0:
        widths[flex] = max(len(titles[flex]), widths[flex] - excess)

    def line(cells: list[str]) -> str:
        out = [c[:w].ljust(w) for c, w in zip(cells, widths)]
        out[-1] = cells[-1]  # never cut the last column: it holds the reason a job waits
        return "  ".join(out).rstrip()

    return [line(titles)] + [line([c for c, _ in r.cells]) for r in rows]


def render_frame(snap: dict, now: float | None = None, width: int = 100, height: int = 0) -> str:
    """The frame; with `height`, the job and queue tables are cut so that it fits in that many lines."""
    now = time.time() if now is None else now
    snap = safe_tree(snap)  # names, commands, reasons are other users' text
    width = max(60, width)
    out = [header(snap, now)]
    if snap.get("gpu_error"):
        out.append(f"GPU error: {snap['gpu_error']}")
    out.append("")
    gpus = snap.get("gpus", [])
    if not gpus:
        out.append("no GPUs")
    for g in gpus:
        out.append("".join(t for t, _ in gpu_line(snap, g, width)))
    out.append("")
    rows = model.job_rows(snap, now)
    out.append("JOBS" if rows else "JOBS (none)")
    if rows:
        rows.sort(key=lambda r: r.order["default"])
        out += table(model.JOB_COLUMNS, rows, width, flex=1)
    q = model.queue_rows(snap, now)
    waiting = model.counts(snap).get("queued", len(q))
    out.append("")
    out.append(f"QUEUE ({waiting} waiting)" if q else "QUEUE (empty)")
    if q:
        out += table(model.QUEUE_COLUMNS, q, width)
        if waiting > len(q):
            out.append(f"… {waiting - len(q)} more (colo ls)")
    if height and len(out) > height:
        out = _fit(out, height)
    return "\n".join(out) + "\n"


def _fit(out: list[str], height: int) -> list[str]:
    """Cut the longest table (jobs or queue) from its end until the frame fits, saying how many went."""
    jobs_at = next(i for i, ln in enumerate(out) if ln.startswith("JOBS"))
    queue_at = next(i for i, ln in enumerate(out) if ln.startswith("QUEUE"))
    head, jobs, queue = out[:jobs_at + 2], out[jobs_at + 2:queue_at - 1], out[queue_at:]
    qhead, qrows = queue[:2], queue[2:]
    budget = max(2, height - len(head) - 1 - len(qhead))  # rows left for both tables, with a line each
    nq = min(len(qrows), max(1, budget // 2) if jobs else budget)
    nj = min(len(jobs), budget - nq)
    nq = min(len(qrows), budget - nj)

    def cut(rows: list[str], n: int) -> list[str]:
        if n >= len(rows):
            return rows
        return rows[:max(0, n - 1)] + [f"… {len(rows) - max(0, n - 1)} more (colo ls --all)"]

    return (head + cut(jobs, nj) + [""] + qhead + cut(qrows, nq))[:height]


def once(client, lines: int | None = None) -> int:
    """`colo top --once`: one frame from the daemon's snapshot (a screenful on a terminal; everything
    into a pipe or file, or `lines`)."""
    import os
    import sys

    from ..client import ClientError

    try:
        snap = client.top()
    except ClientError as e:
        print(f"colo top: {e}", file=sys.stderr)
        return 1
    try:  # as shutil.get_terminal_size reads it (shutil itself loads bz2 and lzma)
        cols, rows = os.get_terminal_size(sys.__stdout__.fileno())
    except (OSError, ValueError, AttributeError):
        cols, rows = 100, 0
    cols = int(os.environ.get("COLUMNS", "0") or 0) or cols
    rows = int(os.environ.get("LINES", "0") or 0) or rows
    if lines is None:
        lines = rows if sys.stdout.isatty() else 0
    sys.stdout.write(render_frame(snap, width=cols, height=max(0, lines)))
    return 0
