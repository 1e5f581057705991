"""colo/sched/fairshare.py: recent use as documented (GiB-hours, each moment decayed with the
half-life, summed exactly over jobs and over time), the turn order, and the per-user limits at
and one past each limit. test_fairness.py has the same through a real daemon and real users."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from colo.sched import fairshare as fs

GiB = 1024**3
H = 3600.0


def test_weight_is_gib_of_gpu_memory_held():
    assert fs.weight(2 * GiB, 3) == 6.0
    assert fs.weight(GiB // 2, 1) == 0.5
    assert fs.weight(4 * GiB, 0) == 0.0


def test_interval_use_without_decay_is_weight_times_hours():
    assert fs.interval_use(2.0, 0.0, H, 10 * H, 0.0) == 2.0
    assert fs.interval_use(2.0, 100.0, 100.0 + H / 2, 10 * H, -1.0) == 1.0
    assert fs.interval_use(2.0, 5.0, 5.0, 10.0, 0.0) == 0.0
    assert fs.interval_use(2.0, 10.0, 5.0, 20.0, H) == 0.0  # ends before it starts: nothing
    assert fs.interval_use(2.0, 10.0, 5.0, 20.0, 0.0) == 0.0


def test_interval_use_is_the_integral_of_the_decayed_weight():
    # w held for [s, e], each moment t weighted 2^-((now - t) / h): w * h / ln 2 * (2^-(now-e)/h - 2^-(now-s)/h)
    w, s, e, now, h = 3.0, 0.0, H, 2 * H, H
    exact = w * h / math.log(2) * (2 ** (-(now - e) / h) - 2 ** (-(now - s) / h)) / H
    assert fs.interval_use(w, s, e, now, h) == pytest.approx(exact, rel=1e-12)
    assert fs.interval_use(1.0, 0.0, H, H, H) == pytest.approx(0.5 / math.log(2), rel=1e-12)
    # use from one half-life ago counts half
    assert fs.interval_use(w, s, e, e + h, h) == pytest.approx(fs.interval_use(w, s, e, e, h) / 2, rel=1e-12)
    # a very long half-life is (almost) no decay
    assert fs.interval_use(2.0, 0.0, H, 5 * H, 1e12) == pytest.approx(2.0, rel=1e-6)


def test_ledger_sums_jobs_exactly_whatever_order_they_end_in():
    jobs = [(4.0, 0.0, 2 * H), (1.0, 5 * H, 6 * H), (2.0, H, 3 * H)]  # (weight, start, end)
    now = 8 * H
    expect = sum(fs.interval_use(w, s, e, now, H) for w, s, e in jobs)
    for perm in itertools.permutations(jobs):
        led = fs.Ledger(half_life=H)
        for w, s, e in perm:
            led.add(7, w, s, e)
        assert led.usage(now)[7] == pytest.approx(expect, rel=1e-12)


def test_ledger_keeps_users_apart_and_without_half_life_sums_plainly():
    led = fs.Ledger(half_life=0.0)
    led.add(1, 2.0, 0.0, H)
    led.add(2, 1.0, 0.0, 2 * H)
    led.add(1, 1.0, 3 * H, 4 * H)
    assert led.usage(100 * H) == {1: 3.0, 2: 2.0}


def test_ledger_use_decays_from_its_last_end_and_never_grows_backwards():
    led = fs.Ledger(half_life=H)
    led.add(7, 1.0, 0.0, H)
    at_end = led.usage(H)[7]
    assert at_end == fs.interval_use(1.0, 0.0, H, H, H)
    assert led.usage(0.0)[7] == at_end  # asked for a moment before it ended: not grown
    assert led.usage(H - 1)[7] == at_end
    assert led.usage(3 * H)[7] == pytest.approx(at_end / 4, rel=1e-12)


def test_running_jobs_are_added_to_what_ended():
    led = fs.Ledger(half_life=H)
    led.add(7, 1.0, 0.0, H)
    now = 2 * H
    got = led.usage(now, running=[(7, 2.0, H), (8, 1.0, H + H / 2), (8, 1.0, 2 * H)])
    assert got[7] == pytest.approx(fs.interval_use(1.0, 0.0, H, now, H) + fs.interval_use(2.0, H, now, now, H),
                                   rel=1e-12)
    assert got[8] == pytest.approx(fs.interval_use(1.0, H + H / 2, now, now, H), rel=1e-12)
    assert fs.Ledger(half_life=H).usage(now) == {}


def test_suspended_time_is_no_use_and_the_held_time_counts_in_full():
    # ran 4 h, suspended 1 h before and (since 3 h) now: 2 h held, as the span ending at 3 h
    assert fs.held_span(0.0, 4 * H, H, 3 * H) == (H, 3 * H)
    assert fs.held_span(0.0, 4 * H, H) == (H, 4 * H)
    assert fs.held_span(0.0, 4 * H) == (0.0, 4 * H)
    assert fs.held_span(0.0, 4 * H, 9 * H) == (4 * H, 4 * H)  # never less than nothing
    assert fs.held_span(0.0, 4 * H, 0.0, 0.0) == (0.0, 0.0)  # suspended from its start: no use
    led = fs.Ledger(half_life=0.0)
    assert led.usage(4 * H, [(7, 2.0, *fs.held_span(0.0, 4 * H, H, 3 * H))])[7] == pytest.approx(4.0)
    led.add(7, 2.0, *fs.held_span(0.0, 4 * H, 3 * H))
    assert led.usage(5 * H)[7] == pytest.approx(2.0)  # 1 h of 2 GiB held: 2 GiB-h, not 8


def test_fair_walk_takes_turns_least_use_first_ties_by_uid():
    queues = {30: ["c1", "c2"], 10: ["a1", "a2", "a3"], 20: ["b1"], 40: []}
    assert list(fs.fair_walk(queues, {10: 5.0, 20: 1.0})) == ["c1", "b1", "a1", "c2", "a2", "a3"]
    assert list(fs.fair_walk(queues, {})) == ["a1", "b1", "c1", "a2", "c2", "a3"]  # no use: by uid
    assert list(fs.fair_walk({}, {})) == []


def test_fair_walk_is_lazy():
    walk = fs.fair_walk({1: itertools.count(), 2: iter(["x"])}, {2: 1.0})
    assert list(itertools.islice(walk, 5)) == [0, "x", 1, 2, 3]


def test_fair_order_priority_then_submission_within_a_user():
    jobs = [(1, 10, 0, 3), (2, 10, 0, 1), (3, 10, 1, 9), (4, 10, -1, 0), (5, 20, 0, 2)]
    assert fs.fair_order(jobs, {20: 1.0}) == [3, 5, 2, 1, 4]
    assert fs.fair_order([], {}) == []


def test_limits_zero_means_none_and_are_frozen():
    assert fs.Limits() == fs.Limits(0, 0, 0) and fs.UserLoad() == fs.UserLoad(0, 0)
    assert fs.submit_refusal(fs.Limits(), "bob", 10**6) is None
    assert fs.start_refusal(fs.Limits(), "bob", fs.UserLoad(10**6, 10**15), 10**12, 8) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        fs.Limits().queued = 1
    assert len({fs.Limits(1), fs.Limits(1)}) == 1


def test_submit_limit_at_and_past_it():
    lim = fs.Limits(queued=3)
    assert fs.submit_refusal(lim, "bob", 2) is None
    assert fs.submit_refusal(lim, "bob", 3) == ("bob has 3 jobs queued, the most one user may queue here "
                                                "(max_queued_per_user); wait for some to start or cancel some")


def test_running_limit_at_and_past_it():
    lim = fs.Limits(running=2)
    assert fs.start_refusal(lim, "bob", fs.UserLoad(running=1), GiB, 1) is None
    assert fs.start_refusal(lim, "bob", fs.UserLoad(running=2), GiB, 1) == (
        "waiting for a limit: bob has 2 job(s) running, the most one user may run at once (max_running_per_user)")


def test_gpu_memory_limit_counts_budget_times_gpus():
    lim = fs.Limits(gpu_mem=8 * GiB)
    assert fs.start_refusal(lim, "bob", fs.UserLoad(gpu_mem=2 * GiB), 3 * GiB, 2) is None  # exactly 8: allowed
    assert fs.start_refusal(lim, "bob", fs.UserLoad(gpu_mem=2 * GiB + 1), 3 * GiB, 2) is not None
    assert fs.start_refusal(lim, "bob", fs.UserLoad(gpu_mem=0), 3 * GiB, 3) == (
        "waiting for a limit: bob's running jobs hold 0.0 GiB of GPU memory; this job's 9.0 GiB would pass "
        "8.0 GiB, the most one user may hold at once (max_gpu_mem_per_user)")
    assert "hold 6.5 GiB" in fs.start_refusal(lim, "bob", fs.UserLoad(gpu_mem=6 * GiB + GiB // 2), 2 * GiB, 1)


def test_a_short_half_life_decays_and_use_far_apart_does_not_overflow():
    # one second: use from an hour and more ago is gone; each job is decayed from its own end, never
    # grown towards an earlier one (2^4990 would not fit a float)
    assert fs.interval_use(1.0, 0.0, H, 2 * H, 1.0) < 1e-300
    led = fs.Ledger(half_life=1.0)
    led.add(7, 1.0, 0.0, 10.0)
    led.add(7, 1.0, 4990.0, 5000.0)
    assert led.usage(5000.0)[7] == pytest.approx(fs.interval_use(1.0, 4990.0, 5000.0, 5000.0, 1.0), rel=1e-12)
    assert led.usage(5000.0)[7] == pytest.approx((1 - 2.0**-10) / math.log(2) / H, rel=1e-12)
