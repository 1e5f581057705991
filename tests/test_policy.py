"""plan(): memory admission (invariant 1), and the MPS / time-sliced / wait choice from profiles."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from colo.sched import policy as pol
from colo.sched.policy import START, WAIT, Candidate, GpuView, Placed, PolicyConfig, plan
from colo.profiles import Profile, ProfileStore, shipped_dir

GiB = 1024**3


def flat(name, sm, bw=0.2, runtime=100.0, cache_bound=False, mem=GiB):
    n = int(runtime)
    return Profile(name=name, step=1.0, sm=np.full(n, sm), mem=np.full(n, mem), membw=np.full(n, bw),
                   runtime=runtime, cache_bound=cache_bound)


LIGHT = flat("light", 0.30)
LIGHT2 = flat("light2", 0.32)
HOT = flat("hot", 1.0, bw=0.9, cache_bound=True)
TINY = dataclasses.replace(flat("tiny", 0.05, bw=0.02), runs=5)  # well known, barely uses the GPU
HOT2 = flat("hot2", 1.0, bw=0.9, cache_bound=True)
G0 = GpuView("gpu-0", 0, int(79.6 * GiB), mps="active")


def one(cands, gpus=(G0,), placed=(), **cfg):
    return plan(cands, list(gpus), list(placed), PolicyConfig(**cfg))


# ---- memory: the hard rule (small, well-known jobs: nothing but memory decides) ------------------

def test_priority_then_fifo_and_backfill():
    g = GpuView("g", 0, 10 * GiB)
    d = plan([Candidate(1, 8 * GiB, seq=1, profile=TINY), Candidate(2, 4 * GiB, seq=2, priority=5, profile=TINY),
              Candidate(3, 6 * GiB, seq=3, profile=TINY), Candidate(4, 2 * GiB, seq=4, profile=TINY)], [g], [])
    assert [x.job_id for x in d] == [2, 1, 3, 4]
    by = {x.job_id: x for x in d}
    assert by[2].action == START and by[1].action == WAIT and "waiting for memory" in by[1].reason
    assert by[3].action == START and by[4].action == WAIT  # 4 + 6 = 10: full
    assert by[2].mode == "mps"


def test_best_fit_and_no_gpu_jobs():
    a, b = GpuView("a", 0, 16 * GiB), GpuView("b", 1, 16 * GiB)
    placed = [Placed(9, ("a",), 10 * GiB, profile=TINY)]
    d = plan([Candidate(1, 4 * GiB, seq=1, profile=TINY), Candidate(2, 0, gpus=0, seq=2)], [a, b], placed)
    assert d[0].gpus == ("a",)  # least room left over
    assert (d[1].action, d[1].mode, d[1].gpus) == (START, "none", ())


def test_prohibited_gpu_takes_nothing_and_can_ever_fit():
    g = GpuView("p", 0, 16 * GiB, compute_mode="prohibited")
    assert plan([Candidate(1, GiB, profile=LIGHT)], [g], [])[0].action == WAIT
    assert pol.can_ever_fit(20 * GiB, 1, [g]) is not None and pol.can_ever_fit(GiB, 0, []) is None


def test_gpu_out_of_service_takes_nothing_and_waiting_jobs_are_told():
    lost = GpuView("l", 1, 16 * GiB, error="NVML error: GPU is lost")
    ok = GpuView("o", 0, 16 * GiB)
    d = plan([Candidate(1, 10 * GiB, seq=1, profile=TINY), Candidate(2, 10 * GiB, seq=2, profile=TINY)], [ok, lost], [])
    assert (d[0].action, d[0].gpus) == (START, ("o",))
    assert d[1].action == WAIT and "GPU1 is out of service (NVML error: GPU is lost)" in d[1].reason
    # its running jobs keep their budgets: once it answers again, only what is free there is placed
    back = GpuView("l", 1, 16 * GiB)
    d = plan([Candidate(3, 10 * GiB, seq=3, profile=TINY)], [back], [Placed(9, ("l",), 10 * GiB, profile=TINY)])
    assert d[0].action == WAIT and "out of service" not in d[0].reason


def test_a_job_passed_over_too_long_gets_a_gpu_held_for_it():
    """Backfill without a limit starves a big job behind a stream of small ones."""
    a, b = GpuView("a", 0, 16 * GiB), GpuView("b", 1, 16 * GiB)
    placed = [Placed(8, ("a",), 6 * GiB, profile=TINY), Placed(9, ("b",), 10 * GiB, profile=TINY)]
    big = Candidate(1, 16 * GiB, seq=1, queued_at=0.0, profile=TINY)
    smalls = [Candidate(2, 4 * GiB, seq=2, queued_at=500.0, profile=TINY), Candidate(3, 4 * GiB, seq=3, queued_at=500.0, profile=TINY)]
    cfg = PolicyConfig(hold_after=1800)
    early = {d.job_id: d for d in plan([big, *smalls], [a, b], placed, cfg, now=600.0)}
    assert early[1].action == WAIT and "held" not in early[1].reason
    assert early[2].action == START and early[3].action == START  # backfill: both pass the big one
    late = {d.job_id: d for d in plan([big, *smalls], [a, b], placed, cfg, now=1900.0)}
    assert late[1].action == WAIT and "GPU0 held for it (waiting 31 min)" in late[1].reason, late[1].reason
    assert late[1].details["held"] == [0]  # the GPU with the most free budget: fewest jobs to wait for
    assert late[2].action == START and late[2].gpus == ("b",)  # what fits elsewhere still starts
    assert late[3].action == WAIT and "GPU0 is held for job 1" in late[3].reason
    # once GPU0 has drained the held job starts there; without a clock nothing is ever held
    assert plan([big, *smalls], [a, b], placed[1:], cfg, now=1900.0)[0].gpus == ("a",)
    assert all("held" not in d.reason for d in plan([big, *smalls], [a, b], placed, cfg))
    assert all("held" not in d.reason for d in plan([big, *smalls], [a, b], placed, PolicyConfig(hold_after=0),
                                                    now=1e9))


def test_a_hold_stays_where_it_was_while_that_gpu_can_still_take_the_job():
    a, b = GpuView("a", 0, 16 * GiB), GpuView("b", 1, 16 * GiB)
    # GPU1 was held last pass and has drained to 10 GiB free; GPU0 now has more free (12 GiB)
    placed = [Placed(8, ("a",), 4 * GiB, profile=TINY), Placed(9, ("b",), 6 * GiB, profile=TINY)]
    big = Candidate(1, 16 * GiB, seq=1, queued_at=0.0, profile=TINY)
    cfg = PolicyConfig(hold_after=60)
    fresh = plan([big], [a, b], placed, cfg, now=100.0)[0]
    assert fresh.details["held"] == [0]  # nothing held before: the most free
    kept = plan([dataclasses.replace(big, held=(1,))], [a, b], placed, cfg, now=100.0)[0]
    assert kept.details["held"] == [1] and "GPU1 held for it" in kept.reason
    gone = plan([dataclasses.replace(big, held=(1,))], [a, dataclasses.replace(b, error="lost")], placed, cfg,
                now=100.0)[0]
    assert gone.details["held"] == [0]  # the held GPU went out of service: the hold moves


def test_only_the_first_long_waiter_in_queue_order_gets_a_hold():
    g = [GpuView(f"g{i}", i, 16 * GiB) for i in range(3)]
    placed = [Placed(9, (f"g{i}",), 8 * GiB, profile=TINY) for i in range(3)]
    c = [Candidate(1, 12 * GiB, seq=1, profile=TINY), Candidate(2, 12 * GiB, seq=2, priority=1, profile=TINY), Candidate(3, 12 * GiB, seq=3, profile=TINY)]
    d = {x.job_id: x for x in plan(c, g, placed, PolicyConfig(hold_after=60), now=100.0)}
    assert "held for it" in d[2].reason and "held for it" not in d[1].reason + d[3].reason
    assert "is held for job 2" in d[1].reason


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 2), st.sampled_from([None, LIGHT, HOT, LIGHT2]),
                          st.integers(0, 1)), min_size=1, max_size=25),
       st.lists(st.tuples(st.integers(0, 2), st.integers(1, 8)), max_size=4))
def test_invariant_1_budgets_never_exceed_usable(cands, placed):
    gpus = [GpuView(f"g{i}", i, 16 * GiB, compute_mode="exclusive_process" if i == 2 else "default", mps="active")
            for i in range(3)]
    pl = [Placed(100 + i, (f"g{gi}",), b * GiB, mode="mps", profile=LIGHT) for i, (gi, b) in enumerate(placed)
          if sum(bb for g2, bb in placed[: i + 1] if g2 == gi) <= 16]
    # odd ids have waited long enough for a hold, one of them may hold GPU1 from a last pass
    cs = [Candidate(i, b * GiB, gpus=n, seq=i, profile=p, uid=u, queued_at=0.0 if i % 2 else 1e6,
                    held=(1,) if i % 4 == 1 else ()) for i, (b, n, p, u) in enumerate(cands)]
    used = pol.free_budget(gpus, pl)
    for d in plan(cs, gpus, pl, PolicyConfig(hold_after=60), now=1e6):
        for u in d.gpus:
            used[u] -= next(c.budget for c in cs if c.job_id == d.job_id)
        if d.action == START and any(u == "g2" for u in d.gpus):
            assert d.mode == "mps"  # invariant 4: EXCLUSIVE_PROCESS takes MPS clients only
        json.dumps(d.details)
    assert all(v >= 0 for v in used.values())


# ---- profiles decide the mode ------------------------------------------------------------------

def test_light_pair_shares_under_mps_with_the_reason_colo_explain_prints():
    d = one([Candidate(5, 3 * GiB, profile=LIGHT2)], placed=[Placed(4, ("gpu-0",), 3 * GiB, mode="mps", profile=LIGHT, elapsed=10)])[0]
    assert (d.action, d.mode) == (START, "mps")
    assert d.reason == ("MPS on GPU0: predicted peak SM 62 % (job 4: 30 %, this job: 32 %) < 85 %; "
                        "memory 6.0 of 79.6 GiB budgeted")
    assert d.details["peak_sm"] == pytest.approx(0.62) and d.details["sm_by_job"] == {"4": 0.3, "this": 0.32}
    assert d.thread_pct == 40  # 32 % x 1.25 headroom, rounded up to 5 %
    json.dumps(d.details)


def test_two_light_candidates_start_together_under_mps():
    d = one([Candidate(1, GiB, seq=1, profile=LIGHT), Candidate(2, GiB, seq=2, profile=LIGHT2)])
    assert [(x.action, x.mode) for x in d] == [(START, "mps"), (START, "mps")]


def test_saturating_cache_bound_pair_waits():
    d = one([Candidate(2, GiB, profile=HOT2)], placed=[Placed(1, ("gpu-0",), GiB, profile=HOT, mode="timesliced")])[0]
    assert d.action == WAIT
    assert "predicted to cost more than it gains" in d.reason and "peak SM 200 %" in d.reason
    tp = d.details["throughput"]  # MPS is weighed too (past saturation the model still says what it costs)
    # two saturating jobs get more done at once than one (the H200's matmul pair time-sliced: 1.21x;
    # beside a time-sliced resident the MPS client is a context of its own, so alike), but each would
    # run 1.65x slower than alone: past the bound
    assert tp["timesliced"] > tp["wait"] and tp["mps"] > tp["wait"]
    assert min(d.details["slowdown"].values()) > 1.5


def test_time_sliced_when_it_beats_waiting():
    """A resident that leaves the GPU idle for a while: sharing it in time pays off."""
    idle_then_hot = Profile(name="phases", step=1.0, sm=np.r_[np.zeros(80), np.ones(20)], mem=np.full(100, GiB),
                            membw=np.r_[np.zeros(80), np.full(20, 0.5)], runtime=100)
    d = one([Candidate(2, GiB, profile=HOT)], placed=[Placed(1, ("gpu-0",), GiB, profile=idle_then_hot, mode="mps")])[0]
    assert (d.action, d.mode) == (START, "timesliced"), d.reason
    assert re.search(r"sharing would saturate: predicted peak SM 200 %.*throughput [\d.]+ vs 1\.00 waiting", d.reason)


def test_unprofiled_job_runs_alone_or_beside_one_well_known_job():
    alone = one([Candidate(2, GiB)])[0]
    assert (alone.action, alone.mode) == (START, "timesliced") and "no profile yet, runs alone" in alone.reason
    d = one([Candidate(2, GiB)], placed=[Placed(1, ("gpu-0",), GiB, profile=HOT)])[0]
    assert d.action == WAIT and "runs alone or beside one well-known job" in d.reason  # HOT: one run only
    # and it names the ways out: a profile, the config, or the samples of a first run of it
    assert all(w in d.reason for w in ("--profile NAME", "colo profile share", "unprofiled_share", "half a minute"))
    d = one([Candidate(2, GiB)], placed=[Placed(1, ("gpu-0",), GiB, profile=TINY)])[0]
    assert (d.action, d.mode) == (START, "timesliced"), d.reason  # TINY: 5 runs, barely slowed
    two = [Placed(1, ("gpu-0",), GiB, profile=TINY), Placed(3, ("gpu-0",), GiB, profile=TINY)]
    assert one([Candidate(2, GiB)], placed=two)[0].action == WAIT  # at most one neighbour
    # and the other way round: a job running with no profile takes one well-known neighbour only
    stranger = [Placed(1, ("gpu-0",), GiB)]
    assert one([Candidate(2, GiB, profile=LIGHT)], placed=stranger)[0].action == WAIT  # LIGHT: one run
    assert one([Candidate(2, GiB, profile=TINY)], placed=stranger)[0].mode == "timesliced"
    assert one([Candidate(2, GiB, profile=TINY)], placed=stranger + [Placed(3, ("gpu-0",), GiB, profile=TINY)]
               )[0].action == WAIT


def test_an_empty_gpu_goes_to_a_family_with_none_running_before_a_second_of_one_that_runs():
    g1 = GpuView("gpu-1", 1, int(79.6 * GiB), mps="active")
    a1, a2, b1 = Candidate(1, GiB, family="a"), Candidate(2, GiB, family="a"), Candidate(3, GiB, family="b")
    # in one pass: the first of each family takes an empty GPU; the second of "a" waits
    d = {x.job_id: x for x in one([a1, a2, b1], gpus=(G0, g1))}
    assert d[1].action == d[3].action == START and d[1].gpus != d[3].gpus
    assert d[2].action == WAIT and "job 1 of its family runs now without a profile" in d[2].reason, d[2].reason
    # across passes: "a" runs one with no profile yet, so the empty GPU goes to "b"
    running = [Placed(1, ("gpu-0",), GiB, family="a")]
    d = {x.job_id: x for x in one([a2, b1], gpus=(G0, g1), placed=running)}
    assert (d[2].action, d[3].action, d[3].gpus) == (WAIT, START, ("gpu-1",))
    # the empty GPUs go one to each family with none running: more than that, and the second may take one
    g2 = GpuView("gpu-2", 2, int(79.6 * GiB), mps="active")
    d = {x.job_id: x for x in one([a2, b1], gpus=(G0, g1, g2), placed=running)}
    assert d[2].action == d[3].action == START and {d[2].gpus, d[3].gpus} == {("gpu-1",), ("gpu-2",)}
    # a GPU no other family waits for is not left idle; another user's job of that name is no kin
    assert one([a2], gpus=(G0, g1), placed=running)[0].gpus == ("gpu-1",)
    other = dataclasses.replace(a2, uid=1000)
    assert {x.job_id: x.action for x in one([other, b1], gpus=(G0, g1), placed=running)}[2] == START
    # nor is it for a family whose job waits for memory no GPU has free
    big = Candidate(3, int(80 * GiB), family="b")
    assert {x.job_id: x.action for x in one([a2, big], gpus=(G0, g1), placed=running)}[2] == START
    # once the family's first has a (provisional) profile, its second is placed with it
    assert one([dataclasses.replace(a2, profile=LIGHT), b1], gpus=(G0, g1), placed=[
        Placed(1, ("gpu-0",), GiB, profile=LIGHT)])[0].action == START


def test_no_job_is_knowingly_slowed_past_the_bound():
    """MPS included: a pairing that fits under saturation still goes through the slowdown check."""
    bw_heavy = flat("bw", 0.40, bw=0.8, cache_bound=True)
    d = one([Candidate(2, GiB, profile=bw_heavy)], placed=[Placed(1, ("gpu-0",), GiB, mode="mps", profile=bw_heavy)],
            bw_saturation=2.0)[0]
    # under MPS their summed bandwidth (1.6) thrashes: refused by the bound; time-sliced (0.4 of SM
    # each: the H200 showed such work time-slices at no cost) it starts
    assert (d.action, d.mode) == (START, "timesliced"), d.reason
    assert d.details["slowdown"]["mps"] > 1.5
    loose = one([Candidate(2, GiB, profile=bw_heavy)], placed=[Placed(1, ("gpu-0",), GiB, mode="mps", profile=bw_heavy)],
                bw_saturation=2.0, slowdown_bound=10.0)[0]
    assert loose.details["throughput"]["mps"] < loose.details["throughput"]["wait"]  # MPS would not pay either
    ts_off = one([Candidate(2, GiB, profile=bw_heavy)], placed=[Placed(1, ("gpu-0",), GiB, mode="mps", profile=bw_heavy)],
                 gpus=[dataclasses.replace(G0, compute_mode="exclusive_process")], bw_saturation=2.0)[0]
    assert ts_off.action == WAIT and "slower than alone (bound 1.5x)" in ts_off.reason, ts_off.reason
    # the margin (observed prediction error) makes the same check stricter
    light = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=LIGHT)]
    assert one([Candidate(2, GiB, profile=LIGHT2)], placed=light, margin=0.1)[0].mode == "mps"
    assert one([Candidate(2, GiB, profile=LIGHT2)], placed=light, margin=0.6)[0].action == WAIT


def test_uid_rule_without_and_with_multi_user_mps():
    placed = [Placed(1, ("gpu-0",), GiB, uid=1000, mode="mps", profile=LIGHT)]
    c = [Candidate(2, GiB, uid=1001, profile=LIGHT2)]
    d = one(c, placed=placed)[0]
    assert d.mode != "mps" and (d.action == WAIT or d.mode == "timesliced")
    assert "uid 1000" in d.reason
    assert one(c, placed=placed, multi_user_mps=True)[0].mode == "mps"
    assert one([Candidate(2, GiB, uid=1000, profile=LIGHT2)], placed=placed)[0].mode == "mps"


def test_mps_fault_and_mps_off():
    g = GpuView("gpu-0", 0, 16 * GiB, mps="fault")
    assert one([Candidate(1, GiB, profile=LIGHT)], gpus=[g])[0].mode == "timesliced"
    assert one([Candidate(1, GiB, profile=LIGHT)], use_mps=False)[0].mode == "timesliced"


def test_exclusive_process_gpu_takes_mps_clients_only():
    g = GpuView("x", 0, 16 * GiB, compute_mode="exclusive_process", mps="active")
    assert one([Candidate(1, GiB, profile=HOT)], gpus=[g])[0].mode == "mps"
    busy = [Placed(1, ("x",), GiB, mode="mps", profile=LIGHT)]
    assert one([Candidate(2, GiB)], gpus=[g], placed=busy)[0].action == WAIT  # unprofiled: not co-located
    assert one([Candidate(2, GiB, profile=LIGHT2)], gpus=[g], placed=busy)[0].mode == "mps"
    # a cache-bound saturating client beside another: they would thrash (the H200-calibrated model
    # lets HOT beside LIGHT run at once: summed SM 1.3 within what MPS runs at once)
    hot = [Placed(1, ("x",), GiB, mode="mps", profile=HOT)]
    assert one([Candidate(2, GiB, profile=HOT2)], gpus=[g], placed=hot)[0].action == WAIT
    faulted = GpuView("x", 0, 16 * GiB, compute_mode="exclusive_process", mps="fault")
    d = one([Candidate(1, GiB, profile=LIGHT)], gpus=[faulted])[0]
    assert d.action == WAIT and "EXCLUSIVE_PROCESS" in d.reason


def test_prefers_a_free_gpu_over_a_costly_share():
    a, b = GpuView("a", 0, 16 * GiB, mps="active"), GpuView("b", 1, 16 * GiB, mps="active")
    idle_then_hot = Profile(name="ph", step=1.0, sm=np.r_[np.zeros(80), np.ones(20)], mem=np.full(100, GiB),
                            membw=np.zeros(100), runtime=100)
    d = plan([Candidate(2, GiB, profile=HOT)], [a, b], [Placed(1, ("a",), GiB, profile=idle_then_hot)])[0]
    assert d.gpus == ("b",)


def test_shipped_profiles_light_pair_and_heavy_pair():
    s = ProfileStore([shipped_dir()])
    g = GpuView("t", 0, 12 * GiB, mps="active")
    light = plan([Candidate(1, 3 * GiB, seq=1, profile=s.get("alexnet")), Candidate(2, GiB, seq=2, profile=s.get("gromacs"))], [g], [])
    assert [x.mode for x in light] == ["mps", "mps"]
    heavy = plan([Candidate(1, 2 * GiB, seq=1, profile=s.get("hoomd")), Candidate(2, 2 * GiB, seq=2, profile=s.get("hoomd"))], [g], [])
    # two cache-bound hoomd under MPS would thrash (summed bandwidth 1.5): refused; time-sliced
    # they share the GPU's time (0.54 of it each in the H200-calibrated model), within the bound
    assert heavy[0].action == START and (heavy[1].action, heavy[1].mode) == (START, "timesliced")
    assert heavy[1].details["slowdown"]["mps"] > 1.5


def test_learned_corun_slowdown_and_margin_change_the_next_decision():
    light = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=LIGHT, elapsed=0)]
    cand = [Candidate(2, GiB, profile=LIGHT2)]
    assert one(cand, placed=light)[0].mode == "mps"
    learned = pol.Learned()
    # a run alone teaches LIGHT2's real alone time (10 % longer than stored), nothing about co-running
    assert learned.observe("light2", [], "mps", 1.0, 110.0, 100.0, peak_mem=GiB) == pytest.approx(1.1)
    assert learned.corun == {} and learned.errors == []
    # then, beside LIGHT under MPS, predicted unslowed, it took 2.2x its stored time: 2x co-run slowdown
    assert learned.observe("light2", ["light"], "mps", 1.0, 220.0, 100.0) == pytest.approx(2.0)
    assert learned.factor("light2", "light", "mps") == pytest.approx(2.0)
    d = plan(cand, [G0], light, PolicyConfig(), learned=learned)[0]
    assert d.action == WAIT and "slower than alone" in d.reason, d.reason
    # a profile never seen alone learns from shared runs too (in a dense queue none runs alone),
    # against its stored time: its pairing takes it all, the bandwidth curve (which every pairing
    # reads) only what passes the most its stored time may be off (ALONE_DOUBT)
    fresh = pol.Learned()
    assert fresh.observe("x", ["y"], "mps", 1.0, 120.0, 100.0, group_bw=0.7) == pytest.approx(1.2)
    assert fresh.corun[("x", "y", "mps")] == (1, pytest.approx(1.2)) and fresh.curve("mps", 0.7) == 1.0
    assert fresh.observe("z", ["y"], "mps", 1.0, 250.0, 100.0, group_bw=0.9) == pytest.approx(2.5)
    assert fresh.curve("mps", 0.9) == pytest.approx(2.5 / pol.ALONE_DOUBT)
    # time-sliced, contexts take turns and their bandwidth does not sum: the pairing takes it all
    assert fresh.observe("z", ["w"], "timesliced", 1.0, 250.0, 100.0, group_bw=0.9) == pytest.approx(2.5)
    assert fresh.corun[("z", "w", "timesliced")] == (1, pytest.approx(2.5)) and fresh.curve("timesliced", 0.9) == 1.0
    # the margin follows the errors seen (their MARGIN_QUANTILE), 5 % .. MARGIN_CAP
    m = pol.Learned(errors=[1.0] * 10)
    assert m.margin(0.1) == pytest.approx(0.05)
    assert pol.Learned(errors=[3.0] * 10).margin(0.1) == pytest.approx(pol.MARGIN_CAP)
    assert pol.Learned(errors=[1.2] * 3).margin(0.1) == 0.1  # too few to say
    assert pol.Learned(errors=[1.0] * 18 + [1.3] * 2).margin(0.1) == pytest.approx(0.3)  # the worst tenth counts
    # budgets: the most memory any run used, plus 10 %, in 256 MiB steps
    learned.observe("light2", [], "mps", 1.0, 100.0, 100.0, peak_mem=3 * GiB)
    assert learned.suggest_budget("light2") == int(3.5 * GiB) and learned.suggest_budget("nobody") is None


def test_the_margin_covers_every_share_once_however_many_share():
    """The margin discounts each job's predicted rate once, seen pairings or not: where the model
    says a crowd costs nothing, its size alone refuses nobody (it used to compound once per
    unseen pairing, and stopped sharing at three jobs a GPU)."""
    tiny = [flat(f"t{i}", 0.1, bw=0.05) for i in range(6)]
    known = {p.name: (1, 1.0) for p in tiny}
    lr = pol.Learned(errors=[1.2] * 10, alone=dict(known))  # predictions 20 % off: margin 0.2
    placed = [Placed(i, ("gpu-0",), GiB, mode="mps", profile=p) for i, p in enumerate(tiny[:5], 1)]
    d = plan([Candidate(9, GiB, profile=tiny[5])], [G0], placed, learned=lr)[0]
    assert (d.action, d.mode) == (START, "mps"), d.reason
    assert d.details["slowdown"]["mps"] == pytest.approx(1.2) and d.details["unseen"]["mps"] == 5
    # nothing predicted slowed: it need only beat waiting, not by min_gain
    assert d.details["throughput"]["mps"] > d.details["throughput"]["wait"]
    # a pair that ran 5 % slower, both ways: the pairing is seen, its margin that of seen pairings
    light = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=LIGHT, elapsed=0)]
    cand = [Candidate(2, GiB, profile=LIGHT2)]
    lr.alone.update({"light": (1, 1.0), "light2": (1, 1.0)})
    lr.observe("light2", ["light"], "mps", 1.0, 105.0, 100.0, group_bw=0.4)
    lr.observe("light", ["light2"], "mps", 1.0, 105.0, 100.0, group_bw=0.4)
    assert lr.curve("mps", 0.45) == pytest.approx(1.05, rel=0.01) and lr.factor("light2", "light", "mps") == pytest.approx(1.0)
    # MPS only (time-sliced, the pair would be as free in the model and learned nothing to lose)
    xp = [dataclasses.replace(G0, compute_mode="exclusive_process")]
    d = plan(cand, xp, light, PolicyConfig(slowdown_bound=1.4), learned=lr)[0]
    assert (d.action, d.mode) == (START, "mps") and d.details["unseen"]["mps"] == 0
    assert d.details["slowdown"]["mps"] == pytest.approx(lr.curve("mps", 0.4) * (1 + lr.seen_margin(0.1)), rel=1e-3)
    # a job measured against a stored alone time no run here has checked pays half ALONE_DOUBT more
    lr.alone.pop("light2")
    d = plan(cand, [G0], light, PolicyConfig(slowdown_bound=1.4), learned=lr)[0]
    assert d.details["slowdown"]["mps"] == pytest.approx(lr.curve("mps", 0.4) * (1 + lr.seen_margin(0.1))
                                                         * pol.ALONE_DOUBT ** 0.5, rel=1e-3)


def test_a_seen_pairing_pays_the_errors_of_seen_pairings_not_those_about_strangers():
    """Errors of predictions for pairings not seen yet (the factors learned since took them in)
    do not size the margin of a pairing runs have shown: its own kind of error does."""
    lr = pol.Learned(alone={"light": (1, 1.0), "light2": (1, 1.0)}, errors=[1.45] * 10,
                     corun={("light", "light2", "mps"): (3, 1.25), ("light2", "light", "mps"): (3, 1.25)},
                     bw={("mps", 6): (3, 1.0)})
    light = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=LIGHT, elapsed=0)]
    cand = [Candidate(2, GiB, profile=LIGHT2)]
    d = plan(cand, [G0], light, learned=lr)[0]
    # no seen pairing's prediction has ended yet: the configured margin stands in for theirs (the
    # errors about strangers would forbid it: 1.25 x 1.4, past the bound)
    assert d.action == START and d.details["slowdown"]["mps"] == pytest.approx(1.25 * 1.1)
    for _ in range(5):  # seen pairings' predictions came out 2 % off
        assert lr.observe("light2", ["light"], "mps", 1.25, 127.5, 100.0, factor=1.25, unseen=0) == pytest.approx(1.02)
    assert lr.errors_seen == [pytest.approx(1.02)] * 5 and lr.seen_margin(0.1) == pytest.approx(0.05)
    assert lr.margin(0.1) == pytest.approx(pol.MARGIN_CAP)  # all errors': with it this pairing would be past the bound
    d = plan(cand, [G0], light, learned=lr)[0]
    fac = lr.factor("light2", "light", "mps")  # what the five runs taught (1.02 x 1.25)
    assert d.action == START and d.details["slowdown"]["mps"] == pytest.approx(fac * 1.05)
    other = dataclasses.replace(lr, errors_seen=[], errors=list(lr.errors), corun=dict(lr.corun))
    other.observe("light2", ["light"], "mps", 1.25, 200.0, 100.0, factor=1.25)  # joined by someone unforeseen
    other.observe("light2", ["light"], "mps", 1.25, 200.0, 100.0, factor=1.25, unseen=1)  # a stranger beside it
    assert other.errors_seen == [] and len(other.errors) == len(lr.errors) + 2
    # fewer than five seen: the configured margin for the ones missing, and one far off counts
    assert pol.Learned(errors=[1.2] * 5, errors_seen=[1.0] * 3).seen_margin(0.1) == pytest.approx(0.1)
    assert pol.Learned(errors_seen=[1.9]).seen_margin(0.1) > 0.25


def test_a_shared_run_within_alone_doubt_still_shows_its_bandwidth_was_fine():
    """A profile never seen alone whose shared run took no longer than its stored time may be off
    teaches its pairing what it showed, and the curve that the level it started into was fine:
    explored, so the frontier moves on from it."""
    lr = pol.Learned(alone={"a": (1, 1.0)}, bw={("mps", 2): (1, 1.0)})
    assert not lr.explored("mps", 0.75) and not lr.beyond("mps", 0.75) and lr.beyond("mps", 0.85)
    assert lr.explored("mps", pol.KNOWN_BW)  # what the published pairs showed costs nothing
    assert lr.observe("x", ["a"], "mps", 1.0, 110.0, 100.0, group_bw=0.75) == pytest.approx(1.1)
    assert lr.explored("mps", 0.75) and not lr.beyond("mps", 0.85)
    assert lr.curve("mps", 0.75) == 1.0 and lr.corun[("x", "a", "mps")][1] == pytest.approx(1.1)
    lr.observe("a", ["x"], "mps", 1.0, 130.0, 100.0, group_bw=0.75)  # seen alone: all of it
    assert lr.bw[("mps", 7)] == (2, pytest.approx(1.15, abs=0.01))


def test_learning_moves_both_ways_and_forgets():
    """Invariant 15: a mean over at most KEEP_RUNS runs, so newer runs move it back down; and
    evidence no run confirmed for FADE observations counts half as far from 1."""
    lr = pol.Learned(alone={"a": (1, 1.0)})
    def learned_at_09():
        return lr.factor("a", "b", "mps") * lr.curve("mps", 0.9)

    for _ in range(20):
        lr.observe("a", ["b"], "mps", learned_at_09(), 200.0, 100.0, factor=learned_at_09(), group_bw=0.9)
    assert learned_at_09() == pytest.approx(2.0, rel=0.05) and lr.bw[("mps", 9)][0] == pol.KEEP_RUNS
    for _ in range(pol.KEEP_RUNS * 3):  # then runs there cost nothing: it comes down
        lr.observe("a", ["b"], "mps", learned_at_09(), 100.0, 100.0, factor=learned_at_09(), group_bw=0.9)
    assert learned_at_09() < 1.1
    old = pol.Learned(alone={"a": (1, 1.0)})
    old.observe("a", ["b"], "mps", 1.0, 200.0, 100.0, group_bw=0.9)
    before = old.factor("a", "b", "mps") * old.curve("mps", 0.9)
    for _ in range(int(pol.FADE)):  # other jobs' ends, elsewhere
        old.observe("c", [], "mps", 1.0, 100.0, 100.0)
    after = old.factor("a", "b", "mps") * old.curve("mps", 0.9)
    assert after == pytest.approx(before ** 0.5, rel=0.01)  # half as far from 1: tried again, mildest first
    # the margin too: old errors weigh less than new ones
    assert pol.Learned(errors=[1.4] * 20 + [1.0] * 180).margin(0.1) < 0.1  # a tenth of them, unweighted: 0.4


def test_a_running_group_slower_than_predicted_teaches_at_once():
    lr = pol.Learned()
    # their profiles and predictions expect 0.8 of the GPU's SM busy; NVML shows 0.2: 4x slower
    assert lr.observe_live("mps", 0.65, 0.8, 0.2, 60.0) == pytest.approx(4.0 / pol.ALONE_DOUBT)
    assert lr.curve("mps", 0.65) == pytest.approx(4.0 / pol.ALONE_DOUBT) and lr.curve("mps", 0.9) >= 3.0
    assert not lr.explored("mps", 0.65)  # a warning, not what ends teach
    assert lr.observe_live("mps", 0.65, 0.8, 0.7, 60.0) == 1.0  # within what profiles may be off: nothing
    assert lr.observe_live("mps", 0.65, 0.1, 0.0, 60.0) is None  # too little expected to tell
    for _ in range(int(pol.FADE_LIVE) * 4):  # the warning fades as jobs end
        lr.observe("c", [], "mps", 1.0, 100.0, 100.0)
    assert lr.curve("mps", 0.65) < 1.2


def test_the_curve_between_two_levels_runs_showed_is_at_least_the_line_between_them():
    lr = pol.Learned(bw={("timesliced", 2): (2, 1.0), ("timesliced", 8): (2, 1.6)})
    assert lr.curve("timesliced", 0.5) == pytest.approx(1.3)  # halfway between 0.2 and 0.8
    assert lr.curve("timesliced", 0.85) == pytest.approx(1.6) and lr.curve("timesliced", 0.25) == pytest.approx(1.0)
    # nothing below: from 1 at no bandwidth
    assert pol.Learned(bw={("mps", 8): (1, 2.6)}).curve("mps", 0.4) == pytest.approx(1.8)


def test_a_job_joined_later_is_compared_with_what_each_start_predicted_while_it_held():
    """A job started alone (predicted 1x) that another joined later, predicted then to run 1.5x
    slower from then on: its end is compared with both, each for as long as it held, in alone
    time done (100 s alone, then 150 s at 1.5x: 200 s of work in 250 s, 1.25x expected)."""
    start = {"predicted_slowdown": 1.0, "peak_membw": 0.2}
    e = pol.expectation(start, "mps", 0.0)
    joiner = {"peak_membw": 0.5, "residents": {"mps": {"7": (1.5, 1.2, 1.0)}}}
    e = pol.joined(e, 100.0, joiner, "mps", 7)
    slow, factor = pol.expected(e, 0.0, 250.0)
    assert slow == pytest.approx(1.25) and factor == pytest.approx((100 + 100 * 1.2) / 200)
    assert e["group_bw"] == 0.5 and e["unseen"] == 1.0  # the most bandwidth it started into; a pairing unseen then
    # a start that predicted nothing for it (another GPU's job, or none recorded): its prediction is stale
    assert pol.joined(e, 120.0, {"peak_membw": 0.1}, "mps", 7)["unseen"] is None
    # plan() records, at a start beside residents, what it predicts for each of them
    d = plan([Candidate(2, GiB, profile=LIGHT2)], [G0], [Placed(1, ("gpu-0",), GiB, mode="mps", profile=LIGHT)])[0]
    assert d.action == START and d.details["residents"]["mps"]["1"][0] >= 1.0


def test_a_profile_that_suffered_beside_one_neighbour_is_expected_to_beside_another():
    lr = pol.Learned(alone={"light2": (1, 1.0)})
    lr.observe("light2", ["hot"], "timesliced", 1.0, 300.0, 100.0)  # 3x beside HOT
    assert lr.factor("light2", "light", "mps") == pytest.approx(3.0)  # not seen: what it showed anywhere
    assert lr.factor("light", "light2", "mps") == 1.0  # LIGHT itself has shown nothing
    d = plan([Candidate(2, GiB, profile=LIGHT2)], [G0], [Placed(1, ("gpu-0",), GiB, mode="mps", profile=LIGHT)],
             PolicyConfig(), learned=lr)[0]
    assert d.action == WAIT and "slower than alone" in d.reason, d.reason


def test_a_grow_job_is_lent_memory_no_queued_job_fits_in():
    g = GpuView("g", 0, 12 * GiB)
    d = plan([Candidate(1, 8 * GiB, seq=1, profile=LIGHT, grow=True), Candidate(2, 8 * GiB, seq=2, profile=LIGHT)], [g], [])
    assert d[0].action == START and (d[0].details["asked"], d[0].details["budget"]) == (8 * GiB, 10 * GiB)
    assert "2.0GiB more lent (--grow" in d[0].reason and d[1].action == WAIT
    # a queued job that fits in what is left (here: waiting for a clean first run) is lent nothing
    d = plan([Candidate(1, 8 * GiB, seq=1, profile=LIGHT, grow=True), Candidate(2, 3 * GiB, seq=2)], [g], [])
    assert d[0].details["budget"] == 8 * GiB and "asked" not in d[0].details and d[1].action == WAIT
    # nor is a job submitted without --grow
    d = plan([Candidate(1, 8 * GiB, seq=1, profile=LIGHT), Candidate(2, 8 * GiB, seq=2, profile=LIGHT)], [g], [])
    assert d[0].details["budget"] == 8 * GiB


def test_the_bandwidth_curve_learns_contention_once_for_every_pairing():
    lr = pol.Learned(alone={"a": (1, 1.0), "b": (1, 1.0), "c": (1, 1.0)})
    lr.observe("a", ["b"], "mps", 1.0, 100.0, 100.0, group_bw=0.4)  # unslowed at 0.4 of bandwidth
    lr.observe("a", ["b"], "mps", 1.0, 300.0, 100.0, group_bw=0.8)  # 3x at 0.8
    assert lr.curve("mps", 0.45) == pytest.approx(1.0) and lr.curve("mps", 0.85) == pytest.approx(3.0)
    assert lr.curve("mps", 1.2) == lr.curve("mps", 0.85)  # more bandwidth never costs less than seen below it
    assert lr.curve("timesliced", 0.85) == 1.0  # per mode
    # what the curve took is not blamed on the pairing as well, and a pairing never seen pays it too
    assert lr.factor("a", "b", "mps") == pytest.approx(1.0)
    assert lr.factor("c", "b", "mps") * lr.curve("mps", 0.8) >= lr.curve("mps", 0.8)
    assert lr.explored("mps", 0.85) and not lr.explored("mps", 0.95)
    assert not lr.beyond("mps", 0.95) and lr.beyond("mps", 1.05)  # one step past what runs showed, no more


def test_a_share_into_bandwidth_runs_showed_costly_waits_and_one_far_past_it_is_not_tried():
    c1, c2 = flat("c1", 0.3, bw=0.3), flat("c2", 0.3, bw=0.3)
    placed = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=c1)]
    known = {"c1": (1, 1.0), "c2": (1, 1.0), "w1": (1, 1.0), "w2": (1, 1.0)}
    lr = pol.Learned(alone=dict(known), bw={("mps", 6): (3, 3.0), ("timesliced", 6): (3, 3.0)})
    d = plan([Candidate(2, GiB, profile=c2)], [G0], placed, learned=lr)[0]
    assert d.action == WAIT and "slower than alone" in d.reason, d.reason
    w1, w2 = flat("w1", 0.3, bw=0.45), flat("w2", 0.3, bw=0.45)
    wide = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=w1)]
    low = pol.Learned(alone=dict(known), bw={("mps", 2): (3, 1.0), ("timesliced", 2): (3, 1.0)})
    mps_only = dataclasses.replace(G0, compute_mode="exclusive_process")
    d = plan([Candidate(2, GiB, profile=w2)], [mps_only], wide, learned=low)[0]
    # 0.9 is more than one step past what runs showed (and past KNOWN_BW): not made under MPS,
    # whatever the model says; time-sliced, kernels do not run at once, so bandwidth does not sum
    assert d.action == WAIT and d.details["slowdown"]["mps"] < 1.5 and "one step past" in d.reason, d.reason
    assert plan([Candidate(2, GiB, profile=w2)], [G0], wide, learned=low)[0].mode == "timesliced"
    assert plan([Candidate(2, GiB, profile=w2)], [G0], wide)[0].action == START  # nothing learned: the model


def test_one_step_past_what_runs_showed_is_an_exploration_with_its_harm_bounded():
    """A share into bandwidth no shared run has shown yet, one step past it, is made only where
    the overlap is so short a part of each one's run that were it EXPLORE_WORST x slower than
    predicted there, each would still end within the bound: a resident near its end, say."""
    e1, e2 = flat("e1", 0.3, bw=0.35), flat("e2", 0.3, bw=0.35)  # 0.7: one step past KNOWN_BW
    lr = pol.Learned(alone={"e1": (1, 1.0), "e2": (1, 1.0)})
    # under MPS, where kernels run at once and bandwidth sums (time-sliced it does not)
    mps_only = dataclasses.replace(G0, compute_mode="exclusive_process")
    fresh = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=e1, elapsed=0.0)]
    d = plan([Candidate(2, GiB, profile=e2)], [mps_only], fresh, learned=lr)[0]
    assert d.action == WAIT and "no shared run has shown" in d.reason, d.reason
    ending = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=e1, elapsed=92.0)]
    d = plan([Candidate(2, GiB, profile=flat("e2", 0.3, bw=0.35, runtime=400.0))], [mps_only], ending, learned=lr)[0]
    assert (d.action, d.mode) == (START, "mps") and d.details["explore"] and "exploring" in d.reason, d.reason
    # where a job is in its profile: what its start predicted it got done, when the caller knows
    slow = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=e1, elapsed=92.0, done=46.0)]
    d = plan([Candidate(2, GiB, profile=flat("e2", 0.3, bw=0.35, runtime=400.0))], [mps_only], slow, learned=lr)[0]
    assert d.action == WAIT, d.reason


def test_a_profile_never_run_alone_here_runs_alone_once():
    """Its shared runs are measured against a stored alone time nobody has checked: when it
    would start on an empty GPU anyway, it runs there alone to its end, once (one check at a
    time per profile), and nothing starts beside it meanwhile."""
    lr, cfg = pol.Learned(), PolicyConfig(check_alone=True)
    d = plan([Candidate(1, GiB, seq=1, profile=LIGHT), Candidate(2, GiB, seq=2, profile=LIGHT2)], [G0], [], cfg, learned=lr)
    assert d[0].action == START and d[0].details["check_alone"] and "alone this once" in d[0].reason
    assert d[1].action == WAIT and "runs alone on GPU0 this once" in d[1].reason
    placed = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=LIGHT, alone=True)]
    g1 = GpuView("gpu-1", 1, int(79.6 * GiB), mps="active")
    d = plan([Candidate(3, GiB, seq=3, profile=LIGHT)], [G0, g1], placed, cfg, learned=lr)[0]
    assert d.action == START and d.gpus == ("gpu-1",) and "check_alone" not in d.details  # one check at a time
    lr.checked("light2")
    d = plan([Candidate(2, GiB, seq=2, profile=LIGHT2)], [G0], [], cfg, learned=lr)[0]
    assert d.action == START and "check_alone" not in d.details  # its alone time is known
    assert "check_alone" not in plan([Candidate(1, GiB, profile=LIGHT)], [G0], [], cfg)[0].details  # no learning: no check
    assert "check_alone" not in plan([Candidate(1, GiB, profile=LIGHT)], [G0], [], learned=lr)[0].details  # not asked for


def test_a_job_past_its_profiles_end_is_taken_at_its_peak_not_its_last_level():
    # bandwidth-heavy at first, idle at its end: 200 s past its 100 s profile, where it really is is unknown
    early = Profile(name="early", step=1.0, sm=np.r_[np.full(90, 0.6), np.full(10, 0.05)], mem=np.full(100, GiB),
                    membw=np.r_[np.full(90, 0.8), np.full(10, 0.0)], runtime=100.0)
    cand = [Candidate(2, GiB, profile=flat("bw", 0.3, bw=0.6))]
    placed = [Placed(1, ("gpu-0",), GiB, mode="mps", profile=early, elapsed=300.0)]
    d = plan(cand, [G0], placed)[0]
    assert d.details["peak_membw"] == pytest.approx(1.4)
    assert d.details["slowdown"]["mps"] > 1.2  # its last level (no bandwidth) would have said it costs nothing


def test_the_status_quo_keeps_what_its_residents_already_pay_beside_each_other():
    # two residents slowed 1.3x beside each other; a third like them costs no one more than that
    placed = [Placed(i, ("gpu-0",), GiB, mode="mps", profile=LIGHT) for i in (1, 2)]
    lr = pol.Learned(alone={"light": (1, 1.0)}, corun={("light", "light", "mps"): (5, 1.3)}, errors=[1.05] * 10,
                     errors_seen=[1.05] * 10, bw={("mps", 6): (5, 1.0)})
    g = GpuView("gpu-0", 0, 12 * GiB, mps="active")
    d = plan([Candidate(3, GiB, profile=flat("light", 0.2))], [g], placed, learned=lr)[0]
    assert (d.action, d.mode) == (START, "mps"), d.reason
    tp = d.details["throughput"]
    # waiting: both at what runs showed they pay beside each other, discounted as they are now
    assert tp["wait"] == pytest.approx(2 / 1.3 / (1 + lr.seen_margin(0.1)), rel=0.01) and tp["mps"] > tp["wait"] + 0.25
