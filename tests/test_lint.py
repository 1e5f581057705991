"""The tree passes its own lint rules ([tool.ruff] in pyproject.toml): unused imports, names
redefined, f-strings without placeholders and the banned APIs fail here, not in review."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "colo", "tests", "bench"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
