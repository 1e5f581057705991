"""The pass over every queued job (once a minute, and when a job passes hold_after) runs in slices
with the loop free in between (issue 36: at 50,000 queued it took 1.2 s, and every request waited
behind it). Sliced, it must decide what one pass would: the same reasons for every job, the GPUs
held for the same job, and every job after it told so. An in-process daemon over its real store."""
from __future__ import annotations

import asyncio
import time

import pytest

from colo.config import Config
from colo.daemon import scheduler as sched
from colo.daemon.core import Daemon
from colo.jobs import JobSpec, Mode, State
from colo.node import fakegpu
from colo.store import Store

GiB = 1 << 30


@pytest.fixture
def backlog(tmp_path, native_dir):
    """4 GPUs held whole by running jobs (nothing behind them), 2,000 queued jobs of 5 users, all
    waiting past hold_after; an in-process daemon on that store (no loop, nothing recovered)."""
    state = tmp_path / "gpus"
    fakegpu.create(state, count=4, mem=16 * GiB)
    cfg = Config(state_dir=tmp_path / "s", socket=tmp_path / "s.sock", fakegpu_state=state, reserve=0,
                 hold_after=600)
    cfg.state_dir.mkdir()
    s = Store(cfg.db_path)
    old = time.time() - 3600
    with s.tx():
        for u in fakegpu.FakeNode(state).uuids():
            j = s.add_job(JobSpec(argv=["sleep", "1"], gpu_mem=16 * GiB), 0, 0, "root", old)
            s.transition(j.id, State.STARTING, "test")
            s.transition(j.id, State.RUNNING, "test", gpus=[u], mode=Mode.TIMESLICED, handle="1:0")
        for i in range(2000):
            s.add_job(JobSpec(argv=["true"], gpu_mem=(1 + i % 8) * GiB, workdir="/tmp"), 1000 + i % 5, 1000,
                      f"user{i % 5}", old + i)
    s.close()
    d = Daemon(cfg)
    d.open()
    yield d
    d.close()


def test_a_complete_pass_in_slices_decides_what_one_pass_does(backlog, monkeypatch):
    s = backlog.scheduler

    async def go():
        one = s.schedule_pass(complete=True)  # the whole walk in one plan
        whole = {x.job_id: (x.action, x.reason) for x in one}
        held = [x.job_id for x in one if "held" in x.details]
        s.decisions.clear()
        monkeypatch.setattr(sched, "SLICE_S", 0.0005)  # many small slices
        s.schedule_pass(complete=True, sliced=True)
        assert s._rest is not None  # noqa: SLF001 - the rest is left to the slices
        await s.finish_complete(lambda: False)
        return whole, held

    whole, held = asyncio.run(go())
    sliced = {i: (x.action, x.reason) for i, x in s.decisions.items()}
    assert len(whole) == 2000 and sliced == whole
    assert len(held) == 1 and sum(f"is held for job {held[0]}" in r for _, r in whole.values()) > 1000
    assert s.last_pass["slices"] > 10 and s.last_pass["planned"] >= 2000, s.last_pass
    assert all(a == "wait" for a, _ in whole.values())


def test_no_pass_over_the_queue_falls_due_while_nothing_changes(backlog, monkeypatch):
    """An idle daemon sleeps however long its queue: the once-a-minute pass over every queued job
    is owed only when something changed since the last one (issue 41)."""
    import math

    s = backlog.scheduler

    async def go():
        assert len(s.schedule_pass(complete=True)) == 2000
        assert s.pass_due_in() == math.inf
        monkeypatch.setattr(sched, "COMPLETE_PASS_EVERY", 0.0)  # a minute has passed, many times over
        assert s.schedule_pass() == [] and s.pass_due_in() == math.inf
        j = backlog.table.open[min(backlog.table.open)]  # one change: a job's state (here a running one ends)
        s.queue_changed(j, j)
        assert s.pass_due_in() == 0.0
        assert len(s.schedule_pass()) > 1000 and s.pass_due_in() == math.inf  # every job looked at again
        s.wake()  # a GPU, an engine, a signal: anything that wakes the scheduler for a full pass
        assert s.pass_due_in() == 0.0 and len(s.schedule_pass()) > 1000

    asyncio.run(go())
