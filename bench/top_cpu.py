"""CPU cost of `colo top` idle-refreshing on a busy node, and the daemon's cost of serving it.

    python bench/top_cpu.py [--seconds 20] [--size 160x50]

A real daemon on 8 simulated GPUs (native/fakegpu) with 200 jobs: 24 run colo-burn under the
interposer (3 per GPU, some under MPS), the rest wait. `colo top` runs as the CLI runs it, in a
pseudo-terminal of the given size whose output is read and thrown away. CPU time (utime+stime
from /proc/PID/stat) of both processes is read over one window without `colo top` (the daemon's
own background cost) and one with it; the difference is what serving `colo top` costs. (The README's picture is drawn by
`colo demo --screenshot docs/top.svg`, from the demo's scene.)
"""
from __future__ import annotations

import argparse
import fcntl
import os
import pty
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import checkout  # noqa: E402
checkout.use_harness()

from colo.node import fakegpu, native  # noqa: E402
from harness.daemon import DaemonProc, wait_for  # noqa: E402

from benchlib import Report, daemon_log_problems  # noqa: E402

GiB = 1024**3
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15)


def window(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """% of one core each process used over `seconds` of wall time."""
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)  # the measurement window itself, not synchronisation
    wall = time.monotonic() - t0
    return {k: 100 * (cpu_seconds(p) - before[k]) / wall for k, p in pids.items()}


def start_node(root: Path) -> DaemonProc:
    state = root / "fakegpu.state"
    fakegpu.create(state, count=8, mem=24 * GiB)
    return DaemonProc(root, state, config={"sample_interval": 1.0}).start()


def fill(d: DaemonProc, root: Path) -> None:
    burn = str(native.path("colo-burn"))
    base = {"gpus": 1, "workdir": str(root), "env": {}, "mounts": [], "after": [], "priority": 0, "retries": 0}
    kinds = [("train", "10GiB", "6GiB", 55, None), ("infer", "4GiB", "2GiB", 20, "alexnet"),
             ("notebook", "6GiB", "3GiB", 10, "alexnet")]
    running = []
    for g in range(8):
        for name, budget, mem, duty, profile in kinds:
            spec = {**base, "name": f"{name}-{g}", "gpu_mem": int(budget[:-3]) * GiB, "profile": profile,
                    "argv": [burn, "--mem", mem, "--duty", str(duty), "--seconds", "3600", "--quiet"]}
            running.append(d.client.submit(spec)["id"])
    for i in running:
        d.wait_state(i, "starting", "running", timeout=60)
    for i in range(176):  # 20 GiB fits nowhere while the burns run: these wait, in order
        d.client.submit({**base, "name": f"sweep-{i}", "gpu_mem": 20 * GiB, "argv": ["true"],
                         "priority": 1 if i % 50 == 0 else 0})
    wait_for(lambda: sum(j["state"] == "queued" for j in d.client.top()["jobs"]) == 176, 60, "176 waiting jobs")


def stop_node(d: DaemonProc) -> None:
    """Cancel every job (the burns would outlive the daemon otherwise), then stop the daemon."""
    try:
        for j in d.client.ls(all=False):
            try:
                d.client.cancel(j["id"])
            except Exception:  # noqa: BLE001 - ended meanwhile
                pass
        wait_for(lambda: not d.client.ls(all=False), 60, "jobs to end")
    finally:
        d.stop()


def spawn_top(d: DaemonProc, cols: int, rows: int) -> tuple[subprocess.Popen, list[int]]:
    return spawn([sys.executable, "-m", "colo", "top"], d.env(), cols, rows)


def spawn(argv: list[str], env: dict, cols: int, rows: int) -> tuple[subprocess.Popen, list[int]]:
    """argv in a pseudo-terminal of cols x rows whose output is read and counted."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {**env, "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows)}
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    got = [0]

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            got[0] += len(data)

    threading.Thread(target=drain, daemon=True).start()
    return p, got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--size", default="160x50")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    rep = Report("top_cpu")
    cols, rows = map(int, a.size.split("x"))
    native.ensure_built()
    with tempfile.TemporaryDirectory(prefix="colo-top-bench-") as tmp:
        d = start_node(Path(tmp))
        top = None
        try:
            fill(d, Path(tmp))
            idle = window({"daemon": d.proc.pid}, a.seconds)
            base = None
            if shutil.which("top"):  # a peer baseline: procps top refreshing every 1 s in the same terminal
                ptop, pgot = spawn(["top", "-d", "1"], d.env(), cols, rows)
                wait_for(lambda: pgot[0] > 1000, 30, "top to draw")
                time.sleep(2)
                base = window({"top": ptop.pid}, a.seconds)["top"]
                rep.check(ptop.poll() is None, f"top exited ({ptop.returncode}) during its window")
                ptop.terminate()
                ptop.wait(10)
            top, got = spawn_top(d, cols, rows)
            wait_for(lambda: got[0] > 10_000, 30, "colo top to draw")
            time.sleep(3)  # start-up (imports, first layout) is not part of idle refreshing
            sent = got[0]
            served = window({"daemon": d.proc.pid, "top": top.pid}, a.seconds)
            out_rate = (got[0] - sent) / a.seconds
            # what was timed happened: top kept drawing, and the scene stayed as built
            rep.check(top.poll() is None, f"colo top exited ({top.returncode}) during its window")
            rep.check(got[0] - sent > 0, "colo top drew nothing during its window")
            st = {}
            for j in d.client.top()["jobs"]:
                st[j["state"]] = st.get(j["state"], 0) + 1
            rep.check(st == {"running": 24, "queued": 176}, f"the scene should be 24 running, 176 queued: {st}")
            rep.check(not (p := daemon_log_problems(d.log)), f"daemon log: {p[:3]}")
            rep.note(f"8 GPUs, 200 jobs (24 running, 176 waiting), terminal {cols}x{rows}, {a.seconds:.0f} s windows; "
                     f"colo top wrote {out_rate / 1024:.1f} KiB/s")
            rep.figure("top", "`colo top` (idle refresh, 1 s), % of a core", served["top"], "%", base,
                       "procps `top -d 1`, same terminal")
            rep.figure("daemon_serving", "daemon while serving `colo top`, % of a core", served["daemon"], "%",
                       idle["daemon"], "daemon without `colo top`",
                       f"~{10 * (served['daemon'] - idle['daemon']):.0f} ms CPU per 1 s poll")
        except BaseException:
            print(f"--- daemon log (tail) ---\n{d.log.read_text()[-3000:]}", file=sys.stderr)
            raise
        finally:
            if top is not None:
                top.terminate()
                top.wait(10)
            stop_node(d)
    return rep.finish(a.json_out)


if __name__ == "__main__":
    sys.exit(main())
