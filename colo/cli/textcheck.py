"""What a command line's text may hold before it goes to the daemon."""
from __future__ import annotations

from ..textsafe import safe
from .out import Fail


def utf8_only(*fields: tuple[str, object]) -> None:
    """Refuse bytes that are not UTF-8 (Python carries them as lone surrogates). colo passes a job's
    command as text (JSON to the daemon, and on to Docker's API, which is JSON too), so such bytes
    cannot reach a container unchanged; they used to be replaced by U+FFFD without a word."""
    for what, value in fields:
        for i, v in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(v, str) and any("\udc80" <= ch <= "\udcff" for ch in v):
                raw = v.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                where = f"word {i + 1} of {what}" if isinstance(value, list) else what
                raise Fail(f"{where} holds bytes that are not UTF-8 ({safe(raw)}): colo carries commands "
                                  "as UTF-8 text; pass such bytes through a file or an escape the program "
                                  "decodes (e.g. printf '\\xff')")
