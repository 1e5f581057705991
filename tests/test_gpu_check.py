"""bench/gpu_check.py runs on the simulated driver, so the one command meant for a lent GPU machine
cannot rot before a session gets one (issues 15, 29): it leaves at most 4 files, prints its summary,
keeps every check that finished when a part or the whole run is cut, and marks MPS skipped where
there is none."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "bench" / "gpu_check.py"
MAX_FILES = 4  # the two reports and, while one is rewritten, its .tmp


def run(out: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict, str]:
    r = subprocess.run([sys.executable, str(CHECK), str(out), "--simulated", *args], capture_output=True,
                       text=True, timeout=280, env=env)
    report = json.loads((out / "gpu-report.json").read_text())
    return r, report, (out / "gpu-report.md").read_text()


def files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def failing(report: dict) -> dict:
    return {n: (p["status"], p.get("error"), p.get("skip_reason"), [c for c in p["checks"] if not c["ok"]])
            for n, p in report["parts"].items() if p["status"] != "ok"}


def test_every_simulated_part_passes_in_two_files_and_the_summary_is_printed(tmp_path):
    r, report, md = run(tmp_path)
    assert r.returncode == 0 and not failing(report), (failing(report), r.stdout[-2000:], r.stderr[-2000:])
    assert files(tmp_path) == ["gpu-report.json", "gpu-report.md"]
    assert report["simulated"] and report["verdict"] == "passed"
    assert list(report["parts"]) == ["machine", "frameworks", "mps", "colocation", "cost", "mps_faults", "suspend"]
    machine = report["parts"]["machine"]["results"]
    assert machine["nvml"]["driver"] and machine["system"]["kernel"] == os.uname().release
    assert machine["procaddr"]["summary"]["cuMemAlloc@13020_is_dlsym_cuMemAlloc_v2"] is True
    colo = report["parts"]["colocation"]["results"]
    assert colo["budget_jobs"]["over-budget"]["state"] == "failed"
    assert all(j["state"] == "succeeded" for j in colo["colo_cold"]["rows"] + colo["colo_seeded"]["rows"])
    assert colo["colo_seeded"]["modes"].get("mps")  # seeded with their profile, light jobs share under MPS
    assert report["parts"]["mps"]["results"]["second_user"]["rc"] == 0
    # the summary goes to standard output, whole, after every part and at the end
    assert r.stdout.count("# colo GPU check:") == len(report["parts"]) + 1
    assert r.stdout.rstrip().splitlines()[-1].startswith("gpu_check: wrote")
    assert "SIMULATED DRIVER" in md and "| a job over its budget |" in md and "| colocation | ok |" in md


def test_a_deadline_cuts_a_part_and_the_report_keeps_every_check_that_finished(tmp_path):
    r, report, md = run(tmp_path, "--deadline", "60", "--hang-part", "colocation")
    parts = report["parts"]
    assert r.returncode == 1 and report["verdict"].startswith("not passed")
    assert files(tmp_path) == ["gpu-report.json", "gpu-report.md"]
    assert all(parts[n]["status"] == "ok" for n in ("machine", "frameworks", "mps")), failing(report)
    cut = parts["colocation"]
    assert cut["status"] == "timeout" and "deadline" in cut["error"]
    assert [c["ok"] for c in cut["checks"]] == [True]  # the check it made before it hung is kept
    assert parts["cost"]["status"] == parts["mps_faults"]["status"] == parts["suspend"]["status"] == "not run"
    assert "colocation: **timeout**" in md and "cost: **not run**" in md


def test_a_run_killed_outright_leaves_the_report_of_what_had_finished(tmp_path):
    p = subprocess.Popen([sys.executable, str(CHECK), str(tmp_path), "--simulated", "--hang-part", "colocation"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    report = {}
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not report.get("parts", {}).get("colocation", {}).get("checks"):
            time.sleep(0.5)
            try:
                report = json.loads((tmp_path / "gpu-report.json").read_text())
            except (OSError, ValueError):
                pass
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # as a machine's time limit does: no chance to write anything more
        p.wait()
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    parts = report["parts"]
    assert len(files(tmp_path)) <= MAX_FILES
    assert all(parts[n]["status"] == "ok" and parts[n]["checks"] for n in ("machine", "frameworks", "mps"))
    assert parts["colocation"]["status"] == "running" and parts["colocation"]["checks"][0]["ok"]
    assert "| colocation | running | 1/1 |" in (tmp_path / "gpu-report.md").read_text()
    # the part, in a session of its own, saw its runner gone and ended itself and all it had started
    import psutil

    def leftovers() -> list:
        out = []
        for q in psutil.process_iter(["cmdline"]):
            try:
                if report["run_root"] in " ".join(q.info["cmdline"] or []) or \
                        q.environ().get("COLO_GPUCHECK_RUN") == Path(report["run_root"]).name:
                    out.append(q.pid)
            except psutil.Error:
                pass
        return out
    deadline = time.monotonic() + 30
    while (leftovers() or os.path.exists(report["run_root"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftovers() and not os.path.exists(report["run_root"])


@pytest.mark.parametrize("mps", ["missing", "refused"])
def test_without_mps_the_mps_checks_are_skipped_with_the_reason_and_the_run_passes(tmp_path, mps):
    """No nvidia-cuda-mps-control, or one that a sandbox stops from starting (here: a stand-in that
    exits 1): parts mps and mps_faults are skipped with why, colocation runs without MPS."""
    from colo.node import native

    nat = tmp_path / "native"
    shutil.copytree(native.ensure_built(), nat, symlinks=True)
    ctl = nat / "fakegpu" / "nvidia-cuda-mps-control"
    ctl.unlink()
    if mps == "refused":
        ctl.write_text("#!/bin/sh\necho 'MPS is not supported in this sandbox (stand-in)' >&2\nexit 1\n")
        ctl.chmod(0o755)
    out = tmp_path / "out"
    r, report, md = run(out, env={**os.environ, "COLO_NATIVE_DIR": str(nat)})
    parts = report["parts"]
    assert r.returncode == 0, (failing(report), r.stdout[-2000:])
    for name in ("mps", "mps_faults"):
        assert parts[name]["status"] == "skipped" and not parts[name]["checks"]
    why = {"missing": "nvidia-cuda-mps-control is not installed",
           "refused": "MPS refused here: colo's control daemon did not start"}[mps]
    assert why in parts["mps"]["skip_reason"] and f"mps: skipped: {why}" in md
    assert "MPS not used" in parts["colocation"]["results"]["setup"]["mps"]
    assert not parts["colocation"]["results"]["colo_seeded"]["modes"].get("mps")
    assert parts["colocation"]["results"]["pair"]["mps_s"] is None


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path):
    r, report, md = run(tmp_path, "--parts", "mps,cost,nosuch", "--fail-part", "mps")
    parts = report["parts"]
    assert r.returncode == 1
    assert parts["mps"]["status"] == "error" and "failure injected into part mps" in parts["mps"]["error"]
    assert parts["cost"]["status"] == "ok" and parts["cost"]["results"]["pairs"]
    assert parts["nosuch"]["status"] == "error"
    assert "mps: **error**" in md and "failure injected" in md


def overlapping(rows: list[dict]) -> int:
    """The most jobs that ran at once, from their start and end times."""
    edges = sorted([(r["started_at"], 1) for r in rows] + [(r["ended_at"], -1) for r in rows])
    most = now = 0
    for _, step in edges:  # an end sorts before a start at the same instant
        now += step
        most = max(most, now)
    return most


def test_the_fit_s_groups_and_the_two_queues_record_every_group_and_every_way(tmp_path):
    """Issue 39's measurements: like jobs in groups (both heavy pairs included) and colo beside plain
    sharing on a queue that fits and one that does not; colo loses no job of either, and never runs
    more of the memory-holding jobs at once than the GPU holds."""
    r, report, md = run(tmp_path, "--parts", "groups,queues")  # (MPS too where part mps ran first: as above)
    assert r.returncode == 0 and not failing(report), (failing(report), r.stdout[-2000:], r.stderr[-2000:])
    groups = report["parts"]["groups"]["results"]["groups"]
    want = [(k, n) for k, sizes in (("light", (2, 4, 8, 16)), ("medium", (2, 4)), ("heavy", (2,)), ("stream", (2,)))
            for n in sizes]
    assert [(g["kind"], g["n"], g["mode"]) for g in groups] == [(k, n, "timesliced") for k, n in want]
    assert all(g["together_s"] > 0 and g["alone_s"] > 0 and 0.0 <= g["together_sm"] <= 1.0 for g in groups)
    q = report["parts"]["queues"]["results"]
    for name in ("fits", "over"):
        assert all(q[name][way]["wall_s"] > 0 for way in ("serial", "plain", "cold", "learned"))
        for way in ("cold", "learned"):
            rows = q[name][way]["rows"]
            assert len(rows) == 6 and {r["state"] for r in rows} == {"succeeded"} and q[name][way]["lost"] == 0
    # 6 jobs of 30 % of the GPU each, budgeted past it: at most 3 at once
    assert max(overlapping(q["over"][way]["rows"]) for way in ("cold", "learned")) <= 3
    assert "## Queues of mixed jobs" in md and "| over | all at once, no colo (plain sharing) |" in md
    assert "| 2 stream | timesliced |" in md and "as colo's watch expects" in md
