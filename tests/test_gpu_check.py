"""bench/gpu_check.py runs on the simulated driver, so the one command meant for a lent GPU
machine cannot rot before a session gets one (issue 15)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "bench" / "gpu_check.py"


def run(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    r = subprocess.run([sys.executable, str(CHECK), str(out), "--simulated", *args], capture_output=True,
                       text=True, timeout=280)
    report = json.loads((out / "gpu-report.json").read_text())
    return r, report, (out / "gpu-report.md").read_text()


def test_every_simulated_part_passes_and_the_report_says_simulated(tmp_path):
    r, report, md = run(tmp_path)
    failing = {n: (p["status"], p.get("error"), [c for c in p["checks"] if not c["ok"]])
               for n, p in report["parts"].items() if p["status"] != "ok"}
    assert r.returncode == 0 and not failing, (failing, r.stdout[-2000:], r.stderr[-2000:])
    assert report["simulated"] and report["build"]["status"] == "ok"
    assert set(report["parts"]) == {"frameworks", "cost", "mps", "daemon"}
    assert report["versions"]["nvml"]["driver"]  # the (simulated) driver's version was read through NVML
    daemon = report["parts"]["daemon"]["results"]
    assert daemon["budget_jobs"]["over-budget"]["state"] == "failed"
    assert all(j["state"] == "succeeded" for j in daemon["light_under_colo"])
    assert "SIMULATED DRIVER" in md and "| a job over its budget |" in md


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path):
    r, report, md = run(tmp_path, "--parts", "mps,cost,nosuch", "--fail-part", "mps")
    parts = report["parts"]
    assert r.returncode == 1
    assert parts["mps"]["status"] == "error" and "failure injected into part mps" in parts["mps"]["error"]
    assert parts["cost"]["status"] == "ok" and parts["cost"]["results"]["pairs"]
    assert parts["nosuch"]["status"] == "error"
    assert "### mps: error" in md and "failure injected" in md
