"""Issue 42's aim, on plan() itself: a drained GPU gets no new job in a 1,000-job queue, with
room on it and jobs pinned to it, while the GPU beside it fills; jobs that wait say it is drained."""
from __future__ import annotations

from colo.sched.policy import START, WAIT, Candidate, GpuView, Placed, PolicyConfig, plan

GiB = 1024**3
TEXT = "drained by root: driver update"


def test_a_drained_gpu_gets_none_of_a_thousand_jobs():
    gpus = [GpuView("g0", 0, 80 * GiB, drained=TEXT), GpuView("g1", 1, 80 * GiB)]
    placed = [Placed(9999, ("g0",), GiB)]  # a job that ran there before the drain runs on
    cands = [Candidate(i, GiB, seq=i, gpu_ids=(0,) if i % 10 == 0 else ()) for i in range(1000)]
    ds = plan(cands, gpus, placed, PolicyConfig(unprofiled_share=True))
    started = [d for d in ds if d.action == START]
    assert started and all(d.gpus == ("g1",) for d in started)
    assert not any("g0" in d.gpus for d in ds)
    pinned = [d for d in ds if d.job_id % 10 == 0]
    assert all(d.action == WAIT and f"GPU 0 {TEXT}" in d.reason for d in pinned)
    # undrained: the same queue may use GPU 0 again
    again = plan(cands, [GpuView("g0", 0, 80 * GiB), gpus[1]], placed, PolicyConfig(unprofiled_share=True))
    assert any(d.action == START and d.gpus == ("g0",) for d in again)
