"""`colo submit` wall time beside the bare interpreter, from a regular (non-editable) install.

Times, interleaved round by round so that load on the machine hits all alike:
- `python -c pass` of the install's own interpreter (the floor: the interpreter's start-up);
- `colo submit --process --gpus 0 -- true`, the console script as users run it (its short path);
- the same submit through the full typer command (`python -m colo.cli.app submit ...`), for scale;
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
# the standard library's slower modules, which the short path does without (colo/client.py)
LIGHT = ("json", "re", "pathlib", "typing", "socket", "enum", "unicodedata")


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
    rep.conditions["install"] = "regular"  # what was timed: the bench venv's colo, not this interpreter's

    root = Path(tempfile.mkdtemp(prefix="colo-cli-bench-d-"))
    d = DaemonProc(root).start()  # no GPU needed: CPU-only jobs
    env = d.env()
    cmds = {
        "bare": [str(py), "-c", "pass"],
        "fast": [colo, "submit", "--process", "--gpus", "0", "--", "true"],
        "typer": [str(py), "-m", "colo.cli.app", "submit", "--process", "--gpus", "0", "--", "true"],
        "imports": [str(py), "-c", "import colo.cli.entry, colo.cli.submitspec, colo.client"],  # no daemon in it
    }
    times: dict[str, list[float]] = {k: [] for k in cmds}
    try:
        for _ in range(args.n):
            for k, cmd in cmds.items():
                t = time.perf_counter()
                r = subprocess.run(cmd, capture_output=True, env=env, cwd="/tmp")
                times[k].append(time.perf_counter() - t)
                rep.check(r.returncode == 0, f"{k}: exit {r.returncode}: {r.stderr[-300:]!r}")
        # what the short path imports (it must not load what only top, sim or the daemon need):
        # every module the console script loads, as -X importtime lists them
        r = subprocess.run([str(py), "-X", "importtime", colo, "submit", "--process", "--gpus", "0", "--", "true"],
                           capture_output=True, text=True, env=env, cwd="/tmp")
        rep.check(r.returncode == 0, f"importtime submit: exit {r.returncode}")
        loaded = {ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
        heavy = [m for m in HEAVY if m in loaded]
        rep.check(not heavy, f"the submit short path imported {heavy} of {HEAVY}")
        # pip's console-script wrapper imports re itself (to tidy argv[0]): not colo's to drop
        wrapper_re = "\nimport re\n" in Path(colo).read_text()
        light = [m for m in LIGHT if m in loaded and not (m in ("re", "enum") and wrapper_re)]
        rep.check(not light, f"the submit short path imported {light} of {LIGHT}")
        rep.note(f"modules of {', '.join(HEAVY + LIGHT)} the short path loaded: "
                 f"{', '.join(m for m in HEAVY + LIGHT if m in loaded) or 'none'}"
                 + (" (re and enum: by pip's console-script wrapper)" if wrapper_re else ""))
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
