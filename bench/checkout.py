"""What a bench imports from this checkout outside bench/: the one place in bench/ that touches
sys.path (tests/test_layout.py refuses it anywhere else in bench/).

    import checkout
    checkout.use_harness()                 # then: from harness.daemon import DaemonProc
    checkout.use_colo()                    # colo from this checkout, whatever is installed

A bench is a script, started as `python bench/NAME.py` (the command lines README.md and docs/
give), so Python puts bench/ first on its path and a bench imports benchlib, this module or
another bench by name. tests/harness/ (a real daemon in a folder, real users, probes) is shared by
the tests and the benches alike; pytest puts tests/ on a test's path (tests/ is no package), and
use_harness() puts it on a bench's, so `harness` is the same import in both. Decided against:
making bench/ a package run as `python -m bench.NAME` (every documented command line would
change), and a bench/harness link to tests/harness (two paths to one module, and a link is not
seen in a diff).
"""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def use_harness() -> None:
    """tests/ on the path, for tests/harness/ (and tests/slurm_util.py)."""
    sys.path.insert(0, str(ROOT / "tests"))


def use_colo(root: str | Path | None = None) -> None:
    """This checkout (or the one at `root`: a policy before and after, side by side) first on the
    path: colo as it is there, whatever is installed (a lent GPU machine cannot install it; a bench
    of the simulator or the interposer measures that tree)."""
    sys.path.insert(0, str(root or ROOT))
