"""Times people type on a command line: a duration (90s, 10m, 2h, 1d, 2w), a time back from now
(--since, --before) and a time to start at (--begin, as sbatch reads it). Each is read by hand:
`colo` starts without `re`."""
from __future__ import annotations

import time

from .out import Fail

_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def duration(text: str) -> float | None:
    """Seconds from "90s", "10m", "2h", "1.5d", "2w"; None if it is not one."""
    t = (text or "").strip()
    num, unit = t[:-1].rstrip(), t[-1:]
    whole, dot, frac = num.partition(".")
    if unit not in _UNIT or not whole.isascii() or not whole.isdigit() or (dot and not (frac.isascii() and frac.isdigit())):
        return None
    return float(num) * _UNIT[unit]


def _iso(text: str) -> float | None:
    from datetime import datetime

    try:
        return datetime.fromisoformat(text.strip()).timestamp()  # no zone given: local time
    except ValueError:
        return None


def since(text: str, opt: str = "--since") -> float:
    """Epoch seconds from a duration back from now (90s, 10m, 2h, 1d) or a local ISO 8601 time."""
    d = duration(text)
    if d is not None:
        return time.time() - d
    t = _iso(text)
    if t is None:
        raise Fail(f"malformed {opt} {text!r}: a duration back from now (10m, 2h, 1d) or a time "
                   "(2026-11-22T14:00, 2026-11-22 14:00:05+00:00)")
    return t


def begin(text: str, now: float | None = None) -> float:
    """--begin as sbatch reads it: HH:MM[:SS] (the next time the clock shows it), a local date or
    time (2026-11-30, 2026-11-30T08:00), now+DURATION (now+1h; a bare number is seconds), now,
    today, tomorrow, midnight, noon. Epoch seconds."""
    now = time.time() if now is None else now
    t = text.strip().lower()
    lt = time.localtime(now)
    day0 = time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday, 0, 0, 0, 0, 0, -1))
    if t == "now":
        return now
    if t.startswith("now+"):
        rest = t[4:]
        d = float(rest) if rest.isascii() and rest.isdigit() else duration(rest)
        if d is not None:
            return now + d
    named = {"today": day0, "midnight": day0 + 86400, "tomorrow": day0 + 86400, "noon": day0 + 43200}
    if t in named:
        at = named[t]
        return at + 86400 if t == "noon" and at <= now else at
    parts = t.split(":")
    if 2 <= len(parts) <= 3 and all(p.isascii() and p.isdigit() and len(p) <= 2 for p in parts):
        h, m, s = (int(p) for p in (parts + ["0"])[:3])
        if h < 24 and m < 60 and s < 60:
            at = time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday, h, m, s, 0, 0, -1))
            return at if at > now else time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday + 1, h, m, s, 0, 0, -1))
    at = _iso(text)
    if at is None:
        raise Fail(f"malformed --begin {text!r}: HH:MM, a date or time (2026-11-30T08:00), now+1h, tomorrow, "
                   "midnight or noon")
    return at


def delay(text: str) -> float:
    d = duration(text)
    if d is None:
        raise Fail(f"malformed --delay {text!r}: a duration such as 90s, 10m, 2h or 1d")
    return d
