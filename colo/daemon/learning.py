"""Which stored profile a job runs under, and learning it from the job's samples.

Whose runs teach what (invariant 13): a user's finished jobs teach only that user's own copy of a
profile, under state_dir/profiles/users/UID. A job's profile is looked up in that user's own
folder first, then the ones an admin marked shared (state_dir/profiles/shared, and the flat
state_dir/profiles of colo versions before this; `shared_profiles` from the config in place of
state_dir/profiles on a cluster), then the configured `profile_dirs`, then the
shipped profiles. Nothing but an admin's `profile share` writes outside a user's own folder, so
one user's runs cannot change how another user's jobs are placed.

At a start the scheduler's decision holds the slowdown plan() predicted for the job
(details["predicted_slowdown"]) and note_start() records which profiles share its GPU. At its
end learn() compares: wall time against the stored profile's alone run time, over the predicted
slowdown. Into the owner's `self.learned[uid]` (policy.Learned, which plan() uses for that
user's jobs only, invariant 13): the alone-time error from
uncontended runs, the co-run slowdown the model missed per (profile, neighbour, mode) from shared
ones, the model's error (the margin), the largest memory per profile (the budget it suggests).
The observation is added to the job's stored decision, so `colo explain` shows predicted vs
observed. The stored profile (its series and alone run time) is learned from uncontended runs
only, or from a first run that has no profile yet: a shared run's wall time is not its alone time.
What was learned is kept in memory: a restarted daemon starts learning again from its next ends.

Per-process SM under MPS: on a real driver NVML may attribute all MPS clients' activity to the
MPS server's process (per-process samples then show the server, not the jobs). colo then learns
no series from an MPS run of a profile it already has (the rule above: it shared the GPU), and
a job's first run, which has no profile, runs alone time-sliced, where the samples are its own.
"""
from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path

from .. import policy, profiles
from ..jobs import ACTIVE, Job

log = logging.getLogger("colo")
GROW = 1.25  # --grow: a budget that refused an allocation grows at least this much (as in colo sim)


