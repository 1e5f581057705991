"""Every command that talks to the daemon, beside the bare interpreter, from a regular install.

Times, interleaved round by round so that load on the machine hits all alike:
- `python -c pass` of the install's own interpreter (the floor: the interpreter's start-up; the
  aim is every command within 1.5x of it);
- the console script as users run it (each command's short path, colo/cli/entry.py): submit, ls,
  show, explain, logs, history, gpus, cancel, wait, top --once, and a completion key press
  (`colo show <TAB>` in bash: what the shell runs);
- the same submit and `ls` by the Python path (`colo-py`, what the compiled `colo` runs when its
  command server is off: docs/fastcli.md), and submit through the full typer command (`python -m
  colo.cli.app submit ...`), for scale; the compiled client's command server is started and awaited
  before the rounds, and must be the same one after them;
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
import checkout  # noqa: E402
checkout.use_harness()

from benchlib import Report, compiled, daemon_log_problems, fast_server  # noqa: E402
from harness.daemon import DaemonProc, wait_for  # noqa: E402

from colo.node import fakegpu  # noqa: E402

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
    colo = str(venv / "bin" / "colo")  # the compiled client (native/client/colo.c; docs/fastcli.md)
    script = str(venv / "bin" / "colo-py")  # the Python script it runs for everything not hot
    editable = subprocess.run([str(py), "-c", "import colo, sys; print(colo.__file__)"], capture_output=True,
                              text=True, check=True, cwd="/tmp").stdout.strip()  # not the checkout's colo
    rep.check(editable.startswith(str(venv)), f"colo in the bench venv comes from {editable}, not the venv")
    rep.note(f"install: regular (non-editable) in {venv}")
    rep.conditions["install"] = "regular"  # what was timed: the bench venv's colo, not this interpreter's

    root = Path(tempfile.mkdtemp(prefix="colo-cli-bench-d-"))
    fakegpu.create(root / "gpus", count=2, mem=16 << 30)
    d = DaemonProc(root, root / "gpus").start()
    env = d.env()
    c = d.client
    ended = c.submit({"argv": ["sh", "-c", "echo hello"], "gpus": 0, "workdir": "/tmp", "name": "ended"})["id"]
    gate = root / "go"
    running = c.submit({"argv": ["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.1; done"], "gpus": 1,
                        "gpu_mem": 1 << 30, "workdir": "/tmp", "name": "running"})["id"]
    d.wait_state(ended, "succeeded")
    d.wait_state(running, "running")
    cmds = {
        "bare": [str(py), "-c", "pass"],
        "fast": [colo, "submit", "--process", "--gpus", "0", "--", "true"],
        "ls": [colo, "ls"],
        "show": [colo, "show", str(ended)],
        "explain": [colo, "explain", str(ended)],
        "logs": [colo, "logs", str(ended)],
        "history": [colo, "history"],
        "gpus": [colo, "gpus"],
        "top": [colo, "top", "--once"],
        "wait": [colo, "wait", str(ended)],
        "cancel": [colo, "cancel"],  # + a queued job made for each round
        "complete": [colo],
        "py_submit": [script, "submit", "--process", "--gpus", "0", "--", "true"],  # the Python path
        "py_ls": [script, "ls"],
        "typer": [str(py), "-m", "colo.cli.app", "submit", "--process", "--gpus", "0", "--", "true"],
        "imports": [str(py), "-c", "import colo.cli.entry, colo.cli.submitspec, colo.client"],  # no daemon in it
    }
    tab = {**env, "_COLO_COMPLETE": "complete_bash", "COMP_WORDS": "colo show ", "COMP_CWORD": "2"}
    times: dict[str, list[float]] = {k: [] for k in cmds}
    cancelled = []
    server = None
    try:
        if compiled([colo]):  # its command server started and answering, so the rounds time the fast path
            server = fast_server([colo], env)
            rep.check(server is not None, "colo's command server did not answer")
        else:
            rep.note("bin/colo is not the compiled client: the fast rows time the Python script")
        for _ in range(args.n):
            for k, cmd in cmds.items():
                if k == "cancel":
                    cancelled.append(c.submit({"argv": ["true"], "gpus": 0, "workdir": "/tmp", "after": [running]})["id"])
                    cmd = [*cmd, str(cancelled[-1])]
                t = time.perf_counter()
                r = subprocess.run(cmd, capture_output=True, env=tab if k == "complete" else env, cwd="/tmp")
                times[k].append(time.perf_counter() - t)
                rep.check(r.returncode == 0, f"{k}: exit {r.returncode}: {r.stderr[-300:]!r}")
                if k == "complete":
                    rep.check({str(running).encode(), b"running"} <= set(r.stdout.split()),
                              f"completion offered {r.stdout[:200]!r}, not the running job")
        # what the short path imports (it must not load what only top, sim or the daemon need):
        # every module the console script loads, as -X importtime lists them
        r = subprocess.run([str(py), "-X", "importtime", script, "submit", "--process", "--gpus", "0", "--", "true"],
                           capture_output=True, text=True, env=env, cwd="/tmp")
        rep.check(r.returncode == 0, f"importtime submit: exit {r.returncode}")
        loaded = {ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
        heavy = [m for m in HEAVY if m in loaded]
        rep.check(not heavy, f"the submit short path imported {heavy} of {HEAVY}")
        # pip's console-script wrapper imports re itself (to tidy argv[0]): not colo's to drop
        wrapper_re = "\nimport re\n" in Path(script).read_text()
        light = [m for m in LIGHT if m in loaded and not (m in ("re", "enum") and wrapper_re)]
        rep.check(not light, f"the submit short path imported {light} of {LIGHT}")
        rep.note(f"modules of {', '.join(HEAVY + LIGHT)} the short path loaded: "
                 f"{', '.join(m for m in HEAVY + LIGHT if m in loaded) or 'none'}"
                 + (" (re and enum: by pip's console-script wrapper)" if wrapper_re else ""))
        if server is not None:
            rep.check(fast_server([colo], env) == server, "colo's command server changed during the rounds")
        want = 3 * args.n + 1
        rep.check(all(c.show(i)["state"] == "cancelled" for i in cancelled), "a timed cancel did not cancel")
        gate.touch()
        jobs = wait_for(lambda: (js := [j for j in d.client.ls(all=True) if j["id"] not in cancelled
                                        and j["id"] != running])
                        and len(js) >= want + 1 and all(j["state"] in ("succeeded", "failed", "cancelled")
                                                        for j in js) and js, 120, "the jobs to end")
        ok = sum(j["state"] == "succeeded" for j in jobs)
        rep.check(len(jobs) == want + 1 and ok == want + 1, f"{len(jobs)} stored of {want + 1}, {ok} succeeded")
    finally:
        gate.touch()
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
    for k, what in (("submit", "py_submit"), ("ls", "py_ls")):
        rep.figure(f"{k}_python_path_wall", f"`colo {k}` by the Python path (colo-py)", statistics.median(times[what]),
                   "s", bare, "`python -c pass`", f"median of {args.n}, interleaved")
    if server is not None:
        rep.figure("submit_fast_vs_python_path", "`colo submit` (its command server)", fast, "s",
                   statistics.median(times["py_submit"]), "the Python path (colo-py)", "same run")
    for k, what in (("ls", "`colo ls` (2 jobs)"), ("show", "`colo show`"), ("explain", "`colo explain`"),
                    ("logs", "`colo logs`"), ("history", "`colo history`"), ("gpus", "`colo gpus`"),
                    ("top", "`colo top --once`"), ("wait", "`colo wait` (an ended job)"),
                    ("cancel", "`colo cancel` (a queued job)"),
                    ("complete", "a completion key press (`colo show <TAB>`, bash)")):
        rep.figure(f"{k}_wall", what, statistics.median(times[k]), "s", bare, "`python -c pass`",
                   f"median of {args.n}, interleaved; aim 1.5x")
    return rep.finish(args.json_out)


if __name__ == "__main__":
    sys.exit(main())
