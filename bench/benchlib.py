"""What every colo benchmark shares: the conditions of the run, checks that the timed work really
happened, and figures printed (and optionally saved as JSON) only when every check passed.

    rep = Report("daemon_bench")
    rep.check(n_failed == 0, f"{n_failed} jobs failed to start")    # the work happened as intended
    rep.figure("submit", "colo submit wall time", 0.17, "s", baseline=0.02, baseline_what="python3 -c pass")
    rep.finish(args.json_out)     # refuses (exit 1, no figures) if a check failed

bench/readme_table.py builds the README's "Measured" table from the saved JSON files.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def install_kind() -> str:
    """"editable" or "regular" for the colo this interpreter imports ("checkout" when it is not
    installed at all). An editable install slows every interpreter start (its .pth finder), the
    bare-python baseline included, so a ratio against that baseline depends on it."""
    from importlib import metadata

    try:
        dist = metadata.distribution("colo")
    except metadata.PackageNotFoundError:
        return "checkout"
    raw = dist.read_text("direct_url.json")
    if raw:
        try:
            if json.loads(raw).get("dir_info", {}).get("editable"):
                return "editable"
        except ValueError:
            pass
    return "regular"


def loadavg() -> tuple[float, float, float]:
    return os.getloadavg()


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _mem_gib() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


CODE = ["colo", "native", "pyproject.toml", "setup.py"]  # what a bench measures; bench/ itself is not


def commit() -> str:
    """The last commit that changed colo's code (not bench/ or docs), "+changes" if it is edited."""
    try:
        r = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h", "--", *CODE], capture_output=True,
                           text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--", *CODE],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return r.stdout.strip() + ("+changes" if dirty else "") if r.returncode == 0 else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def conditions() -> dict:
    """The machine and the moment: printed with every figure, stored with it."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPUs ({_cpu_model()}), {_mem_gib():.0f} GiB, {platform.system()} "
                   f"{platform.release()}",
        "python": platform.python_version(),
        "install": install_kind(),
        "commit": commit(),
        "loadavg_start": [round(x, 2) for x in loadavg()],
    }


@dataclass
class Figure:
    key: str
    what: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_what: str = ""
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        return self.value / self.baseline


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        if v < 0.001:
            return f"{v * 1e6:.0f} µs"
        return f"{v * 1000:.1f} ms" if v < 10 else f"{v:.1f} s"
    if unit == "ms":
        return f"{v:.1f} ms"
    if unit == "B":
        return f"{v / 2**20:.1f} MiB"
    if unit == "%":
        return f"{v:.2f} %"
    if unit in ("/s", "x"):
        return f"{v:,.0f}{unit}" if v >= 100 else f"{v:.2f}{unit}"
    if unit == "ns":
        return f"{v:.1f} ns"
    return f"{v:g} {unit}".strip()


@dataclass
class Report:
    bench: str
    command: str = ""
    conditions: dict = field(default_factory=conditions)
    figures: list[Figure] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.command:
            args = list(sys.argv[1:])
            if "--json-out" in args:  # where the figures were saved is not part of how they were made
                i = args.index("--json-out")
                del args[i:i + 2]
            self.command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *args])

    def check(self, ok: bool, failure: str) -> bool:
        """Record a failed check (the work timed did not happen as intended); figures then are refused."""
        if not ok:
            self.failures.append(failure)
            print(f"CHECK FAILED: {failure}", file=sys.stderr)
        return ok

    def figure(self, key: str, what: str, value: float, unit: str, baseline: float | None = None,
               baseline_what: str = "", note: str = "") -> Figure:
        f = Figure(key, what, float(value), unit, None if baseline is None else float(baseline), baseline_what, note)
        self.figures.append(f)
        return f

    def note(self, text: str) -> None:
        self.notes.append(text)

    def get(self, key: str) -> Figure | None:
        return next((f for f in self.figures if f.key == key), None)

    def to_dict(self) -> dict:
        c = dict(self.conditions)
        c["loadavg_end"] = [round(x, 2) for x in loadavg()]
        return {"bench": self.bench, "command": self.command, "conditions": c,
                "figures": [{**asdict(f), "ratio": f.ratio} for f in self.figures],
                "failures": self.failures, "notes": self.notes, "extra": self.extra}

    def finish(self, json_out: Path | str | None = None) -> int:
        """Print the figures beside their baselines with the run's conditions, or refuse to."""
        d = self.to_dict()
        c = d["conditions"]
        la0, la1 = c["loadavg_start"], c["loadavg_end"]
        print(f"# {self.bench}: {c['date']}, {c['machine']}, Python {c['python']}, colo {c['install']} "
              f"install at {c['commit']}")
        print(f"# load average {la0[0]:.2f} at the start, {la1[0]:.2f} at the end")
        if self.failures:
            print(f"# REFUSED: {len(self.failures)} check(s) failed, the timed work did not happen as "
                  "intended; no figures printed:", file=sys.stderr)
            for f in self.failures:
                print(f"#   {f}", file=sys.stderr)
            if json_out:
                Path(json_out).write_text(json.dumps({**d, "figures": []}, indent=1) + "\n")
            return 1
        w = max([len(f.what) for f in self.figures] + [10])
        print(f"{'what':<{w}}  {'figure':>12}  {'baseline':>12}  {'ratio':>7}  baseline is")
        for f in self.figures:
            r = f"{f.ratio:.2f}x" if f.ratio is not None else "-"
            print(f"{f.what:<{w}}  {fmt(f.value, f.unit):>12}  {fmt(f.baseline, f.unit):>12}  {r:>7}  "
                  f"{f.baseline_what}{'  (' + f.note + ')' if f.note else ''}")
        for n in self.notes:
            print(f"# {n}")
        if json_out:
            Path(json_out).write_text(json.dumps(d, indent=1) + "\n")
        return 0


