"""What commands print, and the one-line failure: shared by every command, typer or not.

Commands write through here (never a stream held from import time: the typer test runner swaps
sys.stdout), and raise Fail for a line on stderr and exit 1.
"""
from __future__ import annotations

import os
import sys

from ..textsafe import safe


class Fail(Exception):
    """One line for stderr (escaped: it may quote what a user typed), and the exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def echo(text: str = "", err: bool = False) -> None:
    s = sys.stderr if err else sys.stdout
    s.write(text + "\n")
    s.flush()


def warn(text: str) -> None:
    echo(f"colo: {safe(text)}", err=True)


def print_json(obj) -> None:
    import json

    # indented for people; compact (and several times faster) for pipes and scripts
    echo(json.dumps(obj, indent=2 if sys.stdout.isatty() else None, default=str))


def table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)).rstrip() for r in [header, *rows])


def write(text: str) -> int:
    """Prints `text` (and a newline); a reader that went away (`colo ls | head`) is no error."""
    if not text:
        return 0
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    return 0


def run(fn, kw: dict) -> int:
    """Call a command's function; its failures (Fail, the client's errors) as one line and exit 1,
    Ctrl-C as exit 130 without a traceback (the command says what goes on, where it matters)."""
    from ..client import ClientError

    try:
        return fn(**kw) or 0
    except Fail as e:
        warn(str(e))
        return e.code
    except ClientError as e:
        warn(str(e))
        return 1
    except KeyboardInterrupt:
        echo("", err=True)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
