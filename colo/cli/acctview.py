"""`colo history` and `colo report`: ended jobs as sacct shows them, and per user sums. No typer
(colo/cli/entry.py runs them straight from colo/cli/options.py's table)."""
from __future__ import annotations

import sys
import time

from ..client import Client
from ..textsafe import safe_all, safe_tree
from ..units import format_duration, format_size
from . import when
from .out import Fail, echo, print_json, table

HISTORY_TTY_ROWS = 200  # a terminal's bound on `colo history` without --limit; piped, every job


def _stamp(at) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at else "-"


def _report():
    from .. import report  # re, typing: loaded by the commands that need it

    return report


# column: (title, how a job's figures (colo.report.job_figures) become its cell)
COLUMNS = {
    "id": ("ID", lambda f: f["id"]),
    "name": ("NAME", lambda f: f["name"] or "-"),
    "user": ("USER", lambda f: str(f["user"])),
    "state": ("STATE", lambda f: str(f["state"])),
    "exit": ("EXIT", lambda f: "-" if f["exit_code"] is None else f["exit_code"]),
    "waited": ("WAITED", lambda f: format_duration(f["waited"])),
    "ran": ("RAN", lambda f: format_duration(f["ran"])),
    "gpus": ("GPUS", lambda f: f["gpus"]),
    "gpu-h": ("GPU-H", lambda f: f"{f['gpu_hours']:.2f}"),
    "budget": ("BUDGET", lambda f: format_size(f["budget"]) if f["budget"] else "-"),
    "slowdown": ("SLOWDOWN", lambda f: _report().times(f["slowdown"])),
    "started": ("STARTED", lambda f: _stamp(f["started_at"])),
    "ended": ("ENDED", lambda f: _stamp(f["ended_at"])),
}


DEFAULT = "id,name,user,state,exit,waited,ran,gpus,gpu-h,budget,slowdown"
_CHOSEN = ("name", "user", "state")  # texts users chose: escaped, a column at a time


def history(since: str | None = "7d", users: list[str] = (), limit: int | None = None, fmt: str | None = None,
            admin: bool = False, sock: str | None = None, as_json: bool = False) -> int:
    if limit is not None and limit < 0:
        raise Fail(f"--limit {limit}: a number of jobs, 0 or more (0: every job)")
    if admin:
        if users or fmt:
            raise Fail("--admin shows every admin action: --user and --format do not apply to it")
        return _admin_log(since, limit, sock, as_json)
    cols = [x.strip() for x in (fmt or DEFAULT).split(",") if x.strip()]
    bad = [x for x in cols if x not in COLUMNS]
    if bad or not cols:
        raise Fail(f"unknown column {bad[0] if bad else fmt!r} in --format: use {', '.join(COLUMNS)}")
    after = max(0.0, when.since(since)) if since else None
    bound = limit or (HISTORY_TTY_ROWS if limit is None and not as_json and sys.stdout.isatty() else None)
    got = Client(sock).history(after, list(users), bound)
    figs = list(map(_report().job_figures, got["jobs"]))
    if as_json:
        print_json(figs)
        return 0
    # Only the texts users chose are escaped, a column at a time (safe_tree over whole replies was
    # most of a long history's time); the other cells are colo's own numbers and words.
    cells = []
    for c in cols:
        col = list(map(COLUMNS[c][1], figs))
        cells.append(safe_all(col) if c in _CHOSEN else col)
    echo(table([list(r) for r in zip(*cells)] if figs else [], [COLUMNS[c][0] for c in cols]))
    if got["left"]:  # under the table on a terminal; piped, apart from the rows
        echo(f"({got['left']} older jobs in the period not shown: --limit N for more, --limit 0 for all)",
             err=not sys.stdout.isatty())
    return 0


def _admin_log(since: str | None, limit: int | None, sock: str | None, as_json: bool) -> int:
    """`colo history --admin`: who did what, when, to what and why; newest first."""
    after = max(0.0, when.since(since)) if since else None
    bound = limit or (HISTORY_TTY_ROWS if limit is None and not as_json and sys.stdout.isatty() else None)
    got = Client(sock).admin_log(after, bound)
    if as_json:
        print_json(got["actions"])
        return 0
    rows = [[_stamp(a["at"]), *safe_all([a["by"], a["action"], a["target"], a["why"] or "-"])]
            for a in got["actions"]]
    echo(table(rows, ["WHEN", "BY", "ACTION", "TARGET", "WHY"]))
    if got["left"]:
        echo(f"({got['left']} older actions in the period not shown: --limit N for more, --limit 0 for all)",
             err=not sys.stdout.isatty())
    return 0


def report(since: str | None = "7d", users: list[str] = (), svg: str | None = None, sock: str | None = None,
           as_json: bool = False) -> int:
    rp = _report()
    r = Client(sock).report(max(0.0, when.since(since)) if since else None, list(users))
    if svg is not None:
        try:  # the caller's own file, written as the caller
            span = "" if not since else f", last {since}" if since[-1:].isalpha() else f", since {since}"  # 7d, a date
            with open(svg, "w", encoding="utf-8") as f:
                f.write(rp.svg(r, f"colo report{span}"))
        except OSError as e:
            raise Fail(f"--svg {svg}: {e.strerror}") from None
    if as_json:
        print_json(r)
        return 0
    r = safe_tree(r)
    rows = [[u["user"], u["jobs"], u["succeeded"], u["failed"], f"{u['gpu_hours']:.2f}",
             f"{u.get('gpu_hours_idle', 0.0):.2f}",
             f"{u['gib_hours_budgeted']:.1f}", format_duration(u["wait_median"]), format_duration(u["wait_max"]),
             rp.times(u["slowdown_median"]), rp.times(u["slowdown_max"]), u["slowdown_jobs"]]
            for u in r["users"]]
    echo(table(rows, ["USER", "JOBS", "OK", "FAILED", "GPU-H", "IDLE GPU-H", "GIB-H BUDGETED", "WAIT P50",
                      "WAIT MAX", "SLOWDOWN P50", "MAX", "OF JOBS"]))
    echo("(slowdown: run time / the profile's run time alone, over the succeeded jobs that had a profile;")
    echo(" idle: GPU-hours of jobs holding GPU memory with no GPU activity for idle_after or longer)")
    echo("")
    echo(f"{r['jobs']} jobs ended in the period. One job per GPU they would have taken "
         f"{r['gpu_hours_one_per_gpu']:.2f} GPU-hours; the GPUs were busy {r['gpu_hours_busy']:.2f}: "
         f"sharing saved {r['gpu_hours_saved']:.2f} GPU-hours ({r['saved_fraction'] * 100:.1f} %).")
    if r["users"]:
        echo("")
        echo("\n".join(rp.bars([(u["user"], u["gpu_hours"]) for u in r["users"]], unit=" GPU-h")))
    if len(r["days"]) > 1:
        echo("\nGPU-hours saved per day:")
        echo("\n".join(rp.bars([(d["day"], d["gpu_hours_saved"]) for d in r["days"]], unit=" GPU-h")))
    if svg is not None:
        echo(f"\nwrote {svg}")
    return 0