def daemon_log_problems(log: Path) -> list[str]:
    """Lines of a daemon log that say something went wrong (tracebacks, errors, failed starts)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    bad = re.compile(r"Traceback|\bERROR\b|failed to start|EACCES|Permission denied")
    return [line.strip()[:200] for line in text.splitlines() if bad.search(line)]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def record(argv: list[str]) -> int:
    """`python bench/benchlib.py record NAME [--out FILE] -- CMD...`: run a bench that only prints text
    (interposer_bench, sim_bench) and save its output with the run's conditions, for readme_table.py."""
    import argparse

    if "--" not in argv:
        print("usage: benchlib.py record NAME [--out FILE] -- CMD...", file=sys.stderr)
        return 2
    i = argv.index("--")
    ap = argparse.ArgumentParser(prog="benchlib.py record")
    ap.add_argument("name")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv[:i])
    cmd = argv[i + 1:]
    c = conditions()
    r = subprocess.run(cmd, capture_output=True, text=True)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    c["loadavg_end"] = [round(x, 2) for x in loadavg()]
    shown = ["python" if Path(x).name.startswith("python") else x for x in cmd]
    d = {"bench": a.name, "command": " ".join(shown), "conditions": c, "figures": [], "stdout": r.stdout,
         "failures": [] if r.returncode == 0 else [f"exit {r.returncode}: {r.stderr.strip()[-300:]}"]}
    out = a.out or ROOT / "bench" / "results" / f"{a.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(d, indent=1) + "\n")
    return r.returncode


def compiled(argv: list[str]) -> bool:
    """Whether `colo` is the compiled client (native/client/colo.c: its command server for `ls`)."""
    try:
        with open(argv[0], "rb") as f:
            return len(argv) == 1 and f.read(4) == b"\x7fELF"
    except OSError:
        return False


def fast_server(argv: list[str], env: dict) -> int | None:
    """The pid of the command server that `colo ls` of this install (argv) reaches: a first call
    starts it (docs/fastcli.md); wait until it answers at its socket, so the rounds time the fast path."""
    import glob
    import socket
    import struct

    import checkout

    checkout.use_harness()
    from harness.daemon import wait_for

    subprocess.run([*argv, "ls", "-q", "-s", "running"], env=env, capture_output=True, timeout=120)
    where = os.path.dirname(argv[0]).encode()
    dirs = [f"{env['XDG_RUNTIME_DIR']}/colo-fast"] if env.get("XDG_RUNTIME_DIR") else []
    dirs.append(f"/tmp/colo-fast-{os.getuid()}")

    def answering() -> int | None:
        for path in (p for d in dirs for p in glob.glob(f"{d}/*.sock")):
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path)
                pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if where in f.read():
                        return pid
            except OSError:
                continue
            finally:
                s.close()
        return None

    try:
        return wait_for(answering, 60, "colo's command server")
    except AssertionError:
        return None


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"]:
        sys.exit(record(sys.argv[2:]))
    print(__doc__)
