"""plan() and its helpers pinned where mutation testing found a wrong line would pass the tests
(issue 28, item 3; bench/mutation.py): boundaries (a budget equal to a GPU, an MPS group at
exactly the GPU), which decision a hold is written on, and the arithmetic of the learned figures.
test_policy.py has the behaviour's main cases."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from colo.sched import assess, grid, policy as pol
from colo.sched.policy import ALONE_DOUBT, START, WAIT, Candidate, GpuView, Placed, PolicyConfig, plan
from colo.sched.interference import MPS_CAP
from colo.profiles import Profile

GiB = 1024**3


def flat(name, sm, bw=0.2, runtime=100.0, cache_bound=False, runs=5):
    n = int(runtime)
    return Profile(name=name, step=1.0, sm=np.full(n, sm), mem=np.full(n, GiB), membw=np.full(n, bw),
                   runtime=runtime, cache_bound=cache_bound, runs=runs)


TINY = flat("tiny", 0.05, bw=0.02)


# ---- can a job ever fit -------------------------------------------------------------------------

def test_a_budget_equal_to_the_largest_gpu_can_fit():
    gpus = [GpuView("a", 0, 16 * GiB), GpuView("b", 1, 8 * GiB)]
    assert pol.can_ever_fit(16 * GiB, 1, gpus) is None
    assert pol.can_ever_fit(16 * GiB + 1, 1, gpus) == (
        "budget 16GiB per GPU is more than the largest usable GPU memory (16GiB, reserve excluded)")
    # two GPUs: the second largest decides
    assert pol.can_ever_fit(8 * GiB, 2, gpus) is None
    assert pol.can_ever_fit(8 * GiB + 1, 2, gpus) is not None
    assert pol.can_ever_fit(GiB, 2, gpus[:1]) == "needs 2 GPUs, this node has 1"
    assert pol.can_ever_fit(GiB, 3, gpus) == "needs 3 GPUs, this node has 2"
    assert pol.can_ever_fit(10**15, 0, []) is None


def test_no_gpu_in_service_most_free_is_zero():
    d = plan([Candidate(1, GiB, profile=TINY)], [GpuView("p", 0, 16 * GiB, compute_mode="prohibited")], [])[0]
    assert d.action == WAIT and d.details == {"need": GiB, "most_free": 0}


def test_a_budget_equal_to_the_free_memory_starts():
    g = GpuView("a", 0, 16 * GiB)
    d = plan([Candidate(1, 10 * GiB, profile=TINY)], [g], [Placed(9, ("a",), 6 * GiB, profile=TINY)])[0]
    assert d.action == START and d.details["left"] == 0
    d = plan([Candidate(1, 10 * GiB + 1, profile=TINY)], [g], [Placed(9, ("a",), 6 * GiB, profile=TINY)])[0]
    assert d.action == WAIT and d.details == {"need": 10 * GiB + 1, "most_free": 10 * GiB}


def test_free_budget_subtracts_every_placed_job_on_each_of_its_gpus():
    gpus = [GpuView("a", 0, 16 * GiB), GpuView("b", 1, 16 * GiB)]
    placed = [Placed(1, ("a", "b"), 3 * GiB), Placed(2, ("b",), GiB), Placed(3, ("gone",), GiB)]
    assert pol.free_budget(gpus, placed) == {"a": 13 * GiB, "b": 12 * GiB}


# ---- holds ------------------------------------------------------------------------------------------

def test_a_hold_is_written_on_the_waiting_jobs_decision_not_the_first_one():
    a, b = GpuView("a", 0, 16 * GiB), GpuView("b", 1, 16 * GiB)
    placed = [Placed(8, ("a",), 10 * GiB, profile=TINY), Placed(9, ("b",), 10 * GiB, profile=TINY)]
    first = Candidate(1, 4 * GiB, seq=1, priority=1, queued_at=0.0, profile=TINY)  # starts
    big = Candidate(2, 12 * GiB, seq=2, queued_at=0.0, profile=TINY)  # waits, long enough for a hold
    d = plan([first, big], [a, b], placed, PolicyConfig(hold_after=60), now=100.0)
    assert [x.job_id for x in d] == [1, 2]
    assert d[0].action == START and "held" not in d[0].reason and "held" not in d[0].details
    assert d[1].action == WAIT and d[1].details["held"] == [1], d[1]
    assert "GPU1 held for it (waiting 1 min): nothing new starts there until it does" in d[1].reason


def test_a_hold_needs_the_full_wait():
    a = GpuView("a", 0, 16 * GiB)
    placed = [Placed(8, ("a",), 10 * GiB, profile=TINY)]
    big = Candidate(2, 12 * GiB, queued_at=40.0, profile=TINY)
    assert "held" not in plan([big], [a], placed, PolicyConfig(hold_after=60), now=99.9)[0].details
    assert plan([big], [a], placed, PolicyConfig(hold_after=60), now=100.0)[0].details["held"] == [0]


def test_a_hold_takes_as_many_gpus_as_the_job_needs_most_free_first():
    g = [GpuView(f"g{i}", i, 16 * GiB) for i in range(3)]
    placed = [Placed(7, ("g0",), 8 * GiB, profile=TINY), Placed(8, ("g1",), 2 * GiB, profile=TINY),
              Placed(9, ("g2",), 4 * GiB, profile=TINY)]
    d = plan([Candidate(1, 16 * GiB, gpus=2, profile=TINY)], g, placed, PolicyConfig(hold_after=1), now=10.0)[0]
    assert d.details["held"] == [1, 2] and "GPU1, GPU2 held for it" in d.reason
    # one held last time that can still take it stays, with the next most free beside it
    d = plan([Candidate(1, 16 * GiB, gpus=2, held=(0, 2), profile=TINY)], g, placed, PolicyConfig(hold_after=1),
             now=10.0)[0]
    assert d.details["held"] == [0, 2]
    # a job no GPU can ever take is held nothing
    d = plan([Candidate(1, 17 * GiB, profile=TINY)], g, placed, PolicyConfig(hold_after=1), now=10.0)[0]
    assert "held" not in d.details


def test_durations_in_a_hold_reason():
    assert assess._duration(59) == "0 min" and assess._duration(60) == "1 min" and assess._duration(3599) == "59 min"
    assert assess._duration(3600) == "1 h 0 min" and assess._duration(3720) == "1 h 2 min"
    assert assess._duration(7080) == "1 h 58 min"


def test_a_hold_says_how_long_the_job_waited_and_any_positive_wait_holds():
    a = GpuView("a", 0, 16 * GiB)
    placed = [Placed(8, ("a",), 10 * GiB, profile=TINY)]
    big = Candidate(2, 12 * GiB, queued_at=1000.0, profile=TINY)
    assert "(waiting 2 min)" in plan([big], [a], placed, PolicyConfig(hold_after=60), now=1150.0)[0].reason
    assert plan([big], [a], placed, PolicyConfig(hold_after=0.5), now=1000.5)[0].details["held"] == [0]


def test_an_unprofiled_job_fills_an_empty_gpu_exactly():
    d = plan([Candidate(1, 16 * GiB)], [GpuView("a", 0, 16 * GiB)], [])[0]
    assert (d.action, d.mode, d.details["predicted_slowdown"]) == (START, "timesliced", 1.0)


def test_an_unprofiled_job_skips_the_best_fit_gpu_beside_a_job_not_well_known():
    a, b = GpuView("a", 0, 16 * GiB), GpuView("b", 1, 16 * GiB)
    young = flat("young", 0.05, bw=0.02, runs=1)  # one run: not well known yet
    # GPU0 fits it best, but its job is not well known; GPU1's is (both shares would be costly)
    placed = [Placed(9, ("a",), 8 * GiB, profile=young), Placed(8, ("b",), 2 * GiB, profile=TINY)]
    d = plan([Candidate(1, 4 * GiB)], [a, b], placed)[0]
    assert (d.action, d.gpus, d.mode) == (START, ("b",), "timesliced")
    assert plan([Candidate(1, 4 * GiB)], [a, b], placed, PolicyConfig(well_known_runs=1))[0].gpus == ("a",)
    # beside two well-known jobs: not either
    placed = [Placed(9, ("a",), 4 * GiB, profile=TINY), Placed(7, ("a",), 4 * GiB, profile=TINY),
              Placed(8, ("b",), 2 * GiB, profile=TINY)]
    assert plan([Candidate(1, 4 * GiB)], [a, b], placed)[0].gpus == ("b",)


def test_an_unprofiled_job_is_refused_a_best_fit_gpu_of_two_well_known_jobs_where_another_passes_the_filter():
    a, b = GpuView("a", 0, 16 * GiB), GpuView("b", 1, 16 * GiB)
    idle = [Placed(9, ("a",), 4 * GiB, profile=flat("t1", 0.01, 0.01)), Placed(7, ("a",), 4 * GiB, profile=flat("t2", 0.01, 0.01))]
    heavy = Placed(8, ("b",), 2 * GiB, profile=flat("heavy", 1.0, bw=0.9, cache_bound=True))
    # GPU1 (one well-known job) lets it past the pass's filter, but sharing with its job costs
    # too much; GPU0 fits best and its two jobs would cost it nothing, yet two are one too many
    d = plan([Candidate(1, 4 * GiB)], [a, b], [*idle, heavy])[0]
    assert d.action == WAIT and d.reason.startswith("waiting: this job has no profile: it runs alone or beside one")
    assert plan([Candidate(1, 4 * GiB)], [a, b], idle)[0].gpus == ("b",)  # GPU1 empty: there


def test_an_unprofiled_job_may_join_a_job_of_exactly_well_known_runs():
    g = GpuView("a", 0, 16 * GiB)
    d = plan([Candidate(1, 4 * GiB)], [g], [Placed(9, ("a",), 4 * GiB, profile=flat("w", 0.05, 0.02, runs=3))])[0]
    assert (d.action, d.mode) == (START, "timesliced")
    d = plan([Candidate(1, 4 * GiB)], [g], [Placed(9, ("a",), 4 * GiB, profile=flat("w", 0.05, 0.02, runs=2))])[0]
    assert d.action == WAIT and "beside one well-known job (a profile of 3+ runs)" in d.reason


def test_unprofiled_share_places_a_job_with_no_profile_best_fit_as_any_other():
    """Not predicted costly anywhere: an empty EXCLUSIVE_PROCESS GPU with more room is not preferred."""
    a, x = GpuView("a", 0, 16 * GiB), GpuView("x", 1, 32 * GiB, compute_mode="exclusive_process", mps="active")
    d = plan([Candidate(1, 4 * GiB)], [a, x], [Placed(9, ("a",), 8 * GiB, profile=TINY)], PolicyConfig(unprofiled_share=True))[0]
    assert (d.action, d.gpus, d.mode) == (START, ("a",), "timesliced") and "no profile yet, this run is profiled" in d.reason


def test_gpu_ids_and_type_restrict_the_pass_over_best_fit():
    gpus = [GpuView("a", 0, 16 * GiB, name="NVIDIA A100"), GpuView("b", 1, 16 * GiB, name="NVIDIA H100")]
    placed = [Placed(9, ("a",), 8 * GiB, profile=TINY)]  # GPU0 fits best
    assert plan([Candidate(1, 4 * GiB, profile=TINY)], gpus, placed)[0].gpus == ("a",)
    assert plan([Candidate(1, 4 * GiB, gpu_ids=(1,), profile=TINY)], gpus, placed)[0].gpus == ("b",)
    assert plan([Candidate(1, 4 * GiB, gpu_type="h100", profile=TINY)], gpus, placed)[0].gpus == ("b",)


def test_a_running_job_with_no_profile_is_taken_at_the_assumed_levels():
    g = GpuView("a", 0, 80 * GiB)
    d = plan([Candidate(1, GiB, profile=flat("k", 0.05, bw=0.3))], [g], [Placed(9, ("a",), GiB)])[0]
    assert d.action == START and d.mode == "timesliced"  # beside a stranger: time-sliced only
    assert d.details["peak_membw"] == pytest.approx(0.5 + 0.3)  # unknown_membw + its own
    assert d.details["peak_sm"] == pytest.approx(1.0 + 0.05)  # unknown_sm + its own
    assert d.details["sm_by_job"] == {"9": 1.0, "this": 0.05}


def test_a_profile_is_put_on_the_grid_by_its_own_step_and_smeared():
    """Each grid step (2 s) the peak of the profile's samples in it, whatever their step; then each
    point the most within a tenth of the run (PHASE) either way."""
    sm = np.full(200, 0.1)
    sm[150] = 0.9  # 75 s into a run sampled every 0.5 s: grid step 37 of 50
    fine = Profile(name="fine", step=0.5, sm=sm, mem=np.full(200, GiB), membw=np.full(200, 0.2), runtime=100.0)
    a = grid._arrays(fine, 2.0, 3600.0)
    assert len(a.sm) == 50 and a.peak_sm == 0.9 and np.flatnonzero(a.sm == 0.9).tolist() == list(range(32, 43))
    sm = np.full(25, 0.1)
    sm[10] = 0.9  # 40-44 s of a run sampled every 4 s: grid steps 20 and 21
    coarse = Profile(name="coarse", step=4.0, sm=sm, mem=np.full(25, GiB), membw=np.full(25, 0.2), runtime=100.0)
    assert np.flatnonzero(grid._arrays(coarse, 2.0, 3600.0).sm == 0.9).tolist() == list(range(15, 27))


def test_overlap_is_counted_in_whole_grid_steps():
    g = GpuView("a", 0, 80 * GiB, mps="active")
    res = Placed(9, ("a",), GiB, mode="mps", profile=flat("r", 0.2))
    assert plan([Candidate(1, GiB, profile=flat("s", 0.2, runtime=1.0))], [g], [res])[0].details["overlap_s"] == 2.0
    assert plan([Candidate(1, GiB, profile=flat("m", 0.2, runtime=9.0))], [g], [res])[0].details["overlap_s"] == 10.0


def test_the_policy_defaults_are_the_daemons():
    """`colo sim` with no configuration decides as a daemon with none does."""
    from colo.config import Config

    cfg, daemon = PolicyConfig(), Config()
    for knob in ("saturation", "bw_saturation", "min_gain", "hold_after", "slowdown_bound", "unprofiled_share",
                 "multi_user_mps", "use_mps", "lend"):
        assert getattr(cfg, knob) == getattr(daemon, knob), knob
    assert cfg.max_mps_clients == 48  # what one MPS server takes on Volta and newer


# ---- MPS: one context within the GPU slows nobody; past it, the model decides --------------------

def mps_pair(sm, bw=0.1, learned=None, **cfg):
    """The decision for a job of `sm` beside one MPS client of `sm`, saturation out of the way."""
    g = GpuView("a", 0, 80 * GiB, mps="active")
    res = Placed(9, ("a",), GiB, mode="mps", profile=flat("res", sm, bw))
    c = Candidate(1, GiB, profile=flat("cand", sm, bw))
    return plan([c], [g], [res], PolicyConfig(**{"saturation": 3.0, "bw_saturation": 3.0, "margin": 0.0,
                                                 "seen_margin": 0.0, **cfg}), learned=learned)[0]


# both profiles' alone times checked by runs here: no ALONE_DOUBT in the bound
CHECKED = pol.Learned(alone={"res": (1, 1.0), "cand": (1, 1.0)})


def test_an_mps_group_within_the_gpu_is_predicted_unslowed():
    d = mps_pair(0.5)  # summed SM exactly 1.0
    assert d.mode == "mps" and d.details["slowdown_this"]["mps"] == 1.0
    # what the check assumes adds only the doubt of alone times no run here has shown (half of
    # ALONE_DOUBT each way), nothing of the model's; what the start records (and its end is
    # compared with) is the model's alone: no doubt in it
    assert d.details["slowdown"]["mps"] == pytest.approx(ALONE_DOUBT ** 0.5)
    assert d.details["predicted_slowdown"] == 1.0
    assert d.details["residents"]["mps"] == {"9": (1.0, 1.0, 1.0)}
    d = mps_pair(0.5, learned=CHECKED)  # both alone times checked: nothing at all
    assert d.details["slowdown"]["mps"] == 1.0 and d.details["predicted_slowdown"] == 1.0


def test_an_mps_pair_summing_past_the_gpu_is_predicted_slowed():
    # summed SM 2.0: MPS runs up to 1.33 of it at once (the H200's matmul pair: 1.33x), each gets 1.33 / 2
    d = mps_pair(1.0, slowdown_bound=2.0)
    assert d.details["slowdown_this"]["mps"] == pytest.approx(1.5)
    assert d.details["predicted_slowdown"] == pytest.approx(1.5)
    assert d.details["slowdown"]["mps"] == pytest.approx(1.5 * ALONE_DOUBT ** 0.5)  # the unchecked alone times
    assert mps_pair(1.0, learned=CHECKED, slowdown_bound=2.0).details["slowdown"]["mps"] == pytest.approx(1.5)
    assert d.details["residents"]["mps"] == {"9": (pytest.approx(1.5), 1.0, 1.0)}  # the resident's, from now on
    assert d.details["peak_sm"] == pytest.approx(2.0) and d.details["saturation"] == 3.0
    d = mps_pair(0.4, bw=0.6, slowdown_bound=2.0)  # SM within, bandwidth 1.2: slowed too
    assert d.details["slowdown_this"]["mps"] > 1.05


def test_min_gain_is_asked_only_of_a_share_the_model_says_slows_someone():
    d = mps_pair(0.5, min_gain=1.0, slowdown_bound=2.0)  # nobody slowed: 2.0 beats 1.0 waiting
    # time-sliced as free: each context busy 0.5 / 1.21 of the time (the H200-calibrated model)
    assert d.action == START and d.details["throughput"] == {"wait": 1.0, "mps": 2.0, "timesliced": pytest.approx(2.0)}
    d = mps_pair(0.52 * MPS_CAP, min_gain=1.0, slowdown_bound=2.0)  # 1.04x: 1.92 must beat 1.0 by 1.0
    assert d.action == WAIT and "throughput 1.92 under MPS vs 1.00 waiting" in d.reason


def test_waiting_discounts_residents_that_share_already_by_the_margin():
    g = GpuView("a", 0, 80 * GiB, mps="active")
    c = Candidate(1, GiB, profile=flat("c", 0.1, 0.1))
    one = [Placed(8, ("a",), GiB, mode="mps", profile=flat("r1", 0.1, 0.2))]
    assert plan([c], [g], one)[0].details["throughput"]["wait"] == 1.0  # alone now: not discounted
    two = one + [Placed(9, ("a",), GiB, mode="mps", profile=flat("r2", 0.1, 0.2))]
    assert plan([c], [g], two)[0].details["throughput"]["wait"] == pytest.approx(2 / 1.1)


def test_the_learned_factor_recorded_is_the_candidates():
    g = GpuView("a", 0, 80 * GiB, mps="active")
    lrn = pol.Learned(corun={("c", "r", "mps"): (1, 1.3)})  # c beside r: 1.3x; r beside c: nothing shown
    d = plan([Candidate(1, GiB, profile=flat("c", 0.1, 0.1))], [g],
             [Placed(9, ("a",), GiB, mode="mps", profile=flat("r", 0.1, 0.1))], learned=lrn)[0]
    assert d.details["learned_factor"]["mps"] == pytest.approx(1.3)
    assert d.details["residents"]["mps"] == {"9": (1.0, 1.0, 1.0)}


def test_a_profile_measured_on_this_gpu_model_is_not_checked_alone():
    lp = Profile(name="lp", step=1.0, sm=np.full(100, 0.3), mem=np.full(100, GiB), membw=np.full(100, 0.2),
                 runtime=100.0, runs=5, gpu="NVIDIA H100")
    cfg = PolicyConfig(check_alone=True)
    same = plan([Candidate(1, GiB, profile=lp)], [GpuView("a", 0, 80 * GiB, name="NVIDIA H100")], [], cfg, learned=pol.Learned())[0]
    assert same.action == START and "check_alone" not in same.details
    other = plan([Candidate(1, GiB, profile=lp)], [GpuView("a", 0, 80 * GiB, name="NVIDIA A100")], [], cfg, learned=pol.Learned())[0]
    assert other.details["check_alone"] is True
    assert not pol._measured_on(dataclasses.replace(lp, gpu=""), GpuView("a", 0, GiB, name=""))


def test_mps_is_weighed_at_saturation_too_and_the_reasons_say_where_it_saturates():
    """Saturation no longer blocks MPS (the model says what it costs there): it is where a reason
    says the GPU is below it, or that sharing would saturate it."""
    g = GpuView("a", 0, 80 * GiB, mps="active")
    res = Placed(9, ("a",), GiB, mode="mps", profile=flat("res", 0.25))  # 0.25 + 0.5: exactly 0.75
    below = plan([Candidate(1, GiB, profile=flat("c", 0.49))], [g], [res], PolicyConfig(saturation=0.75))[0]
    assert below.mode == "mps" and "< 75 %" in below.reason
    at = plan([Candidate(1, GiB, profile=flat("c", 0.5))], [g], [res], PolicyConfig(saturation=0.75))[0]
    assert at.mode == "mps" and "predicted peak SM 75 % (job 9: 25 %, this job: 50 %);" in at.reason
    # refused (a bound nothing shared meets): the refusal says it would saturate only at saturation
    tight = PolicyConfig(saturation=0.75, slowdown_bound=1.05)
    below = plan([Candidate(1, GiB, profile=flat("c", 0.49))], [g], [res], tight)[0]
    assert below.action == WAIT and "saturate" not in below.reason
    assert below.reason.endswith(": a job would run 1.23x slower than alone (bound 1.05x)")  # 1.1 x 1.118
    at = plan([Candidate(1, GiB, profile=flat("c", 0.5))], [g], [res], tight)[0]
    assert at.action == WAIT and ("sharing would saturate: predicted peak SM 75 % (job 9: 25 %, this job: 50 %) "
                                  ">= 75 %; a job would run 1.23x") in at.reason


def test_each_start_in_a_pass_is_seen_by_the_next_candidate():
    """Candidates of one pass are placed against the GPU as the earlier starts left it: the first
    one's profile from its beginning (its peak comes first here), not the state before it."""
    g = GpuView("a", 0, 80 * GiB, mps="active")
    front = Profile(name="front", step=1.0, sm=np.r_[np.full(50, 0.5), np.full(50, 0.05)], mem=np.full(100, GiB),
                    membw=np.full(100, 0.1), runtime=100.0, runs=5)
    res = Placed(9, ("a",), GiB, mode="mps", profile=flat("res", 0.05, 0.05))
    c2 = Candidate(2, GiB, seq=2, profile=flat("c2", 0.9))
    assert plan([c2], [g], [res])[0].details["slowdown_this"]["mps"] == 1.0  # beside the resident alone: 0.95
    d = plan([Candidate(1, GiB, seq=1, profile=front), c2], [g], [res])
    assert d[0].mode == "mps"
    assert d[1].details["peak_sm"] == pytest.approx(1.45)  # 0.05 + 0.5 + 0.9
    # front's 0.5 for its first 25 of 50 grid steps, smeared over a tenth of its run (PHASE: 5
    # steps) to 30: 1.45 of SM then (MPS runs MPS_CAP of it at once), 1.0 after
    assert d[1].details["slowdown_this"]["mps"] == pytest.approx(50 / (30 / (1.45 / MPS_CAP) + 20))
    assert d[1].details["slowdown_this"]["mps"] > 1.0  # what the first start left is seen


