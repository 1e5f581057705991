"""`colo submit` wall time beside the bare interpreter, from a regular (non-editable) install.

Times, interleaved round by round so that load on the machine hits all alike:
- `python -c pass` of the install's own interpreter (the floor: the interpreter's start-up);
- `colo submit --process --gpus 0 -- true`, the console script as users run it (its short path);
- the same submit through the full typer command (`python -m colo.cli submit ...`), for scale;
- the short path's start-up and imports alone (no round trip to the daemon).

An editable install (`pip install -e`) adds a .pth finder to every interpreter start, so the
bench makes its own venv and installs colo there the regular way (`--venv DIR` reuses one).
Every figure is refused unless each timed submit stored a job that then succeeded.

Run: python bench/cli_bench.py [-n 20] [--venv DIR] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from benchlib import Report, daemon_log_problems  # noqa: E402
from daemon_util import DaemonProc, wait_for  # noqa: E402

HEAVY = ("typer", "click", "rich", "textual", "numpy", "docker", "pynvml")


def venv_with_colo(path: Path) -> Path:
    py = path / "bin" / "python"
    if not (path / "bin" / "colo").exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", str(ROOT)], check=True)
    return py


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--venv", type=Path)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rep = Report("cli_bench")
    venv = args.venv or Path(tempfile.mkdtemp(prefix="colo-cli-bench-")) / "venv"
    py = venv_with_colo(venv)
    colo = str(venv / "bin" / "colo")
    editable = subprocess.run([str(py), "-c", "import colo, sys; print(colo.__file__)"], capture_output=True,
                              text=True, check=True, cwd="/tmp").stdout.strip()  # not the checkout's colo
    rep.check(editable.startswith(str(venv)), f"colo in the bench venv comes from {editable}, not the venv")
    rep.note(f"install: regular (non-editable) in {venv}")

    root = Path(tempfile.mkdtemp(prefix="colo-cli-bench-d-"))
    d = DaemonProc(root).start()  # no GPU needed: CPU-only jobs
    env = d.env()
    cmds = {
        "bare": [str(py), "-c", "pass"],
        "fast": [colo, "submit", "--process", "--gpus", "0", "--", "true"],
        "typer": [str(py), "-m", "colo.cli", "submit", "--process", "--gpus", "0", "--", "true"],
        "imports": [str(py), "-c", "import colo.entry, colo.submitspec, colo.client"],  # no daemon in it
    }
    times: dict[str, list[float]] = {k: [] for k in cmds}
    try:
        for _ in range(args.n):
            for k, cmd in cmds.items():
                t = time.perf_counter()
                r = subprocess.run(cmd, capture_output=True, env=env, cwd="/tmp")
                times[k].append(time.perf_counter() - t)
                rep.check(r.returncode == 0, f"{k}: exit {r.returncode}: {r.stderr[-300:]!r}")
        # what the short path imports (it must not load what only top, sim or the daemon need)
        probe = (f"import runpy, sys\nsys.argv = ['colo', 'submit', '--process', '--gpus', '0', '--', 'true']\n"
                 f"try:\n    runpy.run_path({colo!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
                 f"print('loaded:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))")
        out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, env=env, cwd="/tmp").stdout
        heavy = out.rsplit("loaded:", 1)[-1].strip() if "loaded:" in out else "?"
        rep.check(heavy == "", f"the submit short path imported {heavy or 'nothing'} of {HEAVY}")
        rep.note(f"modules of {', '.join(HEAVY)} the short path loaded: {heavy or 'none'}")
        want = 2 * args.n + 1
        jobs = wait_for(lambda: (js := d.client.ls(all=True)) and len(js) >= want and all(
            j["state"] in ("succeeded", "failed", "cancelled") for j in js) and js, 120, "the jobs to end")
        ok = sum(j["state"] == "succeeded" for j in jobs)
        rep.check(len(jobs) == want and ok == want, f"{len(jobs)} stored of {want}, {ok} succeeded")
    finally:
        d.stop()
    rep.check(not (p := daemon_log_problems(d.log)), f"daemon log: {p[:3]}")
    bare, fast, full, imports = (statistics.median(times[k]) for k in ("bare", "fast", "typer", "imports"))
    rep.figure("submit_wall", "`colo submit` (console script, short path)", fast, "s", bare,
               "`python -c pass`", f"median of {args.n}, interleaved")
    rep.figure("submit_typer_wall", "`colo submit` through the typer command", full, "s", bare,
               "`python -c pass`", f"median of {args.n}, interleaved")
    rep.figure("submit_imports", "start-up + imports of the short path (no daemon)", imports, "s", bare,
               "`python -c pass`", f"median of {args.n}, interleaved")
    rep.figure("short_vs_typer", "short path", fast, "s", full, "typer command", "same run")
    return rep.finish(args.json_out)


if __name__ == "__main__":
    sys.exit(main())
