"""`colo demo` end to end, exactly as a newcomer runs it."""
from __future__ import annotations

import os
import re
import subprocess
import sys


def test_demo_runs_queues_enforces_and_stops_cleanly():
    env = {k: v for k, v in os.environ.items() if k not in ("COLO_SOCKET", "COLO_FAKEGPU_STATE")}
    r = subprocess.run([sys.executable, "-m", "colo", "demo"], capture_output=True, text=True, env=env, timeout=240)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert re.search(r"job\s+4 finetune\s+queued\s+waiting for memory", out)  # one that must wait
    summary = out.split("\nSummary\n", 1)[1]
    for name in ("train-a", "train-b", "infer", "finetune", "greedy"):
        assert re.search(rf"{name}\s+succeeded", summary), summary
    assert re.search(r"greedy .*1 allocation\(s\) refused by its budget of 2\.0GiB", summary)
    leftovers = subprocess.run(["pgrep", "-f", "colo-demo-"], capture_output=True, text=True).stdout.split()
    assert not leftovers, "the demo left processes behind"