def test_a_candidates_unseen_pairings_and_the_peak_bandwidth_of_everyone():
    g = GpuView("a", 0, 80 * GiB)
    placed = [Placed(8, ("a",), GiB, mode="timesliced", profile=flat("r1", 0.1, 0.3)),
              Placed(9, ("a",), GiB, mode="timesliced", profile=flat("r2", 0.1, 0.25))]
    d = plan([Candidate(1, GiB, profile=flat("c", 0.1, 0.2))], [g], placed, PolicyConfig(use_mps=False))[0]
    assert d.details["unseen"]["timesliced"] == 2.0  # the candidate beside two it was never seen with
    assert d.details["peak_membw"] == pytest.approx(0.75)
    assert d.details["peak_sm"] == pytest.approx(0.3)


def test_thread_percentage_is_peak_sm_with_headroom_in_5_percent_steps():
    cfg = PolicyConfig()
    arr = lambda sm: grid._arrays(flat(f"p{sm}", sm), cfg.step, cfg.horizon)  # noqa: E731
    assert pol.thread_pct(arr(0.40), cfg) == 50  # 0.40 * 1.25 = 0.5
    assert pol.thread_pct(arr(0.41), cfg) == 55  # rounded up to the next 5 %
    assert pol.thread_pct(arr(0.02), cfg) == 10  # at least 10
    assert pol.thread_pct(arr(0.9), cfg) == 100  # at most 100
    d = plan([Candidate(1, GiB, profile=flat("q", 0.40))], [GpuView("a", 0, 16 * GiB)], [])[0]
    assert d.mode == "mps" and d.thread_pct == 50 and d.details["thread_pct"] == 50


