"""`colo demo` end to end, as a newcomer runs it (with the README's screenshot drawn too): each
part of the story appears, in the text and in the picture."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

import psutil


def _run_from(folder: str) -> list[str]:
    """Live processes run from, or working in, `folder` (another demo's are not: its folder differs)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd", "status"]):
        cmd, cwd = p.info["cmdline"] or [], p.info["cwd"] or ""
        if p.info["status"] != psutil.STATUS_ZOMBIE and (
                any(folder in a for a in cmd) or cwd == folder or cwd.startswith(folder + os.sep)):
            out.append(f"{p.info['pid']}: {' '.join(cmd)}")
    return out


def test_demo_tells_the_story_and_stops_cleanly(tmp_path):
    # The demo makes its folder (state, sockets, MPS pipes, its jobs' workdir) in TMPDIR: one of
    # this test's own, so that the processes left behind can be told from other demos' (short:
    # Unix socket paths are limited to 108 bytes).
    tmp = tempfile.mkdtemp(prefix="cdt-")
    os.chmod(tmp, 0o755)  # MPS servers and jobs reach the simulated driver's state under it
    try:
        _demo(tmp, tmp_path / "top.svg")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _demo(tmp: str, svg) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLO_SOCKET", "COLO_FAKEGPU_STATE")}
    env["TMPDIR"] = tmp
    r = subprocess.run([sys.executable, "-m", "colo", "demo", "--screenshot", str(svg)], capture_output=True, text=True,
                       env=env, timeout=300)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    # two light profiled jobs share a GPU as MPS clients, with the predicted numbers
    assert re.search(r"job\s+2 light-b\s+MPS on GPU(\d): predicted peak SM 60 % \(job 1: 30 %, this job: 30 %\) < 85 %", out), out
    # a heavy job kept off a GPU it would saturate, with the reason
    assert re.search(r"heavy-2\s+kept off: co-running on GPU\d predicted to cost more than it gains: sharing would "
                     r"saturate: predicted peak SM \d+ %.*slower than alone \(bound 1\.5x\)", out), out
    # a job with no profile runs alone and is profiled; its next run is placed from what was learned
    assert re.search(r"fresh\s+time-sliced on GPU\d: no profile yet, runs alone so that this run is profiled", out), out
    m = re.search(r"learned from its run: profile (\S+), \d+s, peak SM (\d+) %", out)
    assert m and 25 <= int(m.group(2)) <= 55, out  # colo-burn --duty 40
    assert re.search(rf"fresh\s+MPS on GPU\d: predicted peak SM \d+ % \(job \d+: 30 %, this job: {m.group(2)} %\)", out), out
    # a budget refuses one allocation only
    assert re.search(r"greedy\s+succeeded .*1 allocation\(s\) refused by its budget of 1\.0GiB", out), out
    # new jobs share from their first minute: a provisional profile from the first's samples
    assert re.search(r"sweep-0\s+time-sliced on GPU(\d): no profile yet, runs alone", out), out
    first = re.search(r"job (\d+) sweep-0", out).group(1)
    for k in (1, 2):
        assert re.search(rf"sweep-{k}\s+MPS on GPU\d: .*its profile is provisional, from the first \d+ s of job {first}",
                         out), out
    # an idle job is suspended for a waiting one, which starts; the idle one's next CUDA call resumes it
    m = re.search(r"job (\d+) notebook holds 4 GiB .* idle \d+s: holds 4\.0GiB, no GPU activity", out)
    assert m, out
    assert re.search(r"train\s+asks for 10 GiB on GPU0, .*colo suspended the notebook \(suspended by colo \(job \d+ waits "
                     r"for its memory\): 4\.0GiB in host memory\),\s+and train started in its memory", out), out
    assert re.search(rf"job {m.group(1)} notebook resumed once train ended \(succeeded\): its call answered 0 ", out), out
    summary = out.split("\nSummary\n", 1)[1]
    assert len(re.findall(r"\bsucceeded\b", summary)) == 13, summary
    assert re.search(r"What sharing saved: the jobs ran \d+ s in all; .* sharing needed \d+ s \(\d+ % less\)", summary)
    # the picture: `colo top` while heavy-2 waits with its reason and greedy's refusal is live
    assert re.search(r"wrote \S+: `colo top` at [\d:]+, job \d+ kept off, job \d+'s allocation refused", out), out
    shot = svg.read_text().replace("&#160;", " ")
    for seen in ("light-a", "light-c", "fresh", "greedy", "heavy-1", "heavy-2", "MPS", "TS", "queue: 1 waiting",
                 "sharing would saturate"):
        assert seen in shot, seen
    leftovers = _run_from(tmp)
    assert not leftovers, f"the demo left processes behind: {leftovers}"

