"""Memory pools that grow by more than an allocation (the driver's chunk), against the simulated
driver (COLO_FAKEGPU_POOL_CHUNK), from the C caller (tests/native_helpers/interpose_probe.c)."""
from __future__ import annotations

import pytest

from colo.node import interposer
from test_interposer import BUDGET, MiB, codes, info, run


@pytest.mark.parametrize("via,extra", [("direct", []), ("gpa", ["--ver", "12080", "--ptds"])])
def test_a_pool_is_counted_by_its_chunks_and_never_grows_past_the_budget(probe, job, via, extra):
    env, ledger = job
    env = {**env, "COLO_FAKEGPU_POOL_CHUNK": str(32 * MiB)}
    # 1 MiB from the default pool takes a whole 32 MiB chunk: that is what the driver holds, and
    # what is counted. With 40 MiB held, 1 MiB more fits the budget as asked (41 MiB), but the pool
    # would grow by a chunk (72 MiB): the allocation is undone and refused.
    lines, err = run(probe, env, "init", "streamnew", "async", "1M", "info", "rawused", "freeall", "ctxsync",
                     "alloc", "40M", "async", "1M", "rawused", "info", "freeall", "ctxsync", "info", "rawused",
                     via=via, extra=extra)
    assert codes(lines, "async") == [0, 2]
    assert info(lines) == [(BUDGET - 32 * MiB, BUDGET), (BUDGET - 40 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [32 * MiB, 40 * MiB, 0]
    assert err.count("refused") == 1 and interposer.read_ledger(ledger).refused == 1
    assert interposer.read_ledger(ledger).counted[0] == 0
