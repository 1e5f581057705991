"""Write the five shipped 30-job mixes (docs/invariants.md "Figures from the studies") with a fixed seed.

Run `python workloads/make_mixes.py` after changing the shipped profiles; same seed, same files.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from colo.sched import sim  # noqa: E402

SEED = 7


def main(dest: Path = Path(__file__).resolve().parent) -> None:
    for kind in sim.MIXES:
        w = sim.make_mix(kind, SEED)
        (dest / f"{kind}.workload").write_text(sim.dumps_workload(w))
        print(f"{kind:13s} {len(w.jobs)} jobs")


if __name__ == "__main__":
    main()
