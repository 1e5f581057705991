"""Many `colo wait` on ended jobs and one running one, against everyone else's jobs (red-team finding).

Runs the same 10 one-second-or-less jobs of another caller twice in one run: with no waits, then
with W connections each waiting on N ended jobs and a running one; prints how long those 10 jobs
took and the daemon's CPU seconds meanwhile, side by side.

    python bench/wait_bench.py --ended 300 --waits 100
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import time

import checkout  # noqa: E402
checkout.use_harness()
from harness.daemon import DaemonProc, wait_for  # noqa: E402

from harness.users import shared_root  # noqa: E402
from colo.node import fakegpu, native  # noqa: E402
from colo import protocol


def cpu_s(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def ten_jobs(d: DaemonProc) -> tuple[float, float]:
    cpu0, t0 = cpu_s(d.proc.pid), time.monotonic()
    for _ in range(10):
        j = d.client.submit({"argv": ["true"], "gpus": 0})["id"]
        d.wait_state(j, "succeeded", timeout=600)
    return time.monotonic() - t0, cpu_s(d.proc.pid) - cpu0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ended", type=int, default=300)
    ap.add_argument("--waits", type=int, default=100)
    a = ap.parse_args()
    native.ensure_built()
    root = shared_root("colo-wait-bench-")
    fakegpu.create(root / "fake.state", count=1, mem=16 << 30)
    d = DaemonProc(root, root / "fake.state").start()
    conns = []
    try:
        c = d.client
        running = c.submit({"argv": ["sleep", "3600"], "gpus": 0})["id"]
        ids = c.submit({"argv": ["true"], "gpus": 0, "array": f"0-{a.ended - 1}"})["tasks"]
        wait_for(lambda: len(c.ls(all=False)) == 1, 600, "the array to end")
        alone = ten_jobs(d)
        for _ in range(a.waits):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(d.socket))
            s.sendall(protocol.request("wait", ids=[running, *ids]))
            conns.append(s)
        time.sleep(2)
        waited = ten_jobs(d)
        print(f"10 jobs: {waited[0]:.1f} s with {a.waits} waits on {a.ended} ended jobs + 1 running, "
              f"{alone[0]:.1f} s without ({waited[0] / alone[0]:.1f}x); daemon CPU {waited[1]:.1f} s vs {alone[1]:.1f} s")
    finally:
        for s in conns:
            s.close()
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
