"""The end-of-job learning rule: what one run that ended teaches (policy.Learned), the same for the
daemon (colo/daemon/learner.py) and the simulator (colo/sched/sim.py), so that what `colo sim`
judges is what the daemon does. Pure: the callers gather the facts of the run, this decides.
"""
from __future__ import annotations

from typing import Sequence

from . import policy


def end_of_job(learned: policy.Learned, name: str, neighbours: Sequence[str], mode: str | None,
               decision: dict, started_at: float, ended_at: float, stored_runtime: float,
               peak_mem: int | None) -> float | None:
    """A run of profile `name` from `started_at` to `ended_at`, beside `neighbours` (their profile
    names) in `mode`, placed by `decision` (its start decision as stored: "mode", and "details"
    with the "expect" its neighbours' starts and ends kept up to date; built from the details when
    missing), against the profile's stored alone time. Returns observed / predicted slowdown
    (Learned.observe). The GPU's summed bandwidth is learned from only when the start recorded
    one; `shared` counts only when it had neighbours."""
    details = decision.get("details") or {}
    e = details.get("expect") or policy.expectation(details, decision.get("mode") or "", started_at)
    predicted, factor = policy.expected(e, started_at, ended_at)
    group_bw = float(e["group_bw"]) if isinstance(details.get("peak_membw"), (int, float)) else None
    return learned.observe(name, sorted(neighbours), str(mode or "timesliced"), predicted, ended_at - started_at,
                           stored_runtime, peak_mem, factor, group_bw, e.get("unseen"),
                           policy.shared(e, started_at, ended_at) if neighbours else 1.0)


def profile_learned(learned: policy.Learned, name: str, old_runtime: float | None, new_runtime: float,
                    shared: bool) -> None:
    """A run was merged into `name`'s profile (its alone time moved from old_runtime, None: it had
    none, to new_runtime): what runs showed of its real alone time is kept against the new one; a
    first profile made from a run nobody shared is its alone time here, checked."""
    if old_runtime is not None:
        learned.rebase(name, old_runtime, new_runtime)
    elif not shared:
        learned.checked(name)
