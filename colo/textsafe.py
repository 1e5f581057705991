"""Strings other users chose, made safe to put on a terminal (invariant 10).

A job's name, command, environment, workdir, a user name, a reason quoting any of them: each may
hold ESC sequences, newlines or carriage returns that would clear a screen, move the cursor or
forge a table row. Everything colo shows to a person (CLI tables, `colo top --once`, the Textual
app) goes through `safe()`/`safe_all()`/`safe_tree()`; `--json` keeps the exact values.

Escaped: C0 and C1 control characters (C1 0x9b is a CSI on many terminals), DEL, Unicode format
characters (bidi overrides, zero-width), line/paragraph separators and lone surrogates (from
bytes that were not UTF-8). They are written the way Python writes them: \\n, \\x1b, \\u202e.
A backslash is left as it is: escaping is for the screen's safety, not for a round trip.
"""
from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _esc(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    o = ord(ch)
    return f"\\x{o:02x}" if o < 0x100 else (f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")


def _bad(ch: str, keep: str) -> bool:
    if ch in keep:
        return False
    o = ord(ch)
    if o < 0x20 or 0x7F <= o <= 0x9F:
        return True
    if o <= 0x9F:
        return False
    import unicodedata  # here: plain ASCII, most text, never needs it (`colo ls` starts faster)

    return unicodedata.category(ch) in ("Cf", "Zl", "Zp", "Cs")


def safe(text: object, keep: str = "") -> str:
    """`text` with every control/format character escaped; characters in `keep` (e.g. "\\n" for a
    log shown line by line) pass through."""
    s = text if isinstance(text, str) else str(text)
    if s.isascii() and s.isprintable():  # most text: plain ASCII, nothing to escape
        return s
    return "".join(_esc(c) if _bad(c, keep) else c for c in s)


def safe_all(texts: list[str]) -> list[str]:
    """safe() of each of `texts` (a table's column); a column with nothing to escape, as most
    are, is checked in one go."""
    whole = "".join(texts)
    if whole.isascii() and whole.isprintable():
        return texts
    return [safe(t) for t in texts]


def safe_tree(obj: object) -> object:
    """A daemon reply with every string in it (dict keys too: environment names) made safe."""
    if isinstance(obj, str):
        return safe(obj)
    if isinstance(obj, dict):
        return {safe(k) if isinstance(k, str) else k: safe_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [safe_tree(v) for v in obj]
    return obj