def test_a_gpu_with_the_most_mps_clients_one_server_takes_refuses_more():
    g = GpuView("a", 0, 80 * GiB, compute_mode="exclusive_process", mps="active")
    placed = [Placed(10 + i, ("a",), GiB, mode="mps", profile=TINY) for i in range(3)]
    d = plan([Candidate(1, GiB, profile=TINY)], [g], placed, PolicyConfig(max_mps_clients=3))[0]
    assert d.action == WAIT and "GPU0 has 3 MPS clients, the most one server takes" in d.reason
    d = plan([Candidate(1, GiB, profile=TINY)], [g], placed[:2], PolicyConfig(max_mps_clients=3))[0]
    assert d.action == START and d.mode == "mps"


# ---- order, filters ---------------------------------------------------------------------------------

def test_order_is_priority_then_submission():
    cs = [Candidate(1, GiB, seq=3), Candidate(2, GiB, seq=1, priority=-1), Candidate(3, GiB, seq=2),
          Candidate(4, GiB, seq=4, priority=2)]
    assert [c.job_id for c in pol.order(cs)] == [4, 3, 1, 2]


def test_gpu_filters():
    gpus = [GpuView("a", 0, GiB, name="NVIDIA A100-SXM4-80GB"), GpuView("b", 1, GiB, name="NVIDIA H100")]
    assert pol.gpu_allowed(gpus[0]) and pol.gpu_allowed(gpus[0], (0,), "a100")
    assert not pol.gpu_allowed(gpus[0], (1,)) and not pol.gpu_allowed(gpus[0], (), "H100")
    assert pol.gpu_filter_refusal((), None, 2, gpus) is None
    assert pol.gpu_filter_refusal((0,), None, 1, gpus) is None
    assert pol.gpu_filter_refusal((), "h100", 1, gpus) is None
    assert pol.gpu_filter_refusal((0,), "h100", 1, gpus) == (
        "--gpu-id 0 and --gpu-type 'h100' leaves 0 GPU(s) for a job of 1 (this node has: GPU0 NVIDIA A100-SXM4-80GB, "
        "GPU1 NVIDIA H100)")
    assert pol.gpu_filter_refusal((0, 1), None, 3, gpus).startswith("--gpu-id 0,1 leaves 2 GPU(s) for a job of 3")


