"""The daemon's live watch (learner._watch_groups) teaches a group with time-sliced jobs its level
of taking turns, as `colo sim`'s watch does (issue 39): the same Learned.observe_live, fed the
level the group's profiles put it at on average (policy.turns_level)."""
from __future__ import annotations

import types

import numpy as np
import pytest

from colo import profiles
from colo.daemon import learner as L
from colo.jobs import Mode
from colo.sched import policy


def _watch(sm_util: float, prof=None) -> policy.Learned:
    lrn = policy.Learned()
    dev = types.SimpleNamespace(uuid="G", error=None, sm_util=sm_util)
    prof = prof or types.SimpleNamespace(sm=np.full(100, 0.4), step=1.0, provisional=False)
    expect = {"slowdown": 1.0, "since": 0.0, "acc": [0.0, 0.0], "group_bw": 0.3, "factor": 1.0,
              "unseen": 0.0, "sharing": True, "shared": 0.0}
    fake = types.SimpleNamespace(gpus=types.SimpleNamespace(devices=[dev]), _live={},
                                 profile_of=lambda j: prof, expect_of=lambda j: (expect, False),
                                 _learning=lambda uid, fn: fn(lrn))
    fake._teach_live = lambda jobs, acc, now: L.Learner._teach_live(fake, jobs, acc, now)
    jobs = [types.SimpleNamespace(id=1, gpus=("G",), mode=Mode.TIMESLICED, uid=0),
            types.SimpleNamespace(id=2, gpus=("G",), mode=Mode.MPS, uid=0)]
    for now in np.arange(0.0, L.LIVE_EVERY + 11.0, 10.0):
        L.Learner._watch_groups(fake, jobs, float(now))
    return lrn


@pytest.mark.parametrize("sm_util, explored, slow", [(80.0, {3}, set()), (20.0, set(), {3}), (60.0, set(), set())])
def test_a_group_with_a_time_sliced_job_teaches_its_level_of_taking_turns(sm_util, explored, slow):
    # one time-sliced job and one MPS client at 0.4 each: level 0.4 + min(1, 0.4) = 0.8 (bin 3);
    # expected 0.8 of the GPU: 80 % as predicted, 20 % 4x slower, 60 % within the doubt (no verdict)
    lrn = _watch(sm_util)
    assert set(lrn.ts) == explored and set(lrn.ts_slow) == slow
    assert lrn.live == {}  # a group with time-sliced jobs teaches the bandwidth curve nothing


@pytest.mark.parametrize("sm_util, explored, slow", [(80.0, {3}, set()), (20.0, set(), {3})])
def test_a_family_on_its_provisional_profile_is_watched_too(sm_util, explored, slow):
    # no stored profile: both placed on the one their family's first minute made (0.4 SM); a crowd
    # of it running slow shows within LIVE_MIN, and a level it runs at as predicted opens the next
    prof = profiles.provisional("fam", {"times": np.arange(40.0), "sm": np.full(40, 0.4), "mem": np.full(40, 1 << 30),
                                        "membw": np.full(40, 0.2)})
    assert prof is not None and prof.provisional
    lrn = _watch(sm_util, prof)
    assert set(lrn.ts) == explored and set(lrn.ts_slow) == slow
