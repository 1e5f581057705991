"""What one user's flood costs everyone else (issues 48 and 52), side by side in one run on one
daemon: another user's and root's `colo ls` time quiet and under each attack, and the daemon's RSS,
threads, descriptors, CPU and log growth.

Attacks, each by one unprivileged user (colotest1) against a root daemon with default limits:
  conns  PROCS processes each holding PER_PROC connections, reopening every 5 s the ones the daemon
         closed (20,000 attempts held for HOLD seconds)
  half   1,000 connections each sending 1 MiB of a submit without its end; then all closed
  abandon 2,000 `wait`/`logs -f` streams whose clients leave at once

Run as root:  .venv/bin/python bench/flood_bench.py [--hold 30]
Aims (issue 48): ls within 1.5x of quiet, root's within 1.2x, log < 1 MB/min, CPU < 10 % of a core;
(issue 52) the 1,000 half-sent requests grow the daemon < 100 MiB and it returns to its size.
"""
from __future__ import annotations

import argparse
import os
import select
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()
from harness.daemon import DaemonProc, wait_for  # noqa: E402
from harness.probes import rss_kib  # noqa: E402
from harness.users import Peer, ensure_users, run_as, shared_root  # noqa: E402

from colo import protocol  # noqa: E402
from colo.client import Client  # noqa: E402

PROCS, PER_PROC = 24, 834
REOPEN = 5.0  # seconds between an attacker's rounds of opening again what the daemon closed


