"""Sizes and durations as people type them ("4GiB", "512M") and as colo prints them."""
from __future__ import annotations

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_DIGITS = frozenset("0123456789")  # ASCII only: str.isdecimal() would take "٤" and "４" too


def _split_size(text: str) -> tuple[str, str] | None:
    """("4.5", "GiB") from " 4.5 GiB ": digits[.digits], then ASCII letters, blanks around; else None.
    (By hand, not a regex: `colo submit` does not import `re` for it.)"""
    t = text.strip()
    i = 0
    while i < len(t) and (t[i] in _DIGITS or t[i] == "."):
        i += 1
    num, unit = t[:i], t[i:].lstrip()
    whole, dot, frac = num.partition(".")
    if not whole or "." in frac or (dot and not frac) or not all(c in _LETTERS for c in unit):
        return None
    return num, unit


class BadSize(ValueError):
    pass


def parse_size(text: str | int) -> int:
    """Bytes from "4GiB", "4G" (binary, as docker reads it), "4GB" (decimal) or a plain number of bytes."""
    if isinstance(text, int):
        value = text
    else:
        m = _split_size(str(text))
        if not m or m[1].lower() not in _UNITS:
            raise BadSize(f"malformed size {text!r}: use a positive number with a unit, e.g. 512MiB or 4GiB")
        value = int(float(m[0]) * _UNITS[m[1].lower()])
    if value <= 0:
        raise BadSize(f"size {text!r} must be greater than zero")
    return value


def format_size(n: int | float | None) -> str:
    """Short binary size: 4.0GiB, 512MiB, 0B."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)}B"
            return f"{n:.1f}{unit}" if abs(n) < 10 else f"{n:.0f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"


def format_size_exact(n: int | None) -> str:
    """A size with nothing rounded away, where a decision turns on it: 15.75GiB, 16GiB, 1,000,001B."""
    if n is None:
        return "-"
    n = int(n)
    for unit, f in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= f and (n * 100) % f == 0:  # exact with at most two decimals
            return f"{n / f:.2f}".rstrip("0").rstrip(".") + unit
    return f"{n:,}B"


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(max(0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"
