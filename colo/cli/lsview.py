"""`colo ls`: asks the daemon for the jobs and fields it prints, and prints them.

The daemon filters (states, users, names), picks the newest `--limit` and sends only the fields
the columns need, each job's as one short list (Api.ls); the table is then drawn a column at a
time, each column escaped in one go (textsafe.safe_all). `colo ls` runs without importing typer
(colo/cli/entry.py), as every daemon command does.

On a terminal, with no --limit, at most TTY_ROWS jobs are printed (every running one, then the
front of the queue, then the newest ended ones) and one line says what was left out; piped, every
job is printed, as squeue does. The queued tasks of an array share one row, 12_[3-9,11], as
squeue shows them (-r: a row each).
"""
from __future__ import annotations

import sys
import time
from itertools import repeat

from ..client import Client
from ..protocol import LS_STATES
from ..textsafe import safe, safe_all
from ..units import format_duration, format_size
from .out import Fail, write

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable

TTY_ROWS = 500
CUT = {"argv": 40, "reason": 60}  # characters of these texts shown, unless --wide
DEFAULT = "id,name,user,state,gpu,mode,budget,age,reason"


def _each(fn: Callable) -> Callable[[list], list[str]]:
    """fn over a column, called once per distinct value (a queue holds few budgets, few ages)."""
    def cells(col: list) -> list[str]:
        drawn = {v: fn(v) for v in set(col)}
        return list(map(drawn.__getitem__, col))
    return cells


# column: (title, the field the daemon sends, how that field's list becomes cells)
COLUMNS: dict[str, tuple[str, str, Callable[[list], list[str]] | None]] = {
    "id": ("ID", "id", lambda col: list(map(str, col))),
    "name": ("NAME", "name", lambda col: [v or "-" for v in col]),
    "user": ("USER", "user", lambda col: list(map(str, col))),
    "state": ("STATE", "state", lambda col: list(map(str, col))),
    "gpu": ("GPU", "gpus", lambda col: [v or "-" for v in col]),  # indices, as `colo gpus` numbers them
    "mode": ("MODE", "mode", lambda col: [v or "-" for v in col]),
    "budget": ("BUDGET", "budget", _each(lambda v: format_size(v) if v else "-")),
    "age": ("AGE", "submitted_at", None),  # drawn from the time now: below
    "exit": ("EXIT", "exit_code", lambda col: ["-" if v is None else str(v) for v in col]),
    "priority": ("PRIO", "priority", lambda col: [str(v or 0) for v in col]),
    "command": ("COMMAND", "argv", lambda col: [v or "" for v in col]),
    "reason": ("REASON", "reason", lambda col: [v or "" for v in col]),
    "array": ("ARRAY", "array", lambda col: [v or "-" for v in col]),
}


def _ages(col: list, now: float) -> list[str]:
    """How long ago each time was, as format_duration writes it: seconds are shown under an hour,
    minutes under a day, hours beyond, so an age is rounded to that first (a long queue has few
    distinct ages then, each written once)."""
    now_s = int(now)  # times come in whole seconds
    return _each(format_duration)([a if a < 3600 else a - a % 60 if a < 86400 else a - a % 3600
                                   for a in (now_s - t for t in col)])


def table(cols: list[list[str]], titles: list[str]) -> str:
    """Columns of cells (already safe) under their titles, padded to line up."""
    widths = [max(len(t), max(map(len, c), default=0)) for t, c in zip(titles, cols)]
    # a column at a time (str.ljust mapped in C), the last one not padded; 50,000 rows in ~0.1 s
    padded = [list(map(str.ljust, c, repeat(w))) for c, w in zip(cols[:-1], widths)] + cols[-1:]
    head = [t.ljust(w) for t, w in zip(titles[:-1], widths)] + titles[-1:]
    rows = map("  ".join, zip(*padded))
    if cols and any(not x or x[-1] == " " for x in cols[-1]):  # else no row ends in blanks: none to strip
        rows = map(str.rstrip, rows)
    return "\n".join(["  ".join(head).rstrip(), *rows])


def lines(reply: dict, cols: list[str], wide: bool, now: float) -> list[str]:
    """The table's text from ls's compact reply, and the line saying what a terminal's bound left out."""
    rows = reply["rows"]
    got = dict(zip(reply["fields"], zip(*rows) if rows else [()] * len(reply["fields"])))
    cells = []
    for c in cols:
        title, field, draw = COLUMNS[c]
        col = _ages(got[field], now) if c == "age" else draw(got[field])
        col = safe_all(col)
        if field in CUT and not wide:
            n = CUT[field]
            col = [s[:n] for s in col]  # after escaping, as the daemon's cut was before it
        cells.append(col)
    out = [table(cells, [COLUMNS[c][0] for c in cols])]
    left = reply.get("left") or {}
    if left:
        said = ", ".join(f"{n:,} {safe(st)}" for st, n in left.items())
        out.append(f"... {sum(left.values()):,} more jobs not shown ({said}): `colo ls --limit 0` lists every one; "
                   "-u, -s, -n narrow the list")
    return out


def ls(refs: list[str] = (), all_: bool = False, users: list[str] = (), states: list[str] = (),
       names: list[str] = (), quiet: bool = False, fmt: str | None = None, wide: bool = False, tasks: bool = False,
       limit: int | None = None, sock: str | None = None, as_json: bool = False) -> int:
    return write(run(Client(sock), all_, users, states, names, quiet, fmt, wide, limit, as_json, refs, tasks))


def run(c, all_: bool = False, users: list[str] = (), states: list[str] = (), names: list[str] = (),
        quiet: bool = False, fmt: str | None = None, wide: bool = False, limit: int | None = None,
        as_json: bool = False, refs: list[str] = (), tasks: bool = True) -> str:
    """What `colo ls` prints (without the last newline), from Client `c`; Fail for a bad option."""
    for st in states:
        if st not in LS_STATES:
            raise Fail(f"unknown state {st!r}: one of {', '.join(LS_STATES)}")
    lim = limit if limit and limit > 0 else None
    # refs (ids, names, arrays, ARRAY_INDEX) name ended jobs too
    filters = dict(all=all_ or bool(states) or bool(refs), limit=lim, users=list(users) or None,
                   states=list(states) or None, names=list(names) or None, refs=list(refs) or None)
    if as_json:
        import json

        jobs = c.ls(**filters)
        return json.dumps(jobs, indent=2 if sys.stdout.isatty() else None, default=str)
    if quiet:
        return "\n".join(str(r[0]) for r in c.ls_fields(["id"], **filters)["rows"])
    cols = [x.strip() for x in (fmt or DEFAULT).split(",") if x.strip()]
    bad = [x for x in cols if x not in COLUMNS]
    if bad or not cols:
        raise Fail(f"unknown column {bad[0] if bad else fmt!r} in --format: use {', '.join(COLUMNS)}")
    fields = list(dict.fromkeys(COLUMNS[x][1] for x in cols))
    head = TTY_ROWS if limit is None and sys.stdout.isatty() else None  # --limit 0: every job
    # (the daemon puts an array's queued tasks in one row unless -r)
    reply = c.ls_fields(fields, cut=None if wide else max(CUT.values()), head=head, tasks=tasks, **filters)
    return "\n".join(lines(reply, cols, wide, time.time()))
