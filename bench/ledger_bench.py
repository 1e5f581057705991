"""What a job's rewritten ledger costs the daemon (issue 31, attack 4): the daemon's CPU while two
jobs run that rewrote their ledgers' headers (65,536 slots claimed, every slot marked owned, the
1,024 slots colo made held by one process), beside the same daemon while two honest jobs hold
memory through the interposer. CPU from /proc/PID/stat over --seconds of each.

Run (as root): python bench/ledger_bench.py [--seconds 20] [--json-out bench/results/ledger_bench.json]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report  # noqa: E402

from harness.daemon import DaemonProc, gpu_node, wait_for  # noqa: E402
from harness.ledger import CRAFT  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_share(pid: int, seconds: float) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0) * 100


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rep = Report("ledger_bench")
    root, state, _ = gpu_node("colo-ledger-bench-", count=2)
    (root / "d").mkdir()
    script = root / "craft.py"
    script.write_text(CRAFT)
    py = f"PYTHONPATH={HERE.parent} /usr/bin/python3"
    d = DaemonProc(root / "d", state, {"sample_interval": 1.0}).start()
    try:
        burn = str(next(d.state_dir.glob("native-*")) / "colo-burn")
        honest = [d.submit("--process", "--gpu-mem", "1GiB", "--", burn, "--mem", "512MiB", "--duty", "0",
                           "--seconds", "600") for _ in range(2)]
        for j in honest:
            d.wait_state(j, "running", timeout=60)
        time.sleep(3)
        base = busy_share(d.proc.pid, args.seconds)
        for j in honest:
            d.client.cancel(j)
        crafted = [d.submit("--process", "--gpu-mem", "1GiB", "--", "sh", "-c", f"{py} {script}") for _ in range(2)]
        for j in crafted:
            d.wait_state(j, "running", timeout=60)
            rep.check(bool(wait_for(lambda: "crafted" in "".join(d.client.logs(j)), 120, "the ledger rewritten")),
                      f"job {j} did not rewrite its ledger")
        time.sleep(3)
        hostile = busy_share(d.proc.pid, args.seconds)
        rep.check(all(d.job(j)["state"] == "running" for j in crafted), "a crafting job ended early")
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    rep.figure("crafted", "daemon CPU, two jobs with rewritten ledgers", hostile, "%", baseline=base,
               baseline_what="daemon CPU, two honest jobs", note=f"{args.seconds:g} s each, one sample a second")
    return rep.finish(args.json_out)


if __name__ == "__main__":
    sys.exit(main())
