"""The daemon's log cannot be used to fill a disk: a place in the code that logs a warning or an
error again and again (a client flood at the descriptor limit, a write to a vanished client) has
its first few records a minute written, each without a traceback past the first, and the rest
counted and said in one line a minute ("N more like it in the last minute")."""
from __future__ import annotations

import logging
import time

BURST = 10  # records a minute from one place written as they are
WINDOW = 60.0  # seconds


class _Site:
    __slots__ = ("start", "seen", "dropped", "sample")

    def __init__(self, start: float):
        self.start, self.seen, self.dropped, self.sample = start, 0, 0, ""


class Summary(logging.Filter):
    """Counts WARNING and louder records by where they were logged (file and line: a bounded set,
    whatever the messages hold); INFO and DEBUG pass as they are."""

    def __init__(self, burst: int = BURST, window: float = WINDOW, clock=time.monotonic):
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self.sites: dict[tuple[str, int], _Site] = {}
        self.out: logging.Logger | None = None  # where summaries go (set by install)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "colo_summary", False):
            return True
        key, now = (record.pathname, record.lineno), self.clock()
        site = self.sites.get(key)
        if site is None or now - site.start >= self.window:
            if site is not None:
                self._say(site)
            site = self.sites[key] = _Site(now)
        site.seen += 1
        if site.seen > self.burst:
            site.dropped += 1
            if not site.sample:
                site.sample = _first_line(record)
            return False
        if site.seen > 1:  # a traceback once a minute from one place is enough to find it
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True

    def flush(self) -> None:
        """Say what was counted in windows that have ended (called about once a minute)."""
        now = self.clock()
        for key, site in list(self.sites.items()):
            if now - site.start >= self.window:
                self._say(site)
                del self.sites[key]

    def _say(self, site: _Site) -> None:
        if site.dropped and self.out is not None:
            self.out.warning("%d more like it in the last minute: %s", site.dropped, site.sample,
                             extra={"colo_summary": True})
        site.dropped = 0


def _first_line(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:  # noqa: BLE001 - a record whose arguments do not fit its format
        text = str(record.msg)
    return text.split("\n", 1)[0][:300]


def install() -> Summary:
    """The filter on every handler of the root logger (basicConfig's), or on colo's and asyncio's
    loggers where there is none; flush() it once a minute."""
    f = Summary()
    f.out = logging.getLogger("colo")
    handlers = logging.getLogger().handlers
    for h in handlers:
        h.addFilter(f)
    if not handlers:
        for name in ("colo", "asyncio"):
            logging.getLogger(name).addFilter(f)
    return f
