"""Issue 42's aim: a drained GPU gets 0 new jobs in a 1,000-job run, with `--now` and without.

A real daemon on 2 simulated GPUs of 16 GiB. Two long jobs of 9 GiB run, one on each GPU; GPU 0 is drained (without
--now: its long job runs on; with --now: it is requeued, and waits, as GPU 1 has no room for it). Then --jobs short GPU
jobs (`true`, 256 MiB) are submitted over the socket and run to their end. Counted from the store:
jobs started on GPU 0 after the drain (the aim: 0), jobs that ran on GPU 1, and where the long job
of GPU 0 ended up. Exit 1 when any job was placed on the drained GPU or a job did not succeed.

Run: python bench/drain_bench.py [--jobs 1000] [--max-minutes 20]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time

import checkout  # noqa: E402
checkout.use_harness()

from harness.daemon import DaemonProc, gpu_node, wait_for  # noqa: E402

MiB = 1024**2


def run(n: int, now: bool, limit: float) -> bool:
    root, state, _ = gpu_node("colo-drainbench-", count=2)
    d = DaemonProc(root, state).start()
    try:
        c = d.client
        go = root / "go"
        long = {"argv": ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.1; done"], "gpus": 1, "gpu_mem": 9 * 1024 * MiB,
                "workdir": "/tmp"}
        holders = [c.call("submit", spec=long)["id"] for _ in range(2)]
        for h in holders:
            d.wait_state(h, "running", timeout=120)
        u = {g["index"]: g["uuid"] for g in c.gpus()["gpus"]}
        on0 = next(h for h in holders if d.job(h)["gpus"] == [u[0]])
        r = c.drain(["0"], "bench", now=now)
        t0 = time.time()
        ids = [c.call("submit", spec={"argv": ["true"], "gpus": 1, "gpu_mem": 256 * MiB, "workdir": "/tmp"})["id"]
               for _ in range(n)]
        wait_for(lambda: not [j for j in c.ls(all=False) if j["id"] in set(ids)], limit, f"{n} jobs to end",
                 interval=1.0)
        took = time.time() - t0
        rows = {j["id"]: j for j in c.ls(all=True, limit=0)}
        on_drained = [i for i in ids if rows[i]["gpus"] == [u[0]]]
        failed = [i for i in ids if rows[i]["state"] != "succeeded"]
        held = d.job(on0)
        where = {(u[0],): "GPU 0", (u[1],): "GPU 1"}
        print(f"{'--now' if now else 'plain'}: {n} jobs in {took:.0f} s; placed on drained GPU 0: {len(on_drained)}; "
              f"on GPU 1: {sum(1 for i in ids if rows[i]['gpus'] == [u[1]])}; not succeeded: {len(failed)}; "
              f"GPU 0's long job: {held['state']}, on {where.get(tuple(held['gpus']), 'no GPU')}"
              f"{' (requeued ' + str(r['requeued']) + ')' if now else ''}")
        go.touch()
        return not on_drained and not failed
    finally:
        go.touch()
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--max-minutes", type=float, default=20)
    a = ap.parse_args()
    ok = [run(a.jobs, now, a.max_minutes * 60) for now in (False, True)]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
