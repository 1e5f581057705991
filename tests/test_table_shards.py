"""The interposer's pointer table is sharded (native/interpose/table.c): threads insert and
remove entries in many shards at once while a context's teardown scans them all. No entry may
be lost or taken twice: every byte the ledger counts must be one the simulated driver holds, and
every free must find its entry. Real threads on the simulated driver
(tests/native_helpers/table_shards.c)."""
from __future__ import annotations

import os
import subprocess

import pytest

from colo.node import interposer
from harness.interpose import build_native_helper

MiB = 1 << 20
BUDGET = 2048 * MiB  # the scans' contexts hold up to 16 x 62 MiB


@pytest.fixture(scope="module")
def shards_bin(native_dir, tmp_path_factory):
    return build_native_helper(native_dir, tmp_path_factory.mktemp("shards"), "table_shards")


def test_concurrent_inserts_removals_and_full_scans_lose_no_entry(shards_bin, fakegpu, tmp_path):
    ledger = tmp_path / "ledger"
    interposer.create_ledger(ledger, BUDGET)
    env = {**os.environ, **fakegpu.env, **interposer.job_env(BUDGET, str(ledger), str(interposer.library_path()))}
    # 8 threads x 64 live entries (every shard holds several and grows while scans run), 30
    # context teardowns each scanning all 64 shards.
    p = subprocess.Popen([str(shards_bin), "8", "12", "64", "30"], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("held "), p.communicate(timeout=60)
        held = int(line.split()[1])
        assert held == 8 * 64 * 64 * 1024
        # The scans took exactly their contexts' entries: what is counted is what the threads kept.
        assert interposer.read_ledger(ledger).counted[0] == held
        assert fakegpu.read()["devices"][0]["used"] == held
        out, err = p.communicate("free\n", timeout=120)
        assert (p.returncode, out) == (0, "done\n"), err
    finally:
        p.kill()
    # Every kept allocation's free found its entry and gave its bytes back.
    led = interposer.read_ledger(ledger)
    assert led.counted[0] == 0 and led.refused == 0
    assert fakegpu.read()["devices"][0]["used"] == 0
