"""The README's "Measured" table, built from what the benches saved, never typed by hand.

    python bench/<name>.py ... --json-out bench/results/<name>.json     # each bench, as listed below
    python bench/benchlib.py record NAME -- python bench/NAME.py ...     # benches that only print text
    python bench/readme_table.py [bench/results] [--write README.md]

Each row: the figure beside its baseline from the same run, the ratio, the load average during
that run and the install kind (editable or regular) of the colo that ran it; the heading says
the machine and the dates. --write replaces the README's "## Measured" section.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

from benchlib import fmt  # noqa: E402

# which figures of each bench go into the README, in this order (None: all of them)
ORDER = ["container_start", "daemon_bench", "fill_bench", "queue_bench", "idle_bench", "history_bench", "clean_bench", "load_bench", "crash_trials", "peers_bench", "interposer_bench",
         "top_cpu"]
PICK = {
    "container_start": ["submit_running"],
    "daemon_bench": ["submit_wall", "ls", "pass_steady", "pass_new", "rss"],
    "load_bench": ["submit_p50", "submit_rate"],
    "top_cpu": ["top", "daemon_serving"],
    "peers_bench": ["submit_vs_slurm", "ls_vs_slurm", "big_ls_vs_slurm", "big_part_py", "big_part_imports",
                    "big_part_python_path", "big_ls_vs_python_path", "big_moved_vs_slurm", "big_all_vs_slurm", "big_ls_vs_before", "big_moved_vs_before",
                    "big_all_vs_before"],
    "clean_bench": ["clean_wall", "clean_max", "purge_wall", "purge_max"],
    "interposer_bench": ["pair_cpu_stub_1p_1t", "pair_cpu_stub_1p_8t", "pair_cpu_stub_4p_1t", "pair_cpu_stub_4p_8t",
                         "pair_user_1p_1t", "pair_user_1p_8t", "pair_user_4p_1t", "pair_user_4p_8t",
                         "pair_1p_1t", "unmap_100", "unmap_2000", "unmap_16000", "race_over"],
}


def pick(d: dict) -> list[dict]:
    figs = d["figures"]
    keys = PICK.get(d["bench"])
    if d["bench"] == "fill_bench":  # the first and the last block, and ls on the full queue
        rates = [f for f in figs if f["key"].startswith("rate_")]
        cpus = [f for f in figs if f["key"].startswith("cpu_")]
        return [*rates[-1:], *cpus[-1:], *[f for f in figs if f["key"] == "ls_full"]]
    return figs if keys is None else [f for k in keys for f in figs if f["key"] == k]


def interposer_rows(d: dict) -> list[dict]:
    """Figures from interposer_bench's printed table: procs threads direct interposed added ratio."""
    out = []
    for line in d.get("stdout", "").splitlines():
        w = line.split()
        if len(w) == 6 and w[0].isdigit() and w[1].isdigit():
            procs, threads = int(w[0]), int(w[1])
            out.append({"key": f"pair_{procs}p_{threads}t", "what": f"interposer, alloc+free pair, {procs} process(es) x "
                        f"{threads} thread(s), simulated driver", "value": float(w[3]), "unit": "ns",
                        "baseline": float(w[2]), "baseline_what": "the same pair without the interposer",
                        "ratio": float(w[3]) / float(w[2]), "note": ""})
    return out


def load(folder: Path) -> list[dict]:
    runs = []
    for p in sorted(folder.glob("*.json")):
        d = json.loads(p.read_text())
        if d.get("failures"):
            continue  # a refused run has no figures to show
        if d["bench"] == "interposer_bench" and not d.get("figures"):
            d["figures"] = interposer_rows(d)  # an older, text-only run
        runs.append(d)
    return sorted(runs, key=lambda d: ORDER.index(d["bench"]) if d["bench"] in ORDER else len(ORDER))


def table(runs: list[dict]) -> str:
    machines = sorted({d["conditions"]["machine"] for d in runs})
    dates = sorted(d["conditions"]["date"] for d in runs)
    lines = [f"Measured on {'; '.join(machines)}, no GPU, runs started {dates[0]} to {dates[-1]}, colo's code at "
             f"{', '.join(sorted({d['conditions']['commit'] for d in runs}))}. The machine is shared by several "
             "sessions and was loaded (load average beside each figure, over 2 CPUs): read ratios, not absolute "
             "times. Each command saves its figures with `--json-out bench/results/NAME.json` (a bench that only "
             "prints text, through `python bench/benchlib.py record NAME -- CMD`); "
             "`python bench/readme_table.py --write README.md` rebuilds this table from them.", "",
             "| what | colo | baseline (same run) | ratio | load avg | install | command |", "|---|---|---|---|---|---|---|"]
    for d in runs:
        c = d["conditions"]
        load = f"{c['loadavg_start'][0]:.1f}-{c['loadavg_end'][0]:.1f}"
        for f in pick(d):
            ratio = f"{f['ratio']:.2f}x" if f.get("ratio") is not None else "-"
            base = f"{fmt(f.get('baseline'), f['unit'])} {f.get('baseline_what', '')}".strip()
            lines.append(f"| {f['what']} | {fmt(f['value'], f['unit'])} | {base} | {ratio} | {load} | {c['install']} "
                         f"| `{d['command']}` |")
    return "\n".join(lines) + "\n"


def write(readme: Path, text: str) -> None:
    s = readme.read_text()
    m = re.search(r"^## Measured.*?\n(?=^## )", s, flags=re.S | re.M)
    if not m:
        raise SystemExit(f"{readme}: no '## Measured' section followed by another section")
    s = s[:m.start()] + "## Measured (no GPU; commands in bench/)\n\n" + text + "\n" + s[m.end():]
    readme.write_text(s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, nargs="?", default=HERE / "results")
    ap.add_argument("--write", type=Path, help="replace this README's Measured section")
    a = ap.parse_args()
    runs = load(a.folder)
    if not runs:
        print(f"no bench results in {a.folder}", file=sys.stderr)
        return 1
    text = table(runs)
    if a.write:
        write(a.write, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