# ---- lending to --grow jobs -------------------------------------------------------------------------

def test_lend_is_in_256_mib_steps_up_to_lend_times_the_budget():
    g = GpuView("a", 0, 16 * GiB)
    q = 256 * 1024**2
    d = plan([Candidate(1, 4 * GiB, grow=True, profile=TINY)], [g], [], PolicyConfig(lend=1.25))[0]
    assert d.details["budget"] == 5 * GiB and d.details["asked"] == 4 * GiB and d.details["left"] == 11 * GiB
    # 1 GiB + 1 byte asked: 1.25x rounds up to 1.5 GiB in steps, less what was asked, in whole steps
    d = plan([Candidate(1, GiB + 1, grow=True, profile=TINY)], [g], [], PolicyConfig(lend=1.25))[0]
    assert d.details["budget"] == GiB + 1 + q
    # 1.1 GiB asked: 1.25x is 1.375 GiB, up to 1.5 GiB; of the 0.4 GiB more, one whole step
    mib = 1024**2
    d = plan([Candidate(1, GiB + 100 * mib, grow=True, profile=TINY)], [g], [], PolicyConfig(lend=1.25))[0]
    assert d.details["budget"] == GiB + 100 * mib + q
    # only what the GPU has left is lent
    d = plan([Candidate(1, 4 * GiB, grow=True, profile=TINY)], [g], [Placed(9, ("a",), 12 * GiB - q, profile=TINY)],
             PolicyConfig(lend=1.25))[0]
    assert d.details["budget"] == 4 * GiB + q and d.details["left"] == 0
    # a queued job that fits in what is left keeps it
    d = plan([Candidate(1, 4 * GiB, grow=True, profile=TINY), Candidate(2, 20 * GiB, profile=TINY)], [g], [],
             PolicyConfig(lend=1.25))
    assert d[0].details["budget"] == 5 * GiB  # 20 GiB never fits in 12 GiB: lent
    d = plan([Candidate(1, 4 * GiB, grow=True, profile=TINY), Candidate(2, 12 * GiB, gpus=2, profile=TINY)], [g], [],
             PolicyConfig(lend=1.25))
    assert d[0].details["budget"] == 4 * GiB and "asked" not in d[0].details  # 12 GiB would fit: nothing lent
    assert "lent" not in plan([Candidate(1, 4 * GiB, grow=True, profile=TINY)], [g], [], PolicyConfig(lend=1.0))[0].reason
    d = plan([Candidate(1, 16 * GiB, grow=True, profile=TINY)], [g], [], PolicyConfig(lend=1.25))[0]
    assert "lent" not in d.reason and "asked" not in d.details  # nothing left to lend


