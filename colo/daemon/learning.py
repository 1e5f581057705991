"""Which stored profile a job runs under, and learning it from the job's samples."""
from __future__ import annotations

import logging
import time

from .. import profiles
from ..jobs import Job

log = logging.getLogger("colo")


class LearningMixin:
    """Part of Daemon (colo/daemon/core.py); uses its state."""

    def profile_name(self, job: Job) -> str:
        return job.spec.profile or profiles.key_for(job.spec.image, job.spec.argv)

    def profile_of(self, job: Job) -> "profiles.Profile | None":
        """The stored profile a job runs under; files are read again at most every 60 s."""
        name = self.profile_name(job)
        hit = self._profile_cache.get(name)
        now = time.monotonic()
        if hit is None or now - hit[0] > 60:
            try:
                prof = self.profiles.get(name)
            except profiles.ProfileError as e:
                log.warning("profile %s unreadable: %s", name, e)
                prof = None
            hit = self._profile_cache[name] = (now, prof)
        return hit[1]

    def learn(self, job: Job) -> None:
        """A job that ran to its end teaches the profile it ran under (invariant: samples, not guesses)."""
        rows = self.store.samples(job.id)
        if len(rows) < 2 or not job.gpus:
            return
        t0 = rows[0][0]
        samples = {"times": [r[0] - t0 for r in rows], "sm": [r[1] or 0.0 for r in rows],
                   "mem": [r[2] or 0 for r in rows], "membw": [r[3] or 0.0 for r in rows]}
        gpu = next((d.name for d in self.devices if d.uuid == job.gpus[0]), "")
        runtime = (job.ended_at or time.time()) - (job.started_at or t0)
        try:
            self.profiles.learn(self.profile_name(job), samples, runtime=runtime, gpu=gpu)
            self._profile_cache.pop(self.profile_name(job), None)
            self._cands.clear()  # queued jobs of that profile plan with what was just learned
        except (profiles.ProfileError, OSError) as e:
            log.warning("could not learn profile for job %d: %s", job.id, e)
