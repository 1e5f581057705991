"""When to try again what the engine refused."""
from __future__ import annotations


class Backoff:
    """When to try again what the engine refused: after 1 s, then twice as long each time, at most
    `cap` apart, so an engine that keeps refusing costs a call a minute, not a loop."""

    def __init__(self, first: float = 1.0, cap: float = 60.0):
        self.first, self.cap = first, cap
        self.delay = 0.0
        self.at: float | None = None  # monotonic time of the next try; None: nothing to try
        self.tries = 0

    def due(self, now: float) -> bool:
        return self.at is not None and now >= self.at

    def failed(self, now: float) -> float:
        """One more refusal: the delay before the next try."""
        self.tries += 1
        self.delay = min(self.cap, self.delay * 2 if self.delay else self.first)
        self.at = now + self.delay
        return self.delay

    def clear(self) -> None:
        self.delay, self.at, self.tries = 0.0, None, 0
