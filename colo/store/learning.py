"""What the daemon learned (learned_*), and the profiles sharing a running job's GPU (job_neighbours)."""
from __future__ import annotations

import time
from typing import Iterable

from ..jobs import TERMINAL, State
from .base import Base


class Learning(Base):
    # learning -------------------------------------------------------------------------------
    def learned(self) -> dict[int, dict]:
        """Everything learned, per uid: {"corun": {(profile, neighbour, mode): (runs, factor)},
        "alone": {profile: (runs, ratio)}, "max_mem": {profile: bytes}, "errors": [oldest..newest],
        "errors_seen": [oldest..newest], "bw": {(mode, bin): (runs, factor)}, "clock": observations
        (0: none stored), "at": {corun or bw key: the clock it was last taught at (stored ones)},
        "ts": {bin: clock}, "ts_slow": {bin: clock}, "live": {(mode, bin): (level, clock)}};
        each dict in the order the entries were last changed (oldest first). Values are as stored:
        the caller checks them (a hand-edited or damaged row may hold anything)."""
        out: dict[int, dict] = {}

        def of(uid: int) -> dict:
            return out.setdefault(uid, {"corun": {}, "alone": {}, "max_mem": {}, "errors": [], "errors_seen": [], "bw": {},
                                        "clock": 0, "at": {}, "ts": {}, "ts_slow": {}, "live": {}})

        for uid, p, nb, m, runs, f, c in self.db.execute(
                "SELECT uid, profile, neighbour, mode, runs, factor, clock FROM learned_corun ORDER BY at, rowid"):
            of(uid)["corun"][(p, nb, m)] = (runs, f)
            if c is not None:
                of(uid)["at"][(p, nb, m)] = c
        for uid, p, runs, ratio, mem in self.db.execute(
                "SELECT uid, profile, alone_runs, alone_ratio, max_mem FROM learned_profile ORDER BY at, rowid"):
            if runs is not None and ratio is not None:
                of(uid)["alone"][p] = (runs, ratio)
            if mem is not None:
                of(uid)["max_mem"][p] = mem
        for uid, e, seen in self.db.execute("SELECT uid, error, seen FROM learned_error ORDER BY id"):
            of(uid)["errors_seen" if seen else "errors"].append(e)
        for uid, m, b, runs, f, c in self.db.execute(
                "SELECT uid, mode, bin, runs, factor, clock FROM learned_bw ORDER BY at, rowid"):
            of(uid)["bw"][(m, b)] = (runs, f)
            if c is not None:
                of(uid)["at"][(m, b)] = c
        for uid, c in self.db.execute("SELECT uid, clock FROM learned_clock"):
            of(uid)["clock"] = c
        for uid, slow, b, c in self.db.execute("SELECT uid, slow, bin, clock FROM learned_ts ORDER BY rowid"):
            of(uid)["ts_slow" if slow else "ts"][b] = c
        for uid, m, b, level, c in self.db.execute("SELECT uid, mode, bin, level, clock FROM learned_live ORDER BY rowid"):
            of(uid)["live"][(m, b)] = (level, c)
        return out

    def save_learned(self, uid: int, corun: dict | None = None, alone: dict | None = None,
                     max_mem: dict | None = None, errors: list[float] | None = None,
                     forget_corun: Iterable[tuple[str, str, str]] = (), forget_alone: Iterable[str] = (),
                     forget_mem: Iterable[str] = (), errors_add: list[float] = (), errors_keep: int = 0,
                     now: float | None = None, bw: dict | None = None, errors_seen: list[float] | None = None,
                     errors_seen_add: list[float] = (), errors_seen_keep: int = 0, clock: int | None = None,
                     at: dict | None = None, ts: dict | None = None, ts_slow: dict | None = None,
                     live: dict | None = None) -> None:
        """One user's changed entries in one transaction: `corun` {(p, nb, mode): (runs, factor)},
        `alone` {p: (runs, ratio)}, `max_mem` {p: bytes}; `errors` replaces that user's error list,
        or `errors_add` are appended to it and the newest `errors_keep` kept; the `forget_*`
        entries are removed (pruned); `bw` {(mode, bin): (runs, factor)} the bandwidth curve's steps;
        `errors_seen*` as `errors*`, for the list of seen pairings' errors; `clock` the count of
        observations, `at` {corun or bw key: the clock it was last taught at} (for the `corun` and
        `bw` entries given); `ts` and `ts_slow` {bin: clock} replace the user's levels of taking
        turns (explored; slower there); `live` {(mode, bin): (level, clock)} the early warnings changed."""
        now = time.time() if now is None else now
        at = at or {}

        def taught(key) -> int | None:
            c = at.get(key)
            return None if c is None else int(c)

        with self.tx():
            self.db.executemany(
                "INSERT INTO learned_bw(uid, mode, bin, runs, factor, at, clock) VALUES (?,?,?,?,?,?,?) "
                "ON CONFLICT(uid, mode, bin) DO UPDATE SET runs=excluded.runs, factor=excluded.factor, at=excluded.at, "
                "clock=excluded.clock",
                [(uid, m, int(b), int(r), float(f), now, taught((m, b))) for (m, b), (r, f) in (bw or {}).items()])
            self.db.executemany(
                "INSERT INTO learned_corun(uid, profile, neighbour, mode, runs, factor, at, clock) VALUES (?,?,?,?,?,?,?,?) "
                "ON CONFLICT(uid, profile, neighbour, mode) DO UPDATE SET runs=excluded.runs, factor=excluded.factor, "
                "at=excluded.at, clock=excluded.clock",
                [(uid, p, nb, m, int(r), float(f), now, taught((p, nb, m))) for (p, nb, m), (r, f) in (corun or {}).items()])
            if clock is not None:
                self.db.execute("INSERT INTO learned_clock(uid, clock) VALUES (?,?) "
                                "ON CONFLICT(uid) DO UPDATE SET clock=excluded.clock", (uid, int(clock)))
            for slow, levels in ((0, ts), (1, ts_slow)):
                if levels is not None:
                    self.db.execute("DELETE FROM learned_ts WHERE uid=? AND slow=?", (uid, slow))
                    self.db.executemany("INSERT INTO learned_ts(uid, slow, bin, clock) VALUES (?,?,?,?)",
                                        [(uid, slow, int(b), int(c)) for b, c in levels.items()])
            self.db.executemany(
                "INSERT INTO learned_live(uid, mode, bin, level, clock) VALUES (?,?,?,?,?) "
                "ON CONFLICT(uid, mode, bin) DO UPDATE SET level=excluded.level, clock=excluded.clock",
                [(uid, m, int(b), float(lv), int(c)) for (m, b), (lv, c) in (live or {}).items()])
            self.db.executemany(
                "INSERT INTO learned_profile(uid, profile, alone_runs, alone_ratio, at) VALUES (?,?,?,?,?) "
                "ON CONFLICT(uid, profile) DO UPDATE SET alone_runs=excluded.alone_runs, alone_ratio=excluded.alone_ratio, "
                "at=excluded.at", [(uid, p, int(r), float(x), now) for p, (r, x) in (alone or {}).items()])
            self.db.executemany(
                "INSERT INTO learned_profile(uid, profile, max_mem, at) VALUES (?,?,?,?) "
                "ON CONFLICT(uid, profile) DO UPDATE SET max_mem=excluded.max_mem, at=excluded.at",
                [(uid, p, int(b), now) for p, b in (max_mem or {}).items()])
            for seen, whole, add, keep in ((0, errors, errors_add, errors_keep),
                                           (1, errors_seen, errors_seen_add, errors_seen_keep)):
                if whole is not None:
                    self.db.execute("DELETE FROM learned_error WHERE uid=? AND seen=?", (uid, seen))
                self.db.executemany("INSERT INTO learned_error(uid, error, seen) VALUES (?,?,?)",
                                    [(uid, float(e), seen) for e in (whole if whole is not None else add)])
                if add and keep:
                    self.db.execute("DELETE FROM learned_error WHERE uid=? AND seen=? AND id <= (SELECT id FROM "
                                    "learned_error WHERE uid=? AND seen=? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                                    (uid, seen, uid, seen, keep))
            self.db.executemany("DELETE FROM learned_corun WHERE uid=? AND profile=? AND neighbour=? AND mode=?",
                                [(uid, *k) for k in forget_corun])
            self.db.executemany("UPDATE learned_profile SET alone_runs=NULL, alone_ratio=NULL "
                                "WHERE uid=? AND profile=?", [(uid, p) for p in forget_alone])
            self.db.executemany("UPDATE learned_profile SET max_mem=NULL WHERE uid=? AND profile=?",
                                [(uid, p) for p in forget_mem])
            self.db.execute("DELETE FROM learned_profile WHERE uid=? AND alone_ratio IS NULL AND max_mem IS NULL",
                            (uid,))

    def add_neighbours(self, pairs: Iterable[tuple[int, str]], most: int, fresh: int | None = None) -> None:
        """(job id, profile that shares its GPU), each job keeping at most `most` names; job `fresh`
        (starting again) first forgets those of an earlier attempt. A start stores them in its own
        transaction instead (transition's `neighbours`)."""
        with self.tx():
            if fresh is not None:
                self.db.execute("DELETE FROM job_neighbours WHERE job_id=?", (fresh,))
            self.db.executemany(
                "INSERT OR IGNORE INTO job_neighbours(job_id, profile) SELECT ?, ? "
                "WHERE (SELECT count(*) FROM job_neighbours WHERE job_id=?) < ?",
                [(j, p, j, most) for j, p in pairs])

    def _put_neighbours(self, pairs: Iterable[tuple[int, str]], most: int, fresh: int) -> None:
        """At job `fresh`'s start (in its transaction): the neighbours of ended jobs whose end taught
        nothing are forgotten (prune_neighbours), then add_neighbours."""
        self.prune_neighbours(TERMINAL)
        self.add_neighbours(pairs, most, fresh)

    def neighbours(self, job_id: int) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT profile FROM job_neighbours WHERE job_id=?", (job_id,))}

    def take_neighbours(self, job_id: int) -> set[str]:
        """A job's neighbours, forgotten as they are read (at its end)."""
        with self.tx():
            out = self.neighbours(job_id)
            self.db.execute("DELETE FROM job_neighbours WHERE job_id=?", (job_id,))
        return out

    def prune_neighbours(self, ended: Iterable[State]) -> int:
        """Forget the neighbours of jobs in the `ended` states (ends that taught nothing: failed,
        cancelled, lost)."""
        states = [str(s) for s in ended]
        with self.tx():
            return self.db.execute(
                "DELETE FROM job_neighbours WHERE job_id IN "
                f"(SELECT job_id FROM job_neighbours JOIN jobs ON jobs.id = job_id "
                f"WHERE jobs.state IN ({','.join('?' * len(states))}))", states).rowcount