# ---- what runs teach (Learned) and what a start predicted (expectation) -------------------------------

def test_alone_runs_average_the_ratio_of_real_to_stored_time():
    lrn = pol.Learned()
    assert lrn.observe("p", [], "mps", 1.0, wall=120.0, stored_runtime=100.0) == pytest.approx(1.2)
    assert lrn.observe("p", [], "mps", 2.0, wall=80.0, stored_runtime=100.0) == pytest.approx(0.4)
    assert lrn.alone["p"] == (2, pytest.approx(1.0))
    assert lrn.observe("p", [], "mps", 1.0, wall=0.0, stored_runtime=100.0) is None
    assert lrn.observe("", [], "mps", 1.0, wall=10.0, stored_runtime=100.0) is None
    assert lrn.observe("q", [], "mps", 1.0, wall=10.0, stored_runtime=0.0) is None
    assert lrn.observe("q", [], "mps", 1.0, wall=10.0, stored_runtime=100.0, peak_mem=3 * GiB) is not None
    assert lrn.observe("q", [], "mps", 1.0, wall=10.0, stored_runtime=100.0, peak_mem=2 * GiB) is not None
    assert lrn.max_mem["q"] == 3 * GiB
    assert lrn.suggest_budget("q") == 3584 * 1024**2  # 3 GiB + 10 % = 3.3 GiB, up to 256 MiB steps
    assert lrn.suggest_budget("nobody") is None


def test_a_shared_run_is_corrected_by_its_alone_error_and_averaged_per_pairing():
    lrn = pol.Learned()
    lrn.observe("p", [], "mps", 1.0, wall=110.0, stored_runtime=100.0)  # alone: 1.1x its profile
    r = lrn.observe("p", ["n"], "mps", 1.2, wall=264.0, stored_runtime=100.0)  # 2.64 / 1.1 / 1.2 = 2.0
    assert r == pytest.approx(2.0) and lrn.errors == [pytest.approx(2.0)]
    assert lrn.corun[("p", "n", "mps")] == (1, pytest.approx(2.0)) and lrn.at[("p", "n", "mps")] == 2
    lrn.observe("p", ["n", "n"], "mps", 1.0, wall=110.0, stored_runtime=100.0)  # 1.0, one observation later
    # the mean of 2.0 and 1.0, the older run faded by its age (one observation of FADE): its
    # distance from 1 and its weight both x 0.5 ** (1 / 60)
    k = 0.5 ** (1 / 60)
    assert lrn.corun[("p", "n", "mps")] == (2, pytest.approx(2.0 ** k + (1.0 - 2.0 ** k) / (k + 1.0)))
    mean = lrn.corun[("p", "n", "mps")][1]
    assert lrn.factor("p", "n", "mps") == pytest.approx(mean)  # taught now: not faded
    assert lrn.factor("p", "other", "mps") == pytest.approx(mean)  # a stranger: what p showed beside anyone
    assert lrn.factor("x", "n", "mps") == 1.0
    # never seen alone: a shared run teaches its pairing all of its error (its own alone error
    # cannot be told apart), and a share of less than MIN_SHARED of its run teaches nothing
    assert lrn.observe("q", ["n"], "mps", 1.0, wall=120.0, stored_runtime=100.0) == pytest.approx(1.2)
    assert lrn.corun[("q", "n", "mps")] == (1, pytest.approx(1.2)) and lrn.errors[-1] == pytest.approx(1.2)
    assert lrn.observe("p", ["n"], "mps", 1.0, wall=500.0, stored_runtime=100.0, shared=0.09) is None
    assert lrn.corun[("p", "n", "mps")] == (2, mean) and len(lrn.errors) == 3
    assert lrn.observe("p", ["n"], "mps", 1.0, wall=500.0, stored_runtime=100.0, shared=0.1) is not None
    assert lrn.corun[("p", "n", "mps")][0] == 3


def test_the_margin_is_the_95th_percentile_of_the_errors_recent_ones_weighing_most_within_its_bounds():
    lrn = pol.Learned()
    assert lrn.margin(0.1) == 0.1  # fewer than 5 errors: the default
    lrn.errors = [1.0, 1.1, 1.2, 1.3]
    assert lrn.margin(0.1) == 0.1
    lrn.errors = [1.0, 1.1, 1.2, 1.3, 1.25]
    assert lrn.margin(0.1) == pytest.approx(0.3)  # of five, the 95th percentile is the worst
    # of 40, two errors of 0.3 are the newest 6 % of the weight (the newest weighs 1, one 60
    # errors older half): the 95th percentile; the oldest two are 4 %: below it
    lrn.errors = [1.1] * 38 + [1.3] * 2
    assert lrn.margin(0.1) == pytest.approx(0.3)
    lrn.errors = [1.3] * 2 + [1.1] * 38
    assert lrn.margin(0.1) == pytest.approx(0.1)
    lrn.errors = [1.0] * 5
    assert lrn.margin(0.1) == 0.05  # at least 5 %
    lrn.errors = [3.0] * 5
    assert lrn.margin(0.1) == 0.4 == pol.MARGIN_CAP  # at most MARGIN_CAP,
    assert pol.MARGIN_CAP < PolicyConfig().slowdown_bound - 1.0  # below the bound's
    # seen pairings: the default stands for the runs missing until five (as the oldest)
    lrn.errors, lrn.errors_seen = [3.0] * 5, []
    assert lrn.seen_margin(0.2) == pytest.approx(0.2)  # not all predictions' margin
    lrn.errors_seen = [1.0] * 4
    assert lrn.seen_margin(0.2) == pytest.approx(0.2)  # one default left: of five, the worst
    lrn.errors_seen = [1.0] * 5
    assert lrn.seen_margin(0.2) == 0.05
    lrn.errors_seen = [2.0]
    assert lrn.seen_margin(0.2) == 0.4  # a first seen run far off counts at once


