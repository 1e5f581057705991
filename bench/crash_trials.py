"""Crash consistency (issue 8, invariant 7): SIGKILL the daemon at seeded random moments while jobs
are being submitted, started and finished, restart it, and check every job after every restart.

Each trial: release the gates of some earlier trials (their jobs finish around the kill), submit
a few jobs from a thread at random intervals, SIGKILL the daemon after a random delay, sometimes
let jobs finish while it is down, restart it and check:
  - every acknowledged submission is stored exactly once; an unacknowledged one at most once;
  - every job has a reason, its events chain from `queued` to its current state through allowed
    transitions only, and a job that was terminal before the kill is unchanged after it;
  - within a deadline, no job is left `starting`, and every `running` job's process is alive;
  - every job's command ran at most once (each appends its id to a file when it starts).
At the end every gate opens and every job must end as its command says (succeeded, or failed
with exit code 3), none lost, each run exactly once. Importable: tests/test_reliability.py runs
a few trials.

Run: python bench/crash_trials.py [--trials 50] [--seed 8] [--docker]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report  # noqa: E402
from harness.probes import db_ro  # noqa: E402
from harness.users import shared_root  # noqa: E402
from load_bench import TERMINAL  # noqa: E402

from harness.daemon import DaemonProc, wait_for  # noqa: E402

from colo.node import fakegpu, native  # noqa: E402
from colo.client import Client, ClientError  # noqa: E402
from colo.jobs import ALLOWED, State  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


class Workload:
    """Jobs of known outcome; each appends its id to `runs` as it starts."""

    def __init__(self, root: Path, rng: random.Random, image: str | None = None):
        self.root, self.rng, self.image = root, rng, image
        self.gates = root / "gates"
        self.gates.mkdir(exist_ok=True)
        self.out = root / "out"
        self.out.mkdir(exist_ok=True)
        os.chmod(self.out, 0o777)
        self.runs = self.out / "runs"
        self.burn = str(native.path("colo-burn"))
        self.expect: dict[str, tuple[str, int]] = {}  # token -> (final state, exit code)
        self.acked: dict[str, int] = {}
        self.unacked: set[str] = set()
        self.n = 0

    def spec(self, trial: int) -> tuple[str, dict, tuple[str, int]]:
        self.n += 1
        token = f"t{trial}-{self.n}"
        note = f'echo "$COLO_JOB_ID" >> {self.runs}; '
        gate = self.gates / f"gate-{trial}"
        kind = self.rng.choice(["quick", "gpu", "gated", "gated-gpu", "fails", "sleeper"]
                               + (["container"] if self.image else []))
        spec: dict = {"name": token, "gpus": 0}
        if kind == "quick":
            spec["argv"] = ["sh", "-c", note + "true"]
        elif kind == "gpu":
            spec.update(gpus=1, gpu_mem=256 * MiB,
                        argv=["sh", "-c", note + f"exec {self.burn} --mem 32MiB --seconds 0.2 --quiet"])
        elif kind in ("gated", "gated-gpu"):
            spec["argv"] = ["sh", "-c", note + f"while [ ! -e {gate} ]; do sleep 0.05; done"]
            if kind == "gated-gpu":
                spec.update(gpus=1, gpu_mem=512 * MiB)
        elif kind == "fails":
            spec["argv"] = ["sh", "-c", note + "exit 3"]
        elif kind == "sleeper":
            spec["argv"] = ["sh", "-c", note + f"sleep {self.rng.uniform(0.05, 0.5):.2f}"]
        else:  # a container that waits for its gate, seen through a read-only mount
            spec.update(image=self.image, mounts=[f"{self.gates}:/gates:ro", f"{self.out}:/out"],
                        argv=["sh", "-c", f'echo "$COLO_JOB_ID" >> /out/runs; '
                              f"while [ ! -e /gates/gate-{trial} ]; do sleep 0.05; done"])
        expect = ("failed", 3) if kind == "fails" else ("succeeded", 0)
        return token, spec, expect

    def submit_some(self, client: Client, trial: int, count: int, pause: float,
                    first: threading.Event | None = None) -> None:
        try:
            self._submit_some(client, trial, count, pause, first)
        finally:
            if first:
                first.set()

    def _submit_some(self, client: Client, trial: int, count: int, pause: float, first) -> None:
        for _ in range(count):
            token, spec, expect = self.spec(trial)
            self.expect[token] = expect
            try:
                self.acked[token] = client.submit(spec)["id"]
                if first:
                    first.set()
            except ClientError:  # the daemon died under us: the submission may or may not be stored
                self.unacked.add(token)
                return
            time.sleep(pause)  # pacing of the workload, not synchronisation

    def run_counts(self) -> dict[int, int]:
        out: dict[int, int] = {}
        if self.runs.exists():
            for line in self.runs.read_text().split():
                out[int(line)] = out.get(int(line), 0) + 1
        return out


def snapshot(state_dir: Path) -> dict[int, tuple[str, str]]:
    with db_ro(state_dir) as db:
        return {i: (s, r) for i, s, r in db.execute("SELECT id, state, reason FROM jobs")}


def check_store(state_dir: Path, w: Workload, before: dict[int, tuple[str, str]]) -> list[str]:
    """The checks that hold the moment the daemon is back (nothing depends on recovery's progress)."""
    bad = []
    with db_ro(state_dir) as db:
        db.execute("BEGIN")  # one snapshot for both tables: the restarted daemon is writing meanwhile
        jobs = {i: (json.loads(spec).get("name"), st, reason)
                for i, spec, st, reason in db.execute("SELECT id, spec, state, reason FROM jobs")}
        events: dict[int, list[tuple[str | None, str, str]]] = {}
        for job_id, old, new, reason in db.execute(
                "SELECT job_id, old_state, new_state, reason FROM events ORDER BY id"):
            events.setdefault(job_id, []).append((old, new, reason))
        db.execute("COMMIT")
    by_name: dict[str, list[int]] = {}
    for i, (name, _, _) in jobs.items():
        by_name.setdefault(name, []).append(i)
    for token, job_id in w.acked.items():
        if by_name.get(token) != [job_id]:
            bad.append(f"acknowledged {token} (job {job_id}) stored as {by_name.get(token)}")
    for token in w.unacked:
        if len(by_name.get(token, [])) > 1:
            bad.append(f"unacknowledged {token} stored {len(by_name[token])} times")
    for i, (name, st, reason) in jobs.items():
        if not reason:
            bad.append(f"job {i} ({st}) has no reason")
        chain = events.get(i, [])
        if not chain or chain[0][0] is not None or chain[0][1] != "queued":
            bad.append(f"job {i}: events do not start with its submission")
            continue
        for (_, prev, _), (old, new, _) in zip(chain, chain[1:]):
            if old != prev or State(new) not in ALLOWED[State(old)]:
                bad.append(f"job {i}: event {old}->{new} after {prev}")
        if chain[-1][1] != st:
            bad.append(f"job {i} is {st} but its last event says {chain[-1][1]}")
        if i in before and before[i][0] in TERMINAL and (st, reason) != before[i]:
            bad.append(f"job {i} was {before[i]} before the crash, {st, reason} after")
    return bad


def settled(d: DaemonProc) -> list[str] | None:
    """None once recovery is done: nothing `starting`, every `running` job's process alive."""
    with db_ro(d.state_dir) as db:
        rows = db.execute("SELECT id, state, handle, spec FROM jobs WHERE state IN ('starting','running')").fetchall()
    bad = []
    for i, st, handle, spec in rows:
        if st == "starting":
            bad.append(f"job {i} still starting")
        elif handle and not json.loads(spec).get("image") and not _alive(int(handle.split(":")[0])):
            bad.append(f"job {i} running but its process {handle} is gone")
    return bad or None


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def final_check(d: DaemonProc, w: Workload) -> list[str]:
    bad = []
    runs = w.run_counts()
    with db_ro(d.state_dir) as db:
        rows = db.execute("SELECT id, json_extract(spec,'$.name'), state, exit_code, reason FROM jobs").fetchall()
    for i, token, st, code, reason in rows:
        want = w.expect.get(token)
        if want and (st, code) != want:
            bad.append(f"job {i} ({token}) ended {st} ({code}, {reason!r}), expected {want}")
        if runs.get(i, 0) != 1:
            bad.append(f"job {i} ({token}) ran {runs.get(i, 0)} times")
    return bad


def run_trials(root: Path, trials: int, seed: int, image: str | None = None, log=lambda s: None) -> dict:
    """Returns {"trials", "jobs", "violations": [...], "restart_s": [...], "recover_s": [...]}."""
    rng = random.Random(seed)
    fakegpu.create(root / "gpus", count=2, mem=2 * GiB)
    d = DaemonProc(root, root / "gpus", config={"stop_grace": 1.0}).start()
    os.chmod(d.socket.parent, 0o755)
    w = Workload(root, rng, image)
    violations: list[str] = []
    restart_s, recover_s = [], []
    try:
        for t in range(trials):
            for old in range(t):  # release some earlier trials: their jobs end around the kill
                if rng.random() < 0.4:
                    (w.gates / f"gate-{old}").touch()
            client = Client(d.socket, timeout=10)
            first = threading.Event()
            th = threading.Thread(target=w.submit_some,
                                  args=(client, t, rng.randint(2, 6), rng.uniform(0, 0.05), first))
            th.start()
            # the random moment of the crash, counted from the trial's first acknowledged submit so
            # that every trial has stored work to recover however slow the machine is
            first.wait(30)
            time.sleep(rng.uniform(0.0, 0.6))
            d.kill9()
            th.join(30)
            before = snapshot(d.state_dir)
            if rng.random() < 0.3:  # something finishes while the daemon is down
                (w.gates / f"gate-{rng.randrange(t + 1)}").touch()
            t0 = time.perf_counter()
            d.start()
            restart_s.append(time.perf_counter() - t0)
            violations += [f"trial {t}: {v}" for v in check_store(d.state_dir, w, before)]
            try:
                wait_for(lambda: settled(d) is None, 15, "recovery to settle", interval=0.02)
            except AssertionError:
                violations += [f"trial {t}: {v}" for v in settled(d) or []]
            recover_s.append(time.perf_counter() - t0)
            log(f"trial {t}: {len(w.acked)} acked, {len(w.unacked)} cut short, {len(violations)} violations")
        for t in range(trials):
            (w.gates / f"gate-{t}").touch()
        wait_for(lambda: all(s in TERMINAL for s, _ in snapshot(d.state_dir).values()), 120, "every job to end")
        violations += final_check(d, w)
        n_jobs = len(snapshot(d.state_dir))
        states: dict[str, int] = {}
        for s, _ in snapshot(d.state_dir).values():
            states[s] = states.get(s, 0) + 1
    finally:
        d.stop()
    return {"trials": trials, "jobs": n_jobs, "acked": len(w.acked), "unacked": len(w.unacked),
            "stored_unacked": sum(1 for tok in w.unacked if _stored(d.state_dir, tok)),
            "states": states, "violations": violations, "restart_s": restart_s, "recover_s": recover_s}


def _stored(state_dir: Path, token: str) -> bool:
    with db_ro(state_dir) as db:
        return db.execute("SELECT 1 FROM jobs WHERE json_extract(spec,'$.name')=?", (token,)).fetchone() is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=8)
    ap.add_argument("--docker", action="store_true", help="mix in container jobs (needs a Docker engine)")
    ap.add_argument("--keep", action="store_true", help="keep the state dir and daemon log afterwards")
    ap.add_argument("-v", action="store_true")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    native.ensure_built()
    image = None
    if a.docker:
        import docker

        from colo.runtimes.image import build_local_image
        image = build_local_image(docker.from_env(), "colo-test/base:1", with_shell=True)
    rep = Report("crash_trials")
    root = shared_root("colo-crash-")
    try:
        fresh = fresh_start(root / "fresh")
        r = run_trials(root, a.trials, a.seed, image, log=print if a.v else (lambda s: None))
    finally:
        if a.keep:
            print(f"kept {root} (daemon log: {root / 'daemon.log'})")
        else:
            shutil.rmtree(root, ignore_errors=True)
    rs, rc = sorted(r["restart_s"]), sorted(r["recover_s"])
    print(f"{r['trials']} SIGKILLs (seed {a.seed}{', with containers' if image else ''}): {r['jobs']} jobs, "
          f"{r['acked']} acknowledged, {r['unacked']} submissions cut by the kill "
          f"({r['stored_unacked']} of them stored); final states {r['states']}")
    rep.check(not r["violations"], f"{len(r['violations'])} violations: {r['violations'][:5]}")
    rep.figure("restart", "daemon restart after SIGKILL to first answer, median", rs[len(rs) // 2], "s", fresh,
               "first start of a daemon on an empty state dir", f"max {rs[-1]:.2f} s over {len(rs)} restarts")
    rep.figure("recover", "restart to recovery settled, median", rc[len(rc) // 2], "s", fresh,
               "first start of a daemon on an empty state dir", f"max {rc[-1]:.2f} s")
    sys.exit(rep.finish(a.json_out))


def fresh_start(root: Path) -> float:
    """Seconds from launch to first answer of a daemon on an empty state dir (the restart's baseline)."""
    root.mkdir()
    fakegpu.create(root / "gpus", count=2, mem=2 * GiB)
    d = DaemonProc(root, root / "gpus", config={"stop_grace": 1.0})
    t0 = time.monotonic()
    d.start()
    t = time.monotonic() - t0
    d.stop()
    return t

if __name__ == "__main__":
    main()
