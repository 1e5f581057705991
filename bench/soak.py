"""Soak (issue 45): a mixed queue from several users on simulated GPUs for `--minutes`, the daemon
SIGKILLed at random every few minutes and started again; at the end, every job must have ended.

The queue, at random moments, from real Unix users (forked clients that setuid):
  - process jobs, with or without a GPU budget (colo-burn holding memory), of a few seconds;
  - container jobs (with a Docker engine; --no-docker leaves them out);
  - arrays of 2-4 tasks;
  - sessions (`colo run` on a pty of its own, the real client), some whose client is killed
    (the session must be cancelled, also when that happens while the daemon is down);
  - cancels and pauses (resumed a little later) of the users' own jobs.
Meanwhile the daemon's RSS and CPU are read every `--every` seconds and printed.

At the end the queue stops, whatever is paused is resumed, and every stored job must end within
`--drain` seconds. Printed: jobs submitted (acknowledged), stored, ended by state, lost (must be
0), stuck (not ended after the drain; must be 0), and the daemon's RSS and CPU over time.

Run (root): python bench/soak.py [--minutes 60] [--kill-every 180] [--seed 1] [--no-docker] [--keep]
"""
from __future__ import annotations

import argparse
import os
import pty
import random
import shutil
import signal
import sys
import threading
import traceback  # noqa: F401 - loaded before the peers setuid (they cannot read this interpreter's files)
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report  # noqa: E402
from harness.probes import db_ro, rss_kib  # noqa: E402
from harness.users import become, ensure_users, run_as, shared_root  # noqa: E402
from load_bench import TERMINAL  # noqa: E402

from harness.daemon import DaemonProc, wait_for  # noqa: E402

import colo.cli.attach  # noqa: E402,F401 - loaded before the session clients fork and setuid
from colo.client import Client, ClientError  # noqa: E402
from colo.node import fakegpu, native  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


