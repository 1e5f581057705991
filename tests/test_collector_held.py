"""The cyclic collector is held off while the daemon's sliced work runs (issue 41): a listing of
50,000 jobs, or a complete pass, holds a snapshot of the queue for a second or two, and every
collection meanwhile walked it, the loop's other clients waiting. passcost.held() turns the
collector off for as long as any such work is under way and settles what the work left behind.
The real collector, in this process; nothing of colo's is replaced."""
from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from colo.daemon import passcost
from colo.daemon.lsrows import Kept
from colo.jobs import Job, JobSpec


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    """A reference cycle, already garbage: only the collector can free it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def collector():
    assert gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable()


def test_the_collector_is_off_until_the_last_of_overlapping_works_ends():
    outer = passcost.held()
    outer.__enter__()
    assert not gc.isenabled()
    with pytest.raises(RuntimeError):
        with passcost.held():  # a listing that fails while a pass runs
            assert not gc.isenabled()
            raise RuntimeError("a listing failed")
    assert not gc.isenabled(), "one work's end turned the collector on while another still ran"
    outer.__exit__(None, None, None)
    assert gc.isenabled()


def test_what_a_work_leaves_is_settled_at_its_end_and_garbage_is_not_frozen():
    gc.collect()
    frozen = gc.get_freeze_count()
    with passcost.held():
        gone = cycle()
        kept = [[i] for i in range(passcost.SETTLE_YOUNG + 5000)]  # the rows a long listing keeps
        assert gone() is not None  # held: nothing collected it
    assert gone() is None, "a cycle that was garbage when the work ended was frozen, never to be freed"
    assert gc.get_freeze_count() - frozen >= len(kept), "what the work keeps is still walked by every collection"
    assert gc.get_count()[0] < 1000


def test_a_short_work_leaves_the_collector_as_it_was():
    gc.collect()
    frozen = gc.get_freeze_count()
    with passcost.held():
        gone = cycle()
    assert gc.get_freeze_count() == frozen  # nothing kept: no collection of its own
    gc.collect()
    assert gone() is None


def test_works_that_overlap_without_end_are_settled(monkeypatch):
    monkeypatch.setattr(passcost, "HELD_MAX", 0.0)
    outer = passcost.held()
    outer.__enter__()
    try:
        gone = cycle()
        with passcost.held():  # one more listing while one has been under way past HELD_MAX
            assert gone() is None, "garbage waits as long as works overlap"
            assert not gc.isenabled()
    finally:
        outer.__exit__(None, None, None)


def test_on_the_loop_what_a_work_leaves_is_settled_in_a_turn_of_its_own():
    async def go() -> None:
        gc.collect()
        frozen = gc.get_freeze_count()
        with passcost.held():
            kept = [[i] for i in range(passcost.SETTLE_YOUNG + 5000)]
        assert gc.get_freeze_count() == frozen, "settled on top of the work's last slice"
        assert not gc.isenabled(), "the collector was on before what the work left was settled"
        await asyncio.sleep(0)
        assert gc.get_freeze_count() - frozen >= len(kept)
        assert gc.isenabled()

    asyncio.run(go())


def test_the_rows_a_listing_of_the_whole_queue_keeps_leave_nothing_to_settle():
    """The rows `colo ls` keeps of 50,000 queued jobs (listing.Kept: row, Job and reason a job; the
    queue's block as columns) are no object a row for the collector: the work that made them ends
    without a settle, which was one collection over them all (16-37 ms of the loop at 50,000)."""
    jobs = [Job(id=i, spec=JobSpec(argv=["true"], gpu_mem=1 << 30, workdir="/tmp"), uid=0, gid=0, user="root")
            for i in range(1, 50_001)]
    gc.collect()
    frozen = gc.get_freeze_count()
    with passcost.held():
        kept = Kept()
        for j in jobs:
            kept.put(j, None if j.id % 3 else "waits for memory", b'[%d,"q","root"]' % j.id)
        block = ([j.id for j in jobs], [kept.row[j.id] for j in jobs])
        assert gc.get_count()[0] < 100, "the kept rows are objects the collector walks one by one"
    assert gc.get_freeze_count() == frozen, "what the listing kept was settled: a collection over every row"
    assert len(kept.only({1, 2, 3}).row) == 3 and len(block[1]) == len(jobs)