def figures(pid: int) -> dict:
    st = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return {"rss_mib": rss_kib(pid) / 1024, "threads": len(os.listdir(f"/proc/{pid}/task")),
            "fds": len(os.listdir(f"/proc/{pid}/fd")), "cpu_s": (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")}


def ls_times(sock: Path, pw, n: int) -> list[float]:
    """n `ls` calls as `pw` (None: root), seconds each."""
    def run():
        out = []
        for _ in range(n):
            t = time.perf_counter()
            Client(sock, timeout=60).ls()
            out.append(time.perf_counter() - t)
        return out
    return run_as(pw, run) if pw is not None else run()


def _hold_conns(sock: str, n: int, stop: str) -> int:
    """n connections held as long as they last; those the daemon closes are opened again every
    REOPEN seconds (an attacker that keeps trying, not one that spins)."""
    live: dict[int, socket.socket] = {}
    made = 0
    poll = select.poll()
    while not os.path.exists(stop):
        while len(live) < n and not os.path.exists(stop):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(2)
            try:
                s.connect(sock)  # (a full backlog: it waits there, an attempt held)
            except OSError:
                s.close()
                break
            live[s.fileno()] = s
            poll.register(s, select.POLLIN)
            made += 1
        deadline = time.monotonic() + REOPEN
        while time.monotonic() < deadline and not os.path.exists(stop):
            for fd, _ in poll.poll(500):
                poll.unregister(fd)
                live.pop(fd).close()  # told the limit, or closed as idle
    for s in live.values():
        s.close()
    return made


def _half_sent(sock: str, n: int, stop: str) -> tuple[int, int]:
    head = b'{"v":1,"op":"submit","args":{"spec":{"argv":["'
    body = head + b"x" * ((1 << 20) - len(head))
    kept, refused = [], 0
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(30)
        try:
            s.connect(sock)
            s.sendall(body)
            kept.append(s)
        except OSError:
            refused += 1
            s.close()
    Path(stop + ".sent").touch()
    while not os.path.exists(stop):
        time.sleep(0.1)
    for s in kept:
        s.close()
    return len(kept), refused


def _abandon(sock: str, job: int, n: int) -> int:
    for i in range(n):
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(sock)
            s.sendall(protocol.request("wait", ids=[job]) if i % 2 else protocol.request("logs", id=job, follow=True))
        except OSError:
            pass
        s.close()
    return n


def row(name: str, f0: dict, f1: dict, secs: float, log_bytes: int, ls_other: list[float], ls_root: list[float],
        quiet: tuple[float, float]) -> str:
    cpu = 100 * (f1["cpu_s"] - f0["cpu_s"]) / secs
    mo, mr = statistics.median(ls_other), statistics.median(ls_root)
    return (f"{name:<8} rss {f1['rss_mib']:7.1f} MiB  threads {f1['threads']:4d}  fds {f1['fds']:6d}  cpu {cpu:5.1f} %  "
            f"log {log_bytes * 60 / secs / 1e6:6.3f} MB/min  ls other {mo * 1e3:6.1f} ms ({mo / quiet[0]:4.2f}x)  "
            f"root {mr * 1e3:6.1f} ms ({mr / quiet[1]:4.2f}x)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold", type=float, default=30.0, help="seconds each attack is held")
    ap.add_argument("--ls", type=int, default=30, help="ls calls per measurement")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (it makes test users)", file=sys.stderr)
        return 2
    users = ensure_users(2)
    root = shared_root("colo-floodbench-")
    talk = root / "talk"
    talk.mkdir()
    os.chown(talk, users[0].pw_uid, users[0].pw_gid)
    d = DaemonProc(root).start()
    os.chmod(d.socket.parent, 0o755)
    try:
        for k in range(100):  # a queue to list
            d.client.submit({"argv": ["sleep", "1000"], "gpus": 0, "workdir": "/tmp", "hold": True, "name": f"j{k}"})
        pid = d.proc.pid
        ls_times(d.socket, users[1], 5)  # warm
        q_other, q_root = [], []
        for _ in range(max(1, a.ls // 5)):
            q_other += ls_times(d.socket, users[1], 5)
            q_root += ls_times(d.socket, None, 5)
        quiet = (statistics.median(q_other), statistics.median(q_root))
        print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; daemon RLIMIT_NOFILE "
              f"{open(f'/proc/{pid}/limits').read().split('Max open files')[1].split()[0]}")
        f0, log0, t0 = figures(pid), d.log.stat().st_size, time.monotonic()
        time.sleep(a.hold)
        print(row("quiet", f0, figures(pid), time.monotonic() - t0, d.log.stat().st_size - log0, q_other, q_root,
                  quiet))

        # connection flood
        stop = str(talk / "stop-conns")
        peers = [Peer(users[0], lambda: _hold_conns(str(d.socket), PER_PROC, stop)) for _ in range(PROCS)]
        for p in peers:
            p.go()
        time.sleep(5)  # the attempts under way
        f0, log0, t0 = figures(pid), d.log.stat().st_size, time.monotonic()
        time.sleep(a.hold)  # the daemon's cost of the attack alone: no probe meanwhile
        f1, secs, log1 = figures(pid), time.monotonic() - t0, d.log.stat().st_size
        other, mine = [], []
        for _ in range(max(1, a.ls // 5)):  # then the probes, while it still holds, interleaved
            other += ls_times(d.socket, users[1], 5)
            mine += ls_times(d.socket, None, 5)
        Path(stop).touch()
        made = sum(p.result() for p in peers)
        for _ in range(max(1, a.ls // 5)):  # quiet again: the machine's load drifts (others share it)
            q_other += ls_times(d.socket, users[1], 5)
            q_root += ls_times(d.socket, None, 5)
        quiet = (statistics.median(q_other), statistics.median(q_root))
        print(row("conns", f0, f1, secs, log1 - log0, other, mine, quiet) + f"  ({made} attempts; quiet before and "
              f"after: other {quiet[0] * 1e3:.1f} ms, root {quiet[1] * 1e3:.1f} ms)")

        # half-sent requests
        stop = str(talk / "stop-half")
        base = figures(pid)
        p = Peer(users[0], lambda: _half_sent(str(d.socket), 1000, stop))
        f0, log0, t0 = figures(pid), d.log.stat().st_size, time.monotonic()
        p.go()
        peak = 0.0
        while not Path(stop + ".sent").exists():
            peak = max(peak, figures(pid)["rss_mib"])
            time.sleep(0.2)
        other, mine = ls_times(d.socket, users[1], a.ls), ls_times(d.socket, None, a.ls)
        f1, secs = figures(pid), time.monotonic() - t0
        Path(stop).touch()
        kept, refused = p.result()
        closed = time.monotonic()
        back = None
        while time.monotonic() - closed < 90:  # pymalloc's arenas go once the timers that pin them do
            time.sleep(1)
            Client(d.socket).hello()
            if figures(pid)["rss_mib"] <= base["rss_mib"] + 2:
                back = time.monotonic() - closed
                break
        after = figures(pid)
        print(row("half", f0, f1, secs, d.log.stat().st_size - log0, other, mine, quiet)
              + f"  ({kept} kept, {refused} refused; rss {base['rss_mib']:.1f} -> peak {max(peak, f1['rss_mib']):.1f}"
              f" -> {after['rss_mib']:.1f} MiB " + (f"{back:.0f} s after they closed)" if back is not None
                                                    else "90 s after they closed: not back)"))

        # abandoned streams
        j = d.client.submit({"argv": ["sh", "-c", "while :; do echo tick; sleep 0.2; done"], "gpus": 0,
                             "workdir": "/tmp"})["id"]
        d.wait_state(j, "running")
        f0, log0, t0 = figures(pid), d.log.stat().st_size, time.monotonic()
        run_as(users[0], lambda: _abandon(str(d.socket), j, 2000))
        left = time.monotonic()
        wait_for(lambda: figures(pid)["fds"] <= f0["fds"] + 4, 120, "the streams released")
        released = time.monotonic() - left
        f1 = figures(pid)
        other, mine = ls_times(d.socket, users[1], a.ls), ls_times(d.socket, None, a.ls)
        print(row("abandon", f0, f1, time.monotonic() - t0, d.log.stat().st_size - log0, other, mine, quiet)
              + f"  (2000 streams released {released:.1f} s after their clients left)")
        d.client.cancel(j)
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