class Soak:
    def __init__(self, root: Path, rng: random.Random, users: list, image: str | None):
        self.root, self.rng, self.users, self.image = root, rng, users, image
        self.burn = str(native.path("colo-burn"))
        self.acked: dict[int, str] = {}  # job id -> kind
        self.refused = 0  # actions the daemon could not take (it was down): not counted as jobs
        self.sessions: dict[int, tuple[int, bool]] = {}  # client pid -> (pty master, to be killed)
        self.paused: dict[int, float] = {}  # job -> when to resume it
        self.kills = 0
        self.killed_down = 0  # session clients killed while the daemon was down
        self.orphans = 0
        self.lock = threading.Lock()

    # the queue ------------------------------------------------------------------------------------
    def spec(self, kind: str) -> dict:
        secs = round(self.rng.uniform(1, 15), 1)
        if kind == "gpu":
            mem = self.rng.choice([256, 512, 1024, 2048])
            return {"argv": [self.burn, "--mem", f"{mem // 2}MiB", "--seconds", str(secs), "--quiet"],
                    "gpu_mem": f"{mem}MiB", "workdir": "/tmp"}
        if kind == "container":
            return {"argv": ["sh", "-c", f"sleep {secs}"], "image": self.image, "gpus": 0}
        if kind == "array":
            return {"argv": ["sh", "-c", f"sleep {secs}"], "gpus": 0, "array": f"0-{self.rng.randint(1, 3)}",
                    "workdir": "/tmp"}
        return {"argv": ["sh", "-c", f"sleep {secs}"], "gpus": 0, "workdir": "/tmp"}

    def act(self, sock: Path) -> None:
        """One action of the queue, as a random user."""
        pw = self.rng.choice(self.users)
        kinds = ["process"] * 4 + ["gpu"] * 3 + ["array", "session", "session", "cancel", "pause"] + (["container"] * 2 if self.image else [])
        kind = self.rng.choice(kinds)
        if kind == "session":
            self.session(pw, sock)
            return
        try:
            if kind == "cancel":
                mine = self._mine(pw, sock, ("queued", "running"))
                if mine:
                    run_as(pw, lambda j=self.rng.choice(mine): Client(sock, timeout=30).cancel(j))
            elif kind == "pause":
                mine = self._mine(pw, sock, ("running",))
                if mine:
                    j = self.rng.choice(mine)
                    run_as(pw, lambda: Client(sock, timeout=30).pause(j))
                    with self.lock:
                        self.paused[j] = time.monotonic() + self.rng.uniform(1, 10)
            else:
                spec = self.spec(kind)
                got = run_as(pw, lambda: Client(sock, timeout=30).submit(spec))
                with self.lock:
                    for i in got.get("tasks") or [got["id"]]:  # an array: each task is a job of its own
                        self.acked[i] = kind
        except RuntimeError as e:  # the peer's ClientError: the daemon was down, or the job moved on meanwhile
            if "Client" not in str(e) and "Daemon" not in str(e):
                raise
            self.refused += 1

    def _mine(self, pw, sock: Path, states: tuple[str, ...]) -> list[int]:
        rows = run_as(pw, lambda: Client(sock, timeout=30).ls(all=False))
        return [r["id"] for r in rows if r["uid"] == pw.pw_uid and r["state"] in states]

    def session(self, pw, sock: Path, secs: float | None = None, kill: bool | None = None,
                name: str = "soak-session") -> None:
        """`colo run -- sleep N` on a pty of its own as `pw`, half of them ignoring SIGHUP (so only
        colo ends them when their client goes); a third are picked to have their client killed."""
        secs = round(self.rng.uniform(2, 20), 1) if secs is None else secs
        argv = ["sleep", str(secs)] if self.rng.random() < 0.5 and name == "soak-session" else \
            ["sh", "-c", f"trap '' HUP; sleep {secs}"]
        pid, fd = pty.fork()
        if pid == 0:  # pragma: no cover - the client
            code = 99
            try:
                become(pw, "/tmp")
                code = colo.cli.attach.run(Client(sock), {"argv": argv, "gpus": 0, "workdir": "/tmp", "name": name})
            except BaseException:  # noqa: BLE001
                pass
            finally:
                os._exit(code if isinstance(code, int) else 1)
        os.set_blocking(fd, False)
        with self.lock:
            self.sessions[pid] = (fd, self.rng.random() < 1 / 3 if kill is None else kill)

    def orphan(self, d: DaemonProc) -> None:
        """A session that ignores SIGHUP, running when the daemon is killed: its client is killed
        while the daemon is down (kill_sessions), so only the restarted daemon can end it."""
        self.orphans += 1
        name = f"soak-orphan-{self.orphans}"
        self.session(self.rng.choice(self.users), d.socket, secs=600, kill=True, name=name)
        try:
            wait_for(lambda: any(j["name"] == name and j["state"] == "running" for j in d.client.ls(all=False)),
                     60, f"session {name} to run")
        except AssertionError:
            print(f"soak.py: {name} did not start within 60 s")

    def tend(self) -> None:
        """Drain the session clients' terminals, kill the ones picked to be killed, reap the ended;
        resume the pauses that are due."""
        with self.lock:
            items = list(self.sessions.items())
        for pid, (fd, kill) in items:
            try:
                while os.read(fd, 65536):
                    pass
            except OSError:
                pass
            if kill and self.rng.random() < 0.2:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                os.close(fd)
                with self.lock:
                    del self.sessions[pid]

    def kill_sessions(self) -> None:
        """Kill the session clients picked to be killed, now."""
        with self.lock:
            picked = [pid for pid, (_, kill) in self.sessions.items() if kill]
        for pid in picked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.killed_down += len(picked)

    def resume_due(self, d: DaemonProc, every: bool = False) -> None:
        now = time.monotonic()
        with self.lock:
            due = [j for j, t in self.paused.items() if every or t <= now]
        for j in due:
            try:
                if d.job(j).get("paused_by"):
                    d.client.resume(j)  # root, as an admin would
                with self.lock:
                    self.paused.pop(j, None)
            except (ClientError, OSError):
                pass  # the daemon is down: next time


