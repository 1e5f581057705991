"""What storing the daemon's learning costs (issue 13), beside what the same job already pays, in
one run, on a real SQLite database (WAL, as the daemon opens it):
- per start: the neighbour rows a start writes (prune + insert, 3 running neighbours) beside
  the start's own state change (queued -> starting); and the two in one transaction (as the
  daemon stores them: Store.transition's `neighbours`) beside the same in two, jobs alternating;
- per end: the learning one end stores (a co-run pairing, the profile's alone error and memory,
  one prediction error appended, the newest 200 kept) and the neighbours read back, beside the
  end's own state change;
- at daemon start: reading back the most one user may keep (2,000 pairings, 2,000 profiles, 200
  errors) for 10 users, beside opening the database.
Each figure is the median of its repetitions; the checks refuse figures when the rows did not
land as intended.

Run: python bench/learn_bench.py [--n 300] [--json-out bench/results/learn_bench.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import Report

from colo.jobs import TERMINAL, JobSpec, State  # noqa: E402
from colo.store import Store  # noqa: E402


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300, help="jobs started and ended")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    rep = Report("learn_bench")
    with tempfile.TemporaryDirectory() as tmp:
        st = Store(Path(tmp) / "colo.db")
        spec = JobSpec(argv=["true"], gpu_mem=1 << 30)
        ids = [st.add_job(spec, 1000, 1000, "u").id for _ in range(a.n)]
        t_start, t_nb, t_two, t_one, t_end, t_learn = [], [], [], [], [], []
        errors = [1.0 + i / 1000 for i in range(200)]
        for i, j in enumerate(ids):
            others = ids[max(0, i - 3):i]
            pairs = [(j, "p") for _ in others] + [(o, "p") for o in others]
            if i % 2:  # one transaction
                t0 = time.perf_counter()
                st.transition(j, State.STARTING, "start", gpus=["GPU-a"], neighbours=(pairs, 32))
                t_one.append(time.perf_counter() - t0)
                continue
            t0 = time.perf_counter()
            st.transition(j, State.STARTING, "start", gpus=["GPU-a"])
            t1 = time.perf_counter()
            st.prune_neighbours(TERMINAL)
            st.add_neighbours(pairs, 32, fresh=j)
            t2 = time.perf_counter()
            t_start.append(t1 - t0)
            t_nb.append(t2 - t1)
            t_two.append(t2 - t0)
        for j in ids:
            st.transition(j, State.RUNNING, "running")
        for j in ids:
            t0 = time.perf_counter()
            st.transition(j, State.SUCCEEDED, "exited with code 0", exit_code=0)
            t1 = time.perf_counter()
            st.take_neighbours(j)
            st.save_learned(1000, corun={(f"p{j % 50}", "q", "mps"): (j, 1.2)}, alone={f"p{j % 50}": (j, 1.1)},
                            max_mem={f"p{j % 50}": j << 20}, errors_add=[1.0 + j / 1000], errors_keep=200)
            t2 = time.perf_counter()
            t_end.append(t1 - t0)
            t_learn.append(t2 - t1)
        rep.check(st.db.execute("SELECT count(*) FROM job_neighbours").fetchone()[0] == 0,
                  "neighbour rows left after every end")
        got = st.learned().get(1000, {})
        rep.check(len(got.get("corun", {})) == 50 and len(got.get("errors", [])) == 200, "learning rows not stored")
        st.close()

        big = Path(tmp) / "big.db"
        st = Store(big)
        for uid in range(10):
            st.save_learned(uid, corun={(f"p{k}", f"q{k % 7}", "mps"): (3, 1.1) for k in range(2000)},
                            alone={f"p{k}": (2, 1.05) for k in range(2000)},
                            max_mem={f"p{k}": k << 20 for k in range(2000)}, errors=errors)
        st.close()
        t_open, t_load = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            st = Store(big)
            t1 = time.perf_counter()
            got = st.learned()
            t2 = time.perf_counter()
            st.close()
            t_open.append(t1 - t0)
            t_load.append(t2 - t1)
        rep.check(len(got) == 10 and all(len(v["corun"]) == 2000 and len(v["alone"]) == 2000 for v in got.values()),
                  "learning read back incomplete")
    rep.figure("start", "neighbour rows written at a start", med(t_nb), "s", med(t_start),
               "the start's state change (queued -> starting)")
    rep.figure("start_one_tx", "a start with its neighbour rows, one transaction", med(t_one), "s", med(t_two),
               "the same in two transactions (the state change, then the rows)")
    rep.figure("end", "learning stored at an end", med(t_learn), "s", med(t_end),
               "the end's state change (running -> succeeded)")
    rep.figure("load", "learning read back at daemon start (10 users, 2,000+2,000 each)", med(t_load), "s",
               med(t_open), "opening the database (quick_check, migrations)")
    return rep.finish(a.json_out)


if __name__ == "__main__":
    sys.exit(main())
