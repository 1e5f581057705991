"""A command line read by colo/cli/options.py's table, as click reads it, without importing click.

The common case only: long options (`--name V`, `--name=V`), short ones (`-n V`, `-nV`, flags
together as `-aq`), `--` ending options, repeated options as lists, positional arguments (options
between them unless the command says otherwise). Anything else (--help, an unknown option, a value
that is not a number where one is wanted, a missing argument) gives None: the typer command then
answers it, with click's own words.
"""
from __future__ import annotations

import os

from .options import Cmd, Opt


def parse(cmd: Cmd, args: list[str]) -> dict | None:
    """The keyword arguments cmd.run takes for `args`, or None."""
    opts: dict[str, Opt] = {}
    positional = []
    for p in cmd.params:
        if isinstance(p, Opt):
            for n in p.names:
                opts[n] = p
        else:
            positional.append(p)
    out: dict = {p.dest: list(p.default) if p.many else p.default for p in cmd.params if isinstance(p, Opt)}
    words: list[str] = []
    i, n = 0, len(args)
    while i < n:
        a = args[i]
        i += 1
        if a == "--":
            words += args[i:]
            break
        if a[:1] != "-" or a == "-":
            words.append(a)
            if not cmd.interspersed:
                words += args[i:]
                break
            continue
        if a[:2] == "--":
            name, eq, val = a.partition("=")
            o = opts.get(name)
            if o is None or (eq and o.type is bool):
                return None
            if o.type is bool:
                out[o.dest] = True
                continue
            if not eq:
                if i >= n:
                    return None
                val = args[i]
                i += 1
        else:  # -x, -xVALUE, -abc (flags)
            o = opts.get(a[:2])
            if o is None:
                return None
            if o.type is bool:
                for ch in a[1:]:
                    f = opts.get("-" + ch)
                    if f is None or f.type is not bool:
                        return None
                    out[f.dest] = True
                continue
            if len(a) > 2:
                val = a[2:]
            elif i < n:
                val = args[i]
                i += 1
            else:
                return None
        if o.type is not str:
            try:
                val = o.type(val)
            except ValueError:
                return None
            if o.min is not None and val < o.min:
                return None
        if o.many:
            out[o.dest].append(val)
        else:
            out[o.dest] = val
    for p in cmd.params:
        if isinstance(p, Opt) and p.envvar and out[p.dest] is None:
            out[p.dest] = os.environ.get(p.envvar) or None
    for p in positional:
        if p.many:
            out[p.dest], words = words, []
        elif words:
            out[p.dest] = words.pop(0)
        elif p.required:
            return None
        else:
            out[p.dest] = None
        if p.many and p.required and not out[p.dest]:
            return None
    return None if words else out