def test_a_shared_run_splits_what_the_model_missed_between_the_bandwidth_curve_and_the_pairing():
    lrn = pol.Learned()
    lrn.observe("p", [], "mps", 1.0, wall=100.0, stored_runtime=100.0)  # alone: as profiled
    lrn.observe("p", ["n"], "mps", 1.0, wall=200.0, stored_runtime=100.0)  # the pairing alone explains 2x
    assert lrn.corun[("p", "n", "mps")] == (1, pytest.approx(2.0)) and lrn.bw == {}
    # 3x at summed bandwidth 0.45: the curve takes what the pairing (2x, one observation old:
    # 2 ** k) does not explain, and the pairing what the curve so updated does not
    assert lrn.observe("p", ["n"], "mps", 1.0, wall=300.0, stored_runtime=100.0, group_bw=0.45) == pytest.approx(3.0)
    k = 0.5 ** (1 / 60)
    assert lrn.bw[("mps", 4)] == (1, pytest.approx(3.0 / 2.0 ** k)) and lrn.at[("mps", 4)] == 3
    assert lrn.corun[("p", "n", "mps")] == (2, pytest.approx(2.0 ** k))  # 3 / (3 / 2 ** k), on 2 ** k
    assert lrn.curve("mps", 0.45) == pytest.approx(3.0 / 2.0 ** k)
    assert lrn.errors_seen == [] and len(lrn.errors) == 2
    lrn.observe("p", ["n"], "mps", 1.0, wall=100.0, stored_runtime=100.0, unseen=0)
    assert lrn.errors_seen == [pytest.approx(1.0)]


def test_a_profile_never_seen_alone_teaches_the_curve_only_what_passes_alone_doubt():
    lrn = pol.Learned()
    # 1.5x at 0.7 with no alone run to tell its own error apart: 1.5 / 1.25 to the curve, the
    # rest (1.25) to the pairing
    assert lrn.observe("q", ["n"], "mps", 1.0, wall=150.0, stored_runtime=100.0, group_bw=0.7) == pytest.approx(1.5)
    assert lrn.bw[("mps", 7)] == (1, pytest.approx(1.5 / ALONE_DOUBT))
    assert lrn.corun[("q", "n", "mps")] == (1, pytest.approx(ALONE_DOUBT))
    # within ALONE_DOUBT: the curve learns 1 (nothing), the pairing all of it
    lrn = pol.Learned()
    assert lrn.observe("r", ["n"], "mps", 1.0, wall=120.0, stored_runtime=100.0, group_bw=0.9) == pytest.approx(1.2)
    assert lrn.bw[("mps", 9)] == (1, 1.0) and lrn.corun[("r", "n", "mps")] == (1, pytest.approx(1.2))


def test_errors_keep_the_most_recent_200():
    lrn = pol.Learned(errors=[1.0] * 200)
    lrn.observe("p", ["n"], "mps", 1.0, wall=150.0, stored_runtime=100.0)
    assert len(lrn.errors) == 200 and lrn.errors[-1] == pytest.approx(1.5)


def test_a_rebase_keeps_what_runs_showed_of_the_alone_time_against_the_new_one():
    lrn = pol.Learned(alone={"p": (3, 1.2)})
    lrn.rebase("p", 100.0, 120.0)  # the stored time grew to what runs showed: 1.0 of it
    assert lrn.alone["p"] == (3, pytest.approx(1.0))
    lrn.rebase("p", 0.5, 1.0)
    assert lrn.alone["p"] == (3, pytest.approx(0.5))
    lrn.rebase("p", 0.0, 1.0)  # nothing known to rebase from
    lrn.rebase("p", 1.0, 0.0)
    lrn.rebase("q", 1.0, 2.0)  # never seen alone: nothing
    assert lrn.alone == {"p": (3, pytest.approx(0.5))}
    lrn.checked("q")
    lrn.checked("p")  # a check of one already known leaves it
    assert lrn.alone == {"p": (3, pytest.approx(0.5)), "q": (1, 1.0)}


def test_a_running_group_warns_at_most_live_max_and_past_alone_doubt_either_way():
    lrn = pol.Learned()
    # a reading near 0 says "much slower", not how much: LIVE_MAX (4x), less ALONE_DOUBT
    assert lrn.observe_live("mps", 0.65, 0.8, 0.0, 60.0) == pytest.approx(4.0 / ALONE_DOUBT)
    # half of LIVE_RUN's samples: half the warning
    assert pol.Learned().observe_live("mps", 0.65, 0.8, 0.2, 30.0) == pytest.approx(1.0 + (3.2 - 1.0) / 2)
    # faster than expected where the curve says 2x: 0.5x, ALONE_DOUBT of it forgiven, 1.25x
    lrn = pol.Learned(bw={("mps", 6): (1, 2.0)})
    assert lrn.observe_live("mps", 0.65, 0.4, 0.8, 60.0) == pytest.approx(2.0 * 0.5 * ALONE_DOUBT)


def test_the_curve_between_two_levels_runs_showed_is_on_the_line_between_them():
    lrn = pol.Learned(bw={("mps", 1): (1, 3.0), ("mps", 5): (1, 5.0)})
    assert lrn.curve("mps", 0.3) == pytest.approx(4.0)  # 3 + 2 * 2 / 4
    assert lrn.curve("mps", 0.1) == 3.0 and lrn.curve("mps", 0.55) == 5.0 and lrn.curve("mps", 0.9) == 5.0
    assert lrn.curve("timesliced", 0.3) == 1.0


def test_a_resident_is_charged_the_worst_of_its_present_pairings():
    lrn = pol.Learned(corun={("a", "b", "mps"): (1, 1.5), ("a", "c", "mps"): (1, 1.2), ("b", "c", "timesliced"): (1, 1.4)})
    out = lrn.among(["a", "b", "c"], np.array([True, False, True]))
    assert out.tolist() == [pytest.approx(1.5), pytest.approx(1.4), 1.0]


def test_factors_take_each_residents_pairing_and_the_candidates_worst():
    lrn = pol.Learned(corun={("c", "r1", "mps"): (1, 1.5), ("c", "r2", "mps"): (1, 1.2), ("r1", "c", "mps"): (2, 1.1)})
    assert lrn.factors(["r1", "r2"], "c", "mps").tolist() == [pytest.approx(1.1), 1.0, 1.5]
    assert lrn.factors([], "c", "mps").tolist() == [1.0]
    assert lrn.general("c") == pytest.approx(1.35) and lrn.general("r2") == 1.0
    lrn.corun[("x", "y", "mps")] = (1, 0.5)
    assert lrn.factor("x", "y", "mps") == 1.0  # never below 1: a pairing does not speed anyone up
    out = lrn.among(["r1", "c"], np.array([True, True]))
    assert out.tolist() == [pytest.approx(1.1), 1.5]
    assert lrn.among(["r1"], np.array([True])).tolist() == [1.0]
    assert lrn.unseen(["r1", "r2", "zz"], "c", "mps").tolist() == [0.0, 1.0, 1.0, 1.0]


