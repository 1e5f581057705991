"""Work on the event loop in slices, and replies made that way.

A listing of 50,000 jobs is a second or two of Python (`ls --json`: a summary each, most of them
encoded afresh); made in one go it held every other client, `hello` included, for that long. A
`Clock` gives the loop back between slices of about SLICE_S; a `Pieces` reply is written to its
connection a slice at a time (server.py), so that neither it nor a second copy of it is held
whole. What a sliced reply lists is taken in one step before its first slice (the open jobs and
the scheduler's decisions, both replaced, never changed in place): it is the daemon as of that
step, however the jobs change while it is encoded."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Iterator, Sequence, TypeVar

# About this long on the loop at a time, then the loop is left alone GAP: a request takes a few
# turns of the loop (accepted, its line read, answered), as the scheduler's slices found (SLICE_GAP
# there); a reply's slices give it the same room.
SLICE_S = 0.005
GAP = 0.002
CHUNK = 64  # items between two looks at the clock where each costs tens of µs (a summary encoded: ~40)
CHEAP = 4096  # where each costs a fraction of a µs (a comparison in a filter)

T = TypeVar("T")


class Clock:
    """When the current slice began; `turn()` ends it once it has run SLICE_S. Counts the slices
    and the longest (the work's own figures, as the scheduler's complete pass logs its own)."""

    __slots__ = ("at", "slices", "longest")

    def __init__(self) -> None:
        self.at = time.perf_counter()
        self.slices, self.longest = 1, 0.0

    async def turn(self) -> None:
        now = time.perf_counter()
        if now - self.at >= SLICE_S:
            self.longest = max(self.longest, now - self.at)
            self.slices += 1
            await asyncio.sleep(GAP)
            self.at = time.perf_counter()

    def end(self) -> None:
        self.longest = max(self.longest, time.perf_counter() - self.at)


async def chunks(seq: Sequence[T], clock: Clock, n: int = CHUNK) -> AsyncIterator[Sequence[T]]:
    """`seq` n items at a time, the clock looked at between two."""
    for k in range(0, len(seq), n):
        if k:
            await clock.turn()
        yield seq[k:k + n]


async def taken(items: Iterator[T], clock: Clock, n: int = CHUNK) -> AsyncIterator[list[T]]:
    """An iterator's items n at a time (a lazy merge), the clock looked at between two."""
    it = iter(items)
    first = True
    while True:
        part = [x for _, x in zip(range(n), it)]
        if not part:
            return
        if not first:
            await clock.turn()
        first = False
        yield part


class Pieces:
    """A result made a slice at a time: `parts` yields its JSON encoded, in order (the server writes
    each piece as it comes, behind the reply's head). `clock` has the slices' figures once done."""

    __slots__ = ("parts", "clock")

    def __init__(self, parts: AsyncIterator[bytes], clock: Clock):
        self.parts, self.clock = parts, clock