def daemon_cpu_s(pid: int) -> float:
    try:
        fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--kill-every", type=float, default=180.0, help="mean seconds between SIGKILLs of the daemon")
    ap.add_argument("--rate", type=float, default=1.0, help="queue actions a second, on average")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between readings of the daemon's RSS and CPU")
    ap.add_argument("--drain", type=float, default=300.0, help="seconds every job gets to end after the queue stops")
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-docker", action="store_true", help="leave container jobs out")
    ap.add_argument("--keep", action="store_true", help="keep the state dir and the daemon's log")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("soak.py: run as root (the daemon is root's; the queue's users are real Unix users)")
    native.ensure_built()
    rng = random.Random(a.seed)
    image = None
    if not a.no_docker:
        try:
            import docker

            from colo.runtimes.image import build_local_image
            image = build_local_image(docker.from_env(), "colo-test/base:1", with_shell=True)
        except Exception as e:  # noqa: BLE001 - no engine here: process jobs only
            print(f"soak.py: no container jobs ({e.__class__.__name__}: {e})")
    rep = Report("soak")
    root = shared_root("colo-soak-")
    fakegpu.create(root / "gpus", count=2, mem=16 * GiB)
    d = DaemonProc(root, root / "gpus", config={"stop_grace": 2.0, "sample_interval": 1.0}).start()
    os.chmod(d.socket.parent, 0o755)
    s = Soak(root, rng, ensure_users(a.users), image)
    readings: list[tuple[float, int, float]] = []  # (minute, RSS KiB, CPU % of one core since the last)
    t0 = time.monotonic()
    end = t0 + a.minutes * 60
    next_kill = t0 + rng.uniform(0.5, 1.5) * a.kill_every
    next_reading, last_cpu, last_at = t0 + a.every, 0.0, t0
    cpu_before = 0.0  # CPU of daemons killed earlier (a restarted daemon counts from 0)
    try:
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_kill:
                s.orphan(d)
                cpu_before += daemon_cpu_s(d.proc.pid)
                d.kill9()
                s.kills += 1
                s.kill_sessions()  # their jobs must end all the same: the restarted daemon sees no client
                time.sleep(rng.uniform(0, 3))  # the queue's clients meet a dead socket meanwhile
                for _ in range(rng.randint(0, 3)):
                    s.act(d.socket)
                d.start()
                os.chmod(d.socket.parent, 0o755)
                print(f"{(time.monotonic() - t0) / 60:6.1f} min: daemon SIGKILLed and started again "
                      f"(kill {s.kills})", flush=True)
                next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * a.kill_every
            if now >= next_reading:
                cpu = cpu_before + daemon_cpu_s(d.proc.pid)
                pct = 100 * (cpu - last_cpu) / max(1e-6, now - last_at)
                rss = rss_kib(d.proc.pid)
                readings.append(((now - t0) / 60, rss, pct))
                with db_ro(d.state_dir) as db:
                    ended = db.execute(f"SELECT count(*) FROM jobs WHERE state IN ({','.join('?' * len(TERMINAL))})",
                                       tuple(TERMINAL)).fetchone()[0]
                print(f"{(now - t0) / 60:6.1f} min: submitted {len(s.acked)}, ended {ended}, daemon RSS "
                      f"{rss / 1024:.1f} MiB, CPU {pct:.1f} %", flush=True)
                last_cpu, last_at, next_reading = cpu, now, now + a.every
            s.act(d.socket)
            s.tend()
            s.resume_due(d)
            time.sleep(rng.expovariate(a.rate))
        # the queue stops: what is paused is resumed, sessions run out, every job must end
        print(f"{(time.monotonic() - t0) / 60:6.1f} min: the queue stops; every job must end within {a.drain:.0f} s",
              flush=True)

        def drained() -> bool:
            s.tend()
            s.resume_due(d, every=True)
            with db_ro(d.state_dir) as db:
                return not db.execute(f"SELECT count(*) FROM jobs WHERE state NOT IN "
                                      f"({','.join('?' * len(TERMINAL))})", tuple(TERMINAL)).fetchone()[0]
        try:
            wait_for(drained, a.drain, "every job to end", interval=1.0)
        except AssertionError:
            pass
        with db_ro(d.state_dir) as db:
            rows = db.execute("SELECT id, state, reason, json_extract(spec, '$.name') FROM jobs").fetchall()
    finally:
        for pid, (fd, _) in list(s.sessions.items()):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(fd)
            except OSError:
                pass
        d.stop()
        if a.keep:
            print(f"kept {root} (daemon log: {d.log})")
        else:
            shutil.rmtree(root, ignore_errors=True)
    states: dict[str, int] = {}
    for _, st, _, _ in rows:
        states[st] = states.get(st, 0) + 1
    stored = {i for i, _, _, _ in rows}
    lost = [(i, r) for i, st, r, _ in rows if st == "lost"]
    stuck = [(i, st) for i, st, _, _ in rows if st not in TERMINAL]
    # the orphans by name: a plain session whose client kill_sessions took is ended the same way
    went = "went away while colo was restarting"
    orphans_ended = sum(1 for _, st, r, n in rows if st == "cancelled" and went in r and n.startswith("soak-orphan-"))
    others_ended = sum(1 for _, st, r, n in rows if st == "cancelled" and went in r and not n.startswith("soak-orphan-"))
    missing = sorted(set(s.acked) - stored)
    kinds: dict[str, int] = {}
    for k in s.acked.values():
        kinds[k] = kinds.get(k, 0) + 1
    print(f"\n{a.minutes:g} min, {s.kills} SIGKILLs of the daemon, {len(s.users)} users (seed {a.seed}"
          f"{', with containers' if image else ', no containers'})")
    print(f"submitted (acknowledged) {len(s.acked)} {kinds}; stored {len(rows)} (sessions included); "
          f"actions refused (the daemon down, or the job moved on) {s.refused}")
    print(f"ended {sum(states.get(x, 0) for x in TERMINAL)} {states}; session clients killed while the daemon "
          f"was down {s.killed_down}")
    print(f"lost {len(lost)} {lost[:5]}; stuck {len(stuck)} {stuck[:5]}; acknowledged but not stored {len(missing)}")
    print(f"sessions whose client went away while the daemon was down, ended by the restarted daemon: "
          f"{orphans_ended} (of {s.orphans} started for that), and {others_ended} other sessions")
    if readings:
        print("daemon over time (minute, RSS MiB, CPU % of one core): "
              + ", ".join(f"({m:.1f}, {r / 1024:.1f}, {c:.1f})" for m, r, c in readings))
    rep.check(not lost, f"{len(lost)} jobs lost: {lost[:5]}")
    rep.check(not stuck, f"{len(stuck)} jobs not ended {a.drain:.0f} s after the queue stopped: {stuck[:5]}")
    rep.check(orphans_ended == s.orphans, f"{s.orphans - orphans_ended} orphaned sessions not ended by the restarted daemon")
    rep.check(not missing, f"{len(missing)} acknowledged jobs not stored: {missing[:5]}")
    rep.figure("submitted", "jobs submitted (acknowledged)", len(s.acked), "")
    rep.figure("lost", "jobs lost", len(lost), "")
    rep.figure("stuck", "jobs stuck", len(stuck), "")
    rep.figure("orphans", "orphaned sessions ended after a restart", orphans_ended, "")
    if readings:
        rep.figure("rss_max", "daemon RSS, highest reading", max(r for _, r, _ in readings) * 1024, "B")
        rep.figure("cpu_mean", "daemon CPU, mean of the readings", sum(c for _, _, c in readings) / len(readings), "%")
    sys.exit(rep.finish(a.json_out))


if __name__ == "__main__":
    main()
