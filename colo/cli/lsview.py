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
    now_s = int(now)  # times come in whole seconds
    return _each(format_duration)([now_s - t for t in col])


def table(cols: list[list[str]], titles: list[str]) -> str:
    """Columns of cells (already safe) under their titles, padded to line up."""
    widths = [max(len(t), max(map(len, c), default=0)) for t, c in zip(titles, cols)]
    fmt = "  ".join([*(f"{{:<{w}}}" for w in widths[:-1]), "{}"])  # the last one is not padded
    return "\n".join([fmt.format(*titles).rstrip(), *map(str.rstrip, map(fmt.format, *cols))])


def _ranges(ix: list[int]) -> str:
    """3,4,5,7 as Slurm writes a set of array indices: 3-5,7."""
    out, start = [], 0
    for k in range(1, len(ix) + 1):
        if k == len(ix) or ix[k] != ix[k - 1] + 1:
            out.append(str(ix[start]) if start == k - 1 else f"{ix[start]}-{ix[k - 1]}")
            start = k
    return ",".join(out)


def collapse(rows: list[list]) -> tuple[list[list], list[str | None]]:
    """Rows (each ending in its state and ARRAY_INDEX) with the queued tasks of an array in one
    row, the first's, and the ID each row shows then (12_[3-9]; None: the job's own)."""
    groups: dict[str, list[int]] = {}
    for k, r in enumerate(rows):
        if r[-2] == "queued" and r[-1]:
            groups.setdefault(r[-1].partition("_")[0], []).append(k)
    keep, ids = [], []
    firsts = {g[0]: g for g in groups.values() if len(g) > 1}
    skip = {k for g in firsts.values() for k in g[1:]}
    for k, r in enumerate(rows):
        if k in skip:
            continue
        g = firsts.get(k)
        keep.append(r)
        ids.append(None if g is None else
                   f"{r[-1].partition('_')[0]}_[{_ranges(sorted(int(rows[i][-1].partition('_')[2]) for i in g))}]")
    return keep, ids


def lines(reply: dict, cols: list[str], wide: bool, now: float, tasks: bool = True) -> list[str]:
    """The table's text from ls's compact reply (with `tasks` False, its last two fields are each
    row's state and ARRAY_INDEX: the queued tasks of an array share a row), and the line saying what
    a terminal's bound left out."""
    rows, shown_ids = reply["rows"], None
    if not tasks:
        rows, shown_ids = collapse(rows)
    got = dict(zip(reply["fields"], zip(*rows) if rows else [()] * len(reply["fields"])))
    cells = []
    for c in cols:
        title, field, draw = COLUMNS[c]
        col = _ages(got[field], now) if c == "age" else draw(got[field])
        if c in ("id", "array") and shown_ids is not None:
            col = [x if s is None else s for x, s in zip(col, shown_ids)]
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
    if not tasks:  # each row's state and ARRAY_INDEX last, for collapse()
        fields = [*fields, "state", "array"]
    head = TTY_ROWS if limit is None and sys.stdout.isatty() else None  # --limit 0: every job
    reply = c.ls_fields(fields, cut=None if wide else max(CUT.values()), head=head, **filters)
    return "\n".join(lines(reply, cols, wide, time.time(), tasks))
