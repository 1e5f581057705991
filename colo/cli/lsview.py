"""`colo ls`: asks the daemon for the jobs and fields it prints, and prints them.

The daemon filters (states, users, names), picks the newest `--limit` and sends only the fields
the columns need, each job's as one short list (Api.ls); the table is then drawn a column at a
time, each column escaped in one go (textsafe.safe_all). `colo ls` is also a short path of the console
script (colo/cli/entry.py): it runs without importing typer, as `colo submit` does; an option the
short path does not know sends the command to the typer app, which prints through run() too.

On a terminal, with no --limit, at most TTY_ROWS jobs are printed (every running one, then the
front of the queue, then the newest ended ones) and one line says what was left out; piped, every
job is printed, as squeue does.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

from ..protocol import LS_STATES
from ..textsafe import safe, safe_all
from ..units import format_duration, format_size

TTY_ROWS = 500
CUT = {"argv": 40, "reason": 60}  # characters of these texts shown, unless --wide
DEFAULT = "id,name,user,state,gpu,mode,budget,age,reason"


def _each(fn: Callable) -> Callable[[list], list[str]]:
    """fn over a column, called once per distinct value (a queue holds few budgets, few ages)."""
    def cells(col: list) -> list[str]:
        drawn = {v: fn(v) for v in set(col)}
        return list(map(drawn.__getitem__, col))
    return cells


def _gpus(g: str) -> str:
    return ",".join(u[:12] for u in g.split(",")) if g else "-"


# column: (title, the field the daemon sends, how that field's list becomes cells)
COLUMNS: dict[str, tuple[str, str, Callable[[list], list[str]]]] = {
    "id": ("ID", "id", lambda col: list(map(str, col))),
    "name": ("NAME", "name", lambda col: [v or "-" for v in col]),
    "user": ("USER", "user", lambda col: list(map(str, col))),
    "state": ("STATE", "state", lambda col: list(map(str, col))),
    "gpu": ("GPU", "gpus", _each(_gpus)),
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


class Failed(Exception):
    """One line for stderr; exit 1."""


def table(cols: list[list[str]], titles: list[str]) -> str:
    """Columns of cells (already safe) under their titles, padded to line up."""
    widths = [max(len(t), max(map(len, c), default=0)) for t, c in zip(titles, cols)]
    fmt = "  ".join([*(f"{{:<{w}}}" for w in widths[:-1]), "{}"])  # the last one is not padded
    return "\n".join([fmt.format(*titles).rstrip(), *map(str.rstrip, map(fmt.format, *cols))])


def lines(reply: dict, cols: list[str], wide: bool, now: float) -> list[str]:
    """The table's text from ls's compact reply, and the line saying what a terminal's bound left out."""
    got = dict(zip(reply["fields"], zip(*reply["rows"]) if reply["rows"] else [()] * len(reply["fields"])))
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


def run(c, all_: bool = False, users: list[str] = (), states: list[str] = (), names: list[str] = (),
        quiet: bool = False, fmt: str | None = None, wide: bool = False, limit: int | None = None,
        as_json: bool = False, refs: list[str] = ()) -> str:
    """What `colo ls` prints (without the last newline), from Client `c`; Failed for a bad option."""
    for st in states:
        if st not in LS_STATES:
            raise Failed(f"unknown state {st!r}: one of {', '.join(LS_STATES)}")
    lim = limit if limit and limit > 0 else None
    # refs (ids, names, arrays, ARRAY_INDEX) name ended jobs too
    filters = dict(all=all_ or bool(states) or bool(refs), limit=lim, users=list(users) or None,
                   states=list(states) or None, names=list(names) or None, refs=list(refs) or None)
    if as_json:
        jobs = c.ls(**filters)
        return json.dumps(jobs, indent=2 if sys.stdout.isatty() else None, default=str)
    if quiet:
        return "\n".join(str(r[0]) for r in c.ls_fields(["id"], **filters)["rows"])
    cols = [x.strip() for x in (fmt or DEFAULT).split(",") if x.strip()]
    bad = [x for x in cols if x not in COLUMNS]
    if bad or not cols:
        raise Failed(f"unknown column {bad[0] if bad else fmt!r} in --format: use {', '.join(COLUMNS)}")
    fields = list(dict.fromkeys(COLUMNS[x][1] for x in cols))
    head = TTY_ROWS if limit is None and sys.stdout.isatty() else None  # --limit 0: every job
    reply = c.ls_fields(fields, cut=None if wide else max(CUT.values()), head=head, **filters)
    return "\n".join(lines(reply, cols, wide, time.time()))


# the short path ---------------------------------------------------------------------------------
_FLAGS = {"-a": "all_", "--all": "all_", "-q": "quiet", "--quiet": "quiet", "-w": "wide", "--wide": "wide",
          "--json": "as_json"}
_OPTS = {"-u": "users", "--user": "users", "-s": "states", "--state": "states", "-n": "names", "--name": "names",
         "-o": "fmt", "--format": "fmt", "--limit": "limit", "--socket": "socket"}


def parse(args: list[str]) -> dict | None:
    """`colo ls ARGS` as the typer command reads them; None for anything else (--help, -aq, ...)."""
    o: dict = {"users": [], "states": [], "names": [], "refs": [], "socket": None}
    i = 0
    while i < len(args):
        a = args[i]
        if a in _FLAGS:
            o[_FLAGS[a]] = True
            i += 1
            continue
        if not a.startswith("-"):  # a job: id, name, array, ARRAY_INDEX
            o["refs"].append(a)
            i += 1
            continue
        key, eq, val = a.partition("=") if a.startswith("--") else (a, "", "")
        if key not in _OPTS:
            return None
        if not eq:
            if i + 1 >= len(args):
                return None
            val = args[i + 1]
        i += 1 if eq else 2
        k = _OPTS[key]
        if k == "limit":
            try:
                o[k] = int(val)
            except ValueError:
                return None
        elif k in ("users", "states", "names"):
            o[k].append(val)
        else:
            o[k] = val
    return o


def run_fast(args: list[str]) -> int | None:
    """`colo ls ARGS` without typer; None when the full command must handle it."""
    o = parse(args)
    if o is None:
        return None
    from ..client import Client, ClientError

    sock = o.pop("socket") or os.environ.get("COLO_SOCKET") or None
    try:
        out = run(Client(sock), **o)
    except (Failed, ClientError) as e:
        sys.stderr.write(f"colo: {safe(str(e))}\n")
        return 1
    return write(out)


def write(out: str) -> int:
    """Prints `out`; a reader that went away (`colo ls | head`) is no error to report."""
    if not out:
        return 0
    try:
        sys.stdout.write(out + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    return 0
