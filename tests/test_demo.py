"""`colo demo` end to end, as a newcomer runs it (with the README's screenshot drawn too): each
part of the story appears, in the text and in the picture."""
from __future__ import annotations

import os
import re
import subprocess
import sys


def test_demo_tells_the_story_and_stops_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("COLO_SOCKET", "COLO_FAKEGPU_STATE")}
    svg = tmp_path / "top.svg"
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
    summary = out.split("\nSummary\n", 1)[1]
    assert len(re.findall(r"\bsucceeded\b", summary)) == 8, summary
    assert re.search(r"What sharing saved: the jobs ran \d+ s in all; .* sharing needed \d+ s \(\d+ % less\)", summary)
    # the picture: `colo top` while heavy-2 waits with its reason and greedy's refusal is live
    assert re.search(r"wrote \S+: `colo top` at [\d:]+, job \d+ kept off, job \d+'s allocation refused", out), out
    shot = svg.read_text().replace("&#160;", " ")
    for seen in ("light-a", "light-c", "fresh", "greedy", "heavy-1", "heavy-2", "MPS", "TS", "queue: 1 waiting",
                 "sharing would saturate"):
        assert seen in shot, seen
    leftovers = subprocess.run(["pgrep", "-f", "colo-demo-"], capture_output=True, text=True).stdout.split()
    assert not leftovers, "the demo left processes behind"

