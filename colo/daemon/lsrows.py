"""ls's rows: those kept encoded between listings (Kept), and the few ways a reply puts rows of
different sources in one order by id (the queue's, the active jobs', the ended ones'), with Slurm's
text for a set of array indices."""
from __future__ import annotations

import bisect
from operator import itemgetter
from typing import TYPE_CHECKING, Callable, TypeVar

if TYPE_CHECKING:
    from ..jobs import Job

T = TypeVar("T")


class Kept:
    """Rows kept encoded, by job id, each with the Job and the reason it was made from, in three dicts
    rather than a tuple a job. The cyclic collector tracks no dict of atoms (rows, reasons) and walks
    one of Jobs as one object, where it walked 50,000 tuples one by one: the collection that settles
    what a first listing of 50,000 queued jobs left young (passcost.held) took 16-37 ms of the loop on
    a quiet machine; a script walks 50,000 such rows held this way in 0.3-1.4 ms. The queue's block is kept as columns for the same reason
    (Listing._blocks); a reply that must sort rows among others makes tuples for its own length only."""

    __slots__ = ("row", "job", "why")

    def __init__(self) -> None:
        self.row: dict[int, bytes] = {}
        self.job: dict[int, Job] = {}
        self.why: dict[int, str | None] = {}

    def put(self, job: Job, why: str | None, row: bytes) -> None:
        self.row[job.id], self.job[job.id], self.why[job.id] = row, job, why

    def only(self, keep) -> "Kept":
        """A copy with only the jobs in `keep` (a container of ids)."""
        out = Kept()
        out.row = {i: r for i, r in self.row.items() if i in keep}
        out.job = {i: self.job[i] for i in out.row}
        out.why = {i: self.why[i] for i in out.row}
        return out


def spliced(ids: list[int], rows: list[bytes], act: list[tuple]) -> list[bytes]:
    """The queue's rows (`rows`, of the jobs `ids`, by id) with the few active jobs' (id, state, row)
    put in their places, by id."""
    if not act:
        return rows
    out = list(rows)
    for i, _, r in sorted(act, reverse=True):  # from the last: each place is as `ids` says
        out.insert(bisect.bisect(ids, i), r)
    return out


def merged(a: list[T], b: list[T], key: Callable[[T], int] = itemgetter(0)) -> list[T]:
    """Two lists sorted by id (`key`: an item's id; rows' first field by default), as one (b is
    short: the active jobs)."""
    if not b:
        return a
    out = list(a)
    for x in b:
        bisect.insort(out, x, key=key)
    return out


def ranges(ix: list[int]) -> str:
    """3,4,5,7 (sorted) as Slurm writes a set of array indices: 3-5,7."""
    if len(ix) > 1 and ix[-1] - ix[0] == len(ix) - 1:  # (distinct) one run, as most arrays are
        return f"{ix[0]}-{ix[-1]}"
    out, start = [], 0
    for k in range(1, len(ix) + 1):
        if k == len(ix) or ix[k] != ix[k - 1] + 1:
            out.append(str(ix[start]) if start == k - 1 else f"{ix[start]}-{ix[k - 1]}")
            start = k
    return ",".join(out)