def test_waiting_is_charged_what_the_curve_costs_the_residents_at_their_summed_bandwidth():
    g = GpuView("a", 0, 80 * GiB, mps="active")
    placed = [Placed(8, ("a",), GiB, mode="mps", profile=flat("r1", 0.1, 0.2)),
              Placed(9, ("a",), GiB, mode="mps", profile=flat("r2", 0.1, 0.2))]
    lrn = pol.Learned(bw={("mps", 9): (1, 3.0)})  # 3x at 0.9: on the line from (0, 1), 0.4 costs 1 + 2 * 4 / 9
    c = Candidate(1, GiB, profile=flat("c", 0.1, 0.1))
    d = plan([c], [g], placed, learned=lrn)[0]
    # each resident, sharing already with a pairing no run has shown, discounted by the margin
    assert d.details["throughput"]["wait"] == pytest.approx(2 / (1 + 2 * 4 / 9) / 1.1)
    # pairings runs have shown (costing nothing themselves): by the seen pairings' margin
    lrn.corun = {("r1", "r2", "mps"): (1, 1.0), ("r2", "r1", "mps"): (1, 1.0)}
    d = plan([c], [g], placed, PolicyConfig(seen_margin=0.05), learned=lrn)[0]
    assert d.details["throughput"]["wait"] == pytest.approx(2 / (1 + 2 * 4 / 9) / 1.05)


def test_the_bandwidth_curve_bins_and_the_explored_frontier():
    lrn = pol.Learned()
    assert lrn._bin(0.0) == 0 and lrn._bin(0.1) == 1 and lrn._bin(0.35) == 3 and lrn._bin(99.0) == 30
    assert lrn._bin(-1.0) == 0
    # nothing learned: up to KNOWN_BW (0.6) is explored, one step (0.7) past it may be explored
    assert lrn.curve("mps", 0.5) == 1.0 and lrn.explored("mps", 0.0) and lrn.explored("mps", 0.6)
    assert not lrn.explored("mps", 0.61) and not lrn.beyond("mps", 0.79) and lrn.beyond("mps", 0.8)
    lrn.bw = {("mps", 8): (1, 2.0)}
    assert lrn.explored("mps", 0.89) and lrn.explored("mps", 0.65) and not lrn.explored("mps", 0.9)
    assert not lrn.explored("timesliced", 0.65) and lrn.explored("timesliced", 0.6)
    assert not lrn.beyond("mps", 0.99) and lrn.beyond("mps", 1.0)
    assert lrn.beyond("timesliced", 1.0) and not lrn.beyond("timesliced", 0.99)  # the other mode's stands in
    lrn.bw = {("mps", 4): (1, 2.0)}
    assert lrn.curve("mps", 0.4) == 2.0 and lrn.curve("mps", 0.9) == 2.0
    assert lrn.curve("mps", 0.2) == pytest.approx(1.5)  # on the line from (0, 1) to (4, 2)


def test_expectation_and_shared_time():
    e = pol.expectation({"predicted_slowdown": 1.5, "learned_factor": {"mps": 1.2}, "unseen": {"mps": 2},
                         "peak_membw": 0.7, "residents": {"mps": {"9": (1.1, 1.0, 0.0)}}}, "mps", 100.0)
    assert (e["slowdown"], e["factor"], e["unseen"], e["group_bw"], e["since"], e["sharing"]) == (
        1.5, 1.2, 2.0, 0.7, 100.0, True)
    alone = pol.expectation({}, "timesliced", 5.0)
    assert (alone["slowdown"], alone["factor"], alone["unseen"], alone["sharing"]) == (1.0, 1.0, 0.0, False)
    assert pol.expectation({"slowdown_this": {"mps": 1.3}}, "mps", 0.0)["slowdown"] == 1.3
    # shared for [100, 160], alone after: 60 of 100 s
    later = pol.left(e, 160.0)
    assert later["slowdown"] == 1.0 and later["sharing"] is False and later["shared"] == 60.0
    assert pol.left(later, 170.0) is later
    assert pol.shared(later, 100.0, 200.0) == pytest.approx(0.6)
    assert pol.shared(e, 100.0, 200.0) == 1.0 and pol.shared({}, 0.0, 1.0) == 1.0
    # its wall time over the alone time each prediction said it would get done
    slow, fac = pol.expected(later, 100.0, 200.0)
    assert slow == pytest.approx(100.0 / (60.0 / 1.5 + 40.0))
    assert fac == pytest.approx((60.0 * 1.2 / 1.5 + 40.0) / (60.0 / 1.5 + 40.0))
    # a neighbour joins at 180: the 20 s alone are folded in on top of the 60 s shared
    again = pol.joined(later, 180.0, {"residents": {"mps": {"5": (1.25, 1.0, 0.0)}}}, "mps", 5)
    assert again["acc"] == [pytest.approx(40.0 + 20.0), pytest.approx(48.0 + 20.0)]


def test_a_job_joined_later_takes_that_starts_prediction():
    e = pol.expectation({"predicted_slowdown": 1.0, "peak_membw": 0.3}, "mps", 0.0)
    j = pol.joined(e, 50.0, {"peak_membw": 0.8, "residents": {"mps": {"7": (1.4, 1.1, 1.0)}}}, "mps", 7)
    assert (j["slowdown"], j["factor"], j["unseen"], j["group_bw"], j["since"]) == (1.4, 1.1, 1.0, 0.8, 50.0)
    assert j["acc"] == [50.0, 50.0]
    k = pol.left(j, 120.0)  # 70 s at 1.4x: 50 s of its alone time, its factor 1.1 over them
    assert k["acc"] == [pytest.approx(100.0), pytest.approx(50.0 + 70.0 * 1.1 / 1.4)]
    none = pol.joined(e, 50.0, {"peak_membw": 0.1}, "mps", 7)
    assert none["unseen"] is None and none["slowdown"] == 1.0 and none["group_bw"] == 0.3
    # started with no bandwidth recorded: the joining start's
    assert pol.joined(pol.expectation({}, "mps", 0.0), 50.0, {"peak_membw": 0.1}, "mps", 7)["group_bw"] == 0.1


def test_place_now_time_slices_where_plan_would_wait():
    g = GpuView("a", 0, 16 * GiB)
    hot = flat("hot", 1.0, bw=0.9, cache_bound=True)
    c = Candidate(1, 4 * GiB, profile=flat("hot2", 1.0, bw=0.9, cache_bound=True))
    placed = [Placed(9, ("a",), 4 * GiB, profile=hot)]
    assert plan([c], [g], placed)[0].action == WAIT
    d = pol.place_now(c, [g], placed)
    assert (d.action, d.gpus, d.mode) == (START, ("a",), "timesliced") and "started by Slurm" in d.reason
    full = [Placed(9, ("a",), 12 * GiB + 1, profile=hot)]
    assert pol.place_now(c, [g], full).action == WAIT
    assert pol.place_now(dataclasses.replace(c, budget=4 * GiB), [g], [Placed(9, ("a",), 12 * GiB, profile=hot)]).action == START


def test_a_live_warning_counts_on_a_node_where_no_shared_run_has_ended_yet():
    """observe_live's warning of a slowed MPS group acts before any shared run has ended: a fresh
    node's first slow group must keep the next job out of that much bandwidth."""
    # MPS only: the warning is of an MPS group (time-sliced, the two would not meet in the model)
    g = GpuView("a", 0, 80 * GiB, compute_mode="exclusive_process", mps="active")
    res = Placed(9, ("a",), GiB, mode="mps", profile=flat("res", 0.2, 0.2))
    c = Candidate(1, GiB, profile=flat("cand", 0.2, 0.2))
    cfg = PolicyConfig(margin=0.0, seen_margin=0.0)
    assert plan([c], [g], [res], cfg, learned=pol.Learned())[0].mode == "mps"
    warned = pol.Learned()
    assert warned.observe_live("mps", 0.4, 0.8, 0.2, 60) == pytest.approx(3.2)
    d = plan([c], [g], [res], cfg, learned=warned)[0]
    assert d.action == WAIT, d.reason


