"""A running job's provisional profile is remade every half minute for an hour (learner.tick). A
remake that says the same to plan() owes no pass over the queue: with 8 steady jobs running it was
a complete pass over every queued job every minute while nothing changed (issue 41). One that
changes what plan() reads still owes one."""
from __future__ import annotations

import asyncio
import sqlite3

import pytest

from colo import profiles
from colo.config import Config
from colo.daemon.gpus import Gpus
from colo.daemon.jobtable import JobTable
from colo.daemon.learner import Learner
from colo.jobs import JobSpec, State
from colo.sched import policy
from colo.store import Store
from harness.daemon import DaemonProc, wait_for

GiB = 1 << 30


def test_a_remade_provisional_profile_owes_a_pass_only_when_its_figures_changed(tmp_path, fakegpu, native_dir):
    cfg = Config(state_dir=tmp_path / "state", fakegpu_state=fakegpu.state)
    gpus = Gpus(cfg, native_dir)
    gpus.open()
    table = JobTable(Store(tmp_path / "colo.db"))
    learner = Learner(cfg, table, gpus, policy.PolicyConfig())
    owed = []  # the scheduler's on_forget: a pass over every queued job is owed
    learner.on_forget.append(lambda: owed.append(1))

    async def run() -> None:  # the table tells its waiters on the daemon's loop
        j = table.add(JobSpec(argv=["steady"], gpu_mem=4 * GiB), 1000, 1000, "u").id
        table.transition(j, State.STARTING, "placed", gpus=[gpus.devices[0].uuid])
        table.transition(j, State.RUNNING, "running")
        job = table.open[j]
        t0 = job.started_at

        def sampled(until: float, sm: float) -> None:  # one sample a second, as the tick takes them
            have = len(table.store.samples(j))
            table.store.add_samples([(j, t0 + s, sm, 2 * GiB, 0.1) for s in range(have, int(until))])

        sampled(31, 0.3)
        assert learner.tick([job], t0 + 31) and len(owed) == 1  # the first: its family may be placed
        first = learner.profile_of(job)
        for k in (2, 3, 4):  # steady: remade each half minute, the same figures
            sampled(30 * k + 1, 0.3)
            assert not learner.tick([job], t0 + 30 * k + 1)
        assert len(owed) == 1
        held = learner.profile_of(job)
        assert held is first and "first 121 s" in held.note  # what it says is of the latest look
        sampled(151, 0.9)  # it works harder: what plan() reads changed
        assert learner.tick([job], t0 + 151) and len(owed) == 2
        assert learner.profile_of(job).peak_sm == 0.9 and not profiles.same_figures(learner.profile_of(job), first)

    asyncio.run(run())


def test_a_job_that_computes_nothing_yet_is_looked_at_every_half_minute_not_every_tick(tmp_path, fakegpu, native_dir):
    """A job loading its data (0 % SM) makes no provisional profile: it has not shown what it does
    (issue 39). Its samples are then read again half a minute later, not at every tick of the hour
    it may idle (a notebook kernel); once it computes, the next look makes one."""
    cfg = Config(state_dir=tmp_path / "state", fakegpu_state=fakegpu.state)
    gpus = Gpus(cfg, native_dir)
    gpus.open()
    table = JobTable(Store(tmp_path / "colo.db"))
    learner = Learner(cfg, table, gpus, policy.PolicyConfig())

    async def run() -> None:
        j = table.add(JobSpec(argv=["loads"], gpu_mem=4 * GiB), 1000, 1000, "u").id
        table.transition(j, State.STARTING, "placed", gpus=[gpus.devices[0].uuid])
        table.transition(j, State.RUNNING, "running")
        job = table.open[j]
        t0 = job.started_at
        for t in range(1, 60):  # a sample and a tick a second: a look at 30 s, the next at 60 s
            table.store.add_samples([(j, t0 + t - 1, 0.0 if t < 45 else 0.8, 2 * GiB, 0.0)])
            assert not learner.tick([job], t0 + t)  # (from 46 s on, a look would have made one)
        assert learner.profile_of(job) is None
        table.store.add_samples([(j, t0 + 59, 0.8, 2 * GiB, 0.0)])
        assert learner.tick([job], t0 + 60)  # it computed since 45 s: a provisional profile now
        assert learner.profile_of(job).provisional and learner.profile_of(job).peak_sm == pytest.approx(0.8)

    asyncio.run(run())


@pytest.mark.slow  # a job's provisional profile is first made after 30 s of its run, remade every 30 s
def test_a_daemon_with_a_steady_job_running_makes_no_pass_while_nothing_changes(tmp_path, fakegpu):
    """Counted across the daemon's own sample ticks (the samples it stores), not the clock: from
    its first provisional profile on, a steady job (colo-burn at 10 % of the SMs) owes no pass at
    each remake; before, each remake logged a full pass. (A job that computes nothing, a sleep,
    makes no provisional profile: it has not shown what it does.)"""
    d = DaemonProc(tmp_path, fakegpu.state, {"sample_interval": 1.0}).start()
    try:
        burn = str(next(d.state_dir.glob("native-*")) / "colo-burn")
        j = d.client.submit({"argv": [burn, "--mem", "64MiB", "--duty", "10", "--seconds", "600"], "gpus": 1,
                             "gpu_mem": GiB, "workdir": "/tmp"})["id"]
        d.client.submit({"argv": ["true"], "gpus": 1, "gpu_mem": GiB, "workdir": "/tmp", "hold": True})
        started = d.wait_state(j, "running")["started_at"]

        def sampled_for() -> float:  # how long the daemon's ticks have sampled the job
            with sqlite3.connect(f"file:{d.state_dir / 'colo.db'}?mode=ro", uri=True) as db:
                return (db.execute("SELECT max(at) FROM samples WHERE job_id=?", (j,)).fetchone()[0] or 0) - started

        wait_for(lambda: f"job {j}: a provisional profile from its first" in d.log.read_text(), 120,
                 "the job's first provisional profile")
        wait_for(lambda: sampled_for() >= 45, 120, "45 s of samples (the pass the first one owed is over)")
        passes = d.log.read_text().count("scheduler pass (full)")
        wait_for(lambda: sampled_for() >= 100, 180, "100 s of samples (remade at 60 and 90 s)")
        log = d.log.read_text()
        assert log.count("scheduler pass (full)") == passes, log[-3000:]
        assert log.count(f"job {j}: a provisional profile from its first") == 1
    finally:
        d.stop()