class LearningMixin:
    """Part of Daemon (colo/daemon/core.py); uses its state."""

    def _init_profiles(self) -> None:
        # learned profiles live in the state dir, or in a folder every node of a cluster shares
        root = self.config.shared_profiles or self.config.state_dir / "profiles"
        self._profiles_root = root
        self._profile_layers: list[tuple[str, Path]] = [
            ("shared", root / "shared"), ("shared", root),  # the flat folder: learned before per-user profiles
            *(("configured", Path(d)) for d in self.config.profile_dirs), ("shipped", profiles.shipped_dir())]
        self._profile_stores: dict[int, profiles.ProfileStore] = {}
        self._profile_cache: dict[tuple[int, str], tuple[float, profiles.Profile | None]] = {}

    def own_profile_dir(self, uid: int) -> Path:
        return self._profiles_root / "users" / str(int(uid))

    def profile_store(self, uid: int) -> profiles.ProfileStore:
        """The folders a job of `uid` finds its profile in, its own first; new profiles go to its own."""
        st = self._profile_stores.get(uid)
        if st is None:
            st = self._profile_stores[uid] = profiles.ProfileStore(
                [self.own_profile_dir(uid), *(d for _, d in self._profile_layers)])
        return st

    def profile_source(self, uid: int, name: str) -> tuple[str, Path] | None:
        """Which layer a name resolves to for `uid`: ("own" | "shared" | "configured" | "shipped", file)."""
        for kind, d in (("own", self.own_profile_dir(uid)), *self._profile_layers):
            p = d / f"{name}.profile"
            if profiles.valid_name(name) and p.is_file():
                return kind, p
        return None

    def profile_name(self, job: Job) -> str:
        return job.spec.profile or profiles.key_for(job.spec.image, job.spec.argv)

    def profile_of(self, job: Job) -> "profiles.Profile | None":
        """The stored profile a job runs under; files are read again at most every 60 s."""
        name = self.profile_name(job)
        key = (job.uid, name)
        hit = self._profile_cache.get(key)
        now = time.monotonic()
        if hit is None or now - hit[0] > 60:
            try:
                prof = self.profile_store(job.uid).get(name)
            except profiles.ProfileError as e:
                log.warning("profile %s unreadable: %s", name, e)
                prof = None
            hit = self._profile_cache[key] = (now, prof)
        return hit[1]

    def forget_profile(self, name: str, uid: int | None = None) -> None:
        """Drop cached lookups of `name` (one user's, or everyone's after a change to a shared one)."""
        for key in [k for k in self._profile_cache if k[1] == name and (uid is None or k[0] == uid)]:
            del self._profile_cache[key]
        self._cands.clear()  # queued jobs of that profile plan with what is stored now

    def share_profile(self, name: str, uid: int) -> Path:
        """An admin's choice: user `uid`'s own copy of `name` becomes the shared one."""
        src = self.own_profile_dir(uid) / f"{name}.profile"
        if not profiles.valid_name(name) or not src.is_file():
            raise profiles.ProfileError(f"user {uid} has no profile of their own named {name!r}")
        profiles.load(src)  # only a readable profile is shared
        dst_dir = self._profiles_root / "shared"
        dst_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = dst_dir / f".{name}.profile.tmp"
        shutil.copyfile(src, tmp)
        tmp.replace(dst_dir / f"{name}.profile")
        self.forget_profile(name)
        return dst_dir / f"{name}.profile"

    def learn(self, job: Job) -> None:
        """A job that ran to its end teaches its owner's own copy of the profile it ran under
        (started from the shared or shipped one when the owner has none yet)."""
        rows = self.store.samples(job.id)
        neighbours = sorted(self._neighbours.pop(job.id, set()))
        if not job.gpus:
            return
        self._observe(job, rows, neighbours)
        if len(rows) < 2:
            return
        if neighbours and self.profile_of(job) is not None:  # its wall time is not its alone time
            log.info("job %d shared its GPU with %s: its profile's series are not learned from this run",
                     job.id, ", ".join(neighbours))
            return
        t0 = rows[0][0]
        samples = {"times": [r[0] - t0 for r in rows], "sm": [r[1] or 0.0 for r in rows],
                   "mem": [r[2] or 0 for r in rows], "membw": [r[3] or 0.0 for r in rows]}
        gpu = next((d.name for d in self.devices if d.uuid == job.gpus[0]), "")
        runtime = (job.ended_at or time.time()) - (job.started_at or t0)
        name = self.profile_name(job)
        try:
            own = self.own_profile_dir(job.uid)
            own.mkdir(mode=0o700, parents=True, exist_ok=True)
            # ProfileStore.learn reads the first folder that has `name` and writes to the first
            # writable folder: the owner's own, which comes first
            self.profile_store(job.uid).learn(name, samples, runtime=runtime, gpu=gpu)
            self.forget_profile(name, job.uid)
        except (profiles.ProfileError, OSError) as e:
            log.warning("could not learn profile for job %d: %s", job.id, e)

    def grown_budget(self, job: Job) -> int | None:
        """--grow: the budget a job refused by its budget is requeued with (once): 1.25x its budget,
        or the most its profile's runs used + 10 % when more, at most the largest usable GPU memory.
        None when that is no more than it had."""
        name = self.profile_name(job)
        peak = max((r[2] or 0 for r in self.store.samples(job.id)), default=0)
        if peak:
            self.learned_for(job.uid).max_mem[name] = max(self.learned_for(job.uid).max_mem.get(name, 0), int(peak))
        q = 256 * 1024**2
        want = max(job.spec.gpu_mem * GROW, self.learned_for(job.uid).suggest_budget(name) or 0)
        want = min(int(math.ceil(want / q) * q), max((v.usable for v in self.gpu_views()), default=0))
        return want if want > job.spec.gpu_mem else None

    def learned_for(self, uid: int) -> policy.Learned:
        return self.learned.setdefault(uid, policy.Learned())

    def note_start(self, job_id: int, gpus: tuple[str, ...]) -> None:
        """Who shares a GPU with whom (profile names), both ways, for learning at each end."""
        me = self.job(job_id)
        mine = self._neighbours.setdefault(job_id, set())
        for other in self.jobs_in(*ACTIVE):
            if other.id != job_id and set(other.gpus) & set(gpus):
                mine.add(self.profile_name(other))
                self._neighbours.setdefault(other.id, set()).add(self.profile_name(me))

    def _observe(self, job: Job, rows: list, neighbours: list[str]) -> None:
        """Predicted vs observed, into self.learned and the job's stored decision."""
        prof = self.profile_of(job)
        dec = self.store.decision(job.id)
        if prof is None or dec is None or dec.get("action") != "start" or not job.started_at or not job.ended_at:
            return
        details = dict(dec.get("details") or {})
        predicted = float(details.get("predicted_slowdown", 1.0))
        factor = float((details.get("learned_factor") or {}).get(dec.get("mode") or "", 1.0))
        wall = job.ended_at - job.started_at
        peak = max((r[2] or 0 for r in rows), default=0)
        mine = self.learned_for(job.uid)
        residual = mine.observe(self.profile_name(job), neighbours, str(job.mode or "timesliced"),
                                predicted, wall, prof.runtime, peak, factor)
        details.update(observed_slowdown=wall / prof.runtime, profile_runtime=prof.runtime, shared_with=neighbours,
                       observed_vs_predicted=residual, suggested_budget=mine.suggest_budget(self.profile_name(job)))
        try:
            self.store.record_decisions([(job.id, dec["action"], dec.get("mode"), dec.get("gpus") or [],
                                          dec.get("reason") or "", details)])
        except Exception as e:  # noqa: BLE001 - an observation is worth less than the job's end
            log.warning("could not store what job %d did against its prediction: %s", job.id, e)