def test_the_doubts_together_never_refuse_a_share_the_model_says_is_free():
    """colo demo's step 6: one run far off (compared with the alone time a shorter run of its
    profile taught) put the learned margin at its cap; times an unchecked alone time's doubt
    (1.4 x 1.118 = 1.57x past the 1.5x bound) every share the model says costs nothing was refused,
    and three unprofiled settings ran one after another. The doubts together stay within the cap."""
    lr = pol.Learned(errors=[2.0] * 5)
    assert lr.margin(0.1) == pol.MARGIN_CAP
    light = flat("sweep", 0.1, bw=0.05, runtime=600.0)
    gpus = [GpuView("g0", 0, 16 * GiB)]
    placed = [Placed(1, ("g0",), 2 * GiB, profile=light, elapsed=30.0)]
    d = plan([Candidate(2, 2 * GiB, profile=light)], gpus, placed, PolicyConfig(), learned=lr)[0]
    assert d.action == START, d.reason
    assert d.details["slowdown"][d.mode] == pytest.approx(1.0 + pol.MARGIN_CAP)


def test_taking_turns_goes_one_job_past_what_running_groups_showed_and_stops_where_one_ran_slower():
    """Issue 39: the level of taking turns (time-sliced jobs' SM, an MPS group as one context) a
    share may reach is KNOWN_TS plus one job before any group showed more; a running group that
    took turns as predicted explores its level, one that ran slower sets a ceiling that fades."""
    from colo.sched.learning import FADE, KNOWN_TS, TS_BIN
    lrn = pol.Learned()
    assert lrn.ts_explored(KNOWN_TS) and not lrn.ts_explored(KNOWN_TS + TS_BIN)
    assert not lrn.ts_beyond(KNOWN_TS + 0.42, 0.42)  # one job (its own peak SM) past KNOWN_TS
    assert lrn.ts_beyond(KNOWN_TS + 0.3, 0.1)  # a step is at least TS_BIN, not more than the job
    # a group with time-sliced jobs that took turns at 1.1 as predicted: explored, nothing else taught
    assert lrn.observe_live("timesliced", 0.9, 0.8, 0.8, 20.0, 1.1) is None
    assert lrn.ts_explored(1.1) and not lrn.ts_beyond(1.5, 0.25) and lrn.ts_beyond(1.6, 0.25)
    assert lrn.live == {} and lrn.bw == {}  # time-sliced bandwidth teaches the curve nothing
    # a group at 0.8 that ran 4x slower: that level and those above are taken back, none goes there
    lrn.observe_live("timesliced", 0.9, 0.8, 0.2, 20.0, 0.8)
    assert not lrn.ts_explored(1.1) and lrn.ts_beyond(0.8, 0.3) and lrn.ts_beyond(1.0, 1.0)
    assert lrn.ts_explored(0.5)  # below it, as before
    # a little slower than predicted (within LIVE_TS_SLOW past the profiles' doubt): no verdict
    other = pol.Learned()
    other.observe_live("timesliced", 0.9, 0.8, 0.58, 20.0, 1.1)
    assert other.ts == {} and other.ts_slow == {}
    lrn.clock += int(FADE)  # the ceiling fades: explored afresh, a job at a time
    assert not lrn.ts_beyond(0.8, 0.3)


def test_a_newcomer_that_launches_no_kernels_takes_no_turns():
    """Issue 39's level of taking turns stepped past nothing for a job whose profile shows no SM
    (TS_IDLE): a restarted notebook kernel (its first run's profile: 0 % SM) beside a saturating
    32 MiB burn (no profile yet: unknown_sm 1.0; or its provisional one, 100 %) waited the burn's
    whole run, though it adds nothing to the turns taken and the model says it slows no one
    past the bound. A light job that does launch kernels still waits there cold, as issue 39 set."""
    from colo.sched.learning import TS_IDLE
    g, cfg = GpuView("a", 0, 16 * GiB), PolicyConfig(unprofiled_share=True)
    idle, light, busy = flat("kernel", 0.0, bw=0.0), flat("k", 0.05), flat("burn", 1.0)
    slow = pol.Learned()  # a pair at this level ran slower lately: still nothing to step past
    slow.observe_live("timesliced", 0.3, 0.8, 0.2, 20.0, 1.0)
    for resident in (None, busy):
        for lrn in (pol.Learned(), slow):
            d = plan([Candidate(1, GiB, profile=idle)], [g], [Placed(9, ("a",), GiB, profile=resident)], cfg,
                     learned=lrn)[0]
            assert d.action == START, d.reason
            assert d.details["ts_level"] == pytest.approx(1.0) and not d.details.get("ts_step")
        d = plan([Candidate(1, GiB, profile=light)], [g], [Placed(9, ("a",), GiB, profile=resident)], cfg,
                 learned=pol.Learned())[0]
        assert d.action == WAIT and "contexts taking turns at 105 %" in d.reason, d.reason
    # just past the threshold: a step like any other
    d = plan([Candidate(1, GiB, profile=flat("k2", TS_IDLE + 0.01))], [g], [Placed(9, ("a",), GiB, profile=busy)],
             cfg, learned=pol.Learned())[0]
    assert d.action == WAIT, d.reason
    # idle over the overlap but busy later (a job loading data beside a resident its profile outlives,
    # which may run past its own profile): its whole profile decides, and it steps as any other
    late = Profile(name="late", step=1.0, sm=np.r_[np.zeros(100), np.full(100, 0.5)], mem=np.full(200, GiB),
                   membw=np.full(200, 0.1), runtime=200.0, runs=5)
    d = plan([Candidate(1, GiB, profile=late)], [g], [Placed(9, ("a",), GiB, profile=flat("short", 1.0, runtime=20.0))], cfg,
             learned=pol.Learned())[0]
    assert d.action == WAIT and "contexts taking turns" in d.reason, d.reason


def test_at_most_three_jobs_placed_on_provisional_profiles_share_a_gpu():
    """A provisional profile is a run's first minute: no run of it has ended and no watch reads its
    group. Under `study`, a family joined its first member a job every 30 s, twelve at once, each
    then 200x slower than alone. Three may share (a sweep's first setting and two more, as the
    demo shows); a fourth waits for an end, whatever the model says."""
    g, cfg = GpuView("a", 0, 80 * GiB), PolicyConfig()
    first = dataclasses.replace(flat("fam", 0.1, bw=0.05, runs=1), provisional=True)
    placed = [Placed(9, ("a",), GiB, profile=first, elapsed=40.0)]
    for k in (1, 2):
        d = plan([Candidate(k, GiB, profile=first)], [g], placed, cfg, learned=pol.Learned())[0]
        assert d.action == START, d.reason
        placed.append(Placed(k, ("a",), GiB, mode=d.mode, profile=first, elapsed=10.0))
    d = plan([Candidate(3, GiB, profile=first)], [g], placed, cfg, learned=pol.Learned())[0]
    assert d.action == WAIT and "3 jobs placed on provisional profiles" in d.reason, d.reason
    d = plan([Candidate(3, GiB, profile=TINY)], [g], placed, cfg, learned=pol.Learned())[0]
    assert "provisional" not in d.reason  # a job on a stored profile is judged as before
