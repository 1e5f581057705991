"""Memory pools that grow by more than an allocation (the driver's chunk), against the simulated
driver (COLO_FAKEGPU_POOL_CHUNK), from the C caller (tests/native_helpers/interpose_probe.c)."""
from __future__ import annotations

import pytest

from colo.node import interposer
from harness.interpose import JOB_BUDGET as BUDGET
from harness.interpose import MiB, codes, info, run


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


def counts(lines):
    """(synchronisations, trims) the process asked the simulated driver for, at each `counts`."""
    return [tuple(map(int, x.split()[2:4])) for x in lines if x.startswith("counts")]


def test_a_pool_at_the_edge_serves_allocations_from_its_reserve_without_syncing_or_trimming(probe, job):
    env, ledger = job
    # A training loop sized from its profile: a working set of 70 % of the budget, then 50 steps
    # that each take 20 % and give it back, on a pool keeping 90 % (the release threshold
    # PyTorch's cudaMallocAsync, TensorFlow and CuPy set). The true peak is 90 %: the pool serves
    # each step from its reserve, which is counted already, so no step needs more.
    ws, step, keep = (str(BUDGET * pct // 100) for pct in (70, 20, 90))
    lines, err = run(probe, env, "init", "streamnew", "threshold", keep, "async", ws,
                     "poolloop", "50", step, "0", "counts", "poolloop", "50", step, "1", "counts", "info")
    peak = int(ws) + int(step)
    assert [x.split()[1:] for x in lines if x.startswith("poolloop")] == [["0", "0", str(peak)]] * 2
    assert counts(lines) == [(0, 0), (50, 0)]  # only the loop's own synchronisations
    assert info(lines) == [(BUDGET - peak, BUDGET)] and "refused" not in err


def test_memory_kept_by_a_hundred_pools_is_all_counted(probe, job):
    env, ledger = job
    # 100 pools that each keep 1 MiB idle (release threshold: everything): 100 MiB against a 64
    # MiB budget. Every pool's reserve is counted, so the pools are trimmed at the edge and a
    # 60 MiB allocation afterwards fits without the driver ever holding more than the budget.
    lines, err = run(probe, env, "init", "streamnew", "pools", "100", "1M", "alloc", "60M", "rawused", "info")
    made, most = lines[2].split()[2:]
    assert lines[2].split()[1] == "0" and made == "100" and int(most) <= BUDGET
    assert codes(lines, "alloc") == [0] and int(lines[4].split()[2]) <= BUDGET
    free, _ = info(lines)[0]
    assert BUDGET - free == int(lines[4].split()[2])  # what is counted is what the driver holds


def test_children_forked_during_pool_traffic_never_hang(probe, job):
    env, ledger = job
    # Two threads allocate, free and synchronise on pools while the main thread forks 30 times;
    # each child makes a pool allocation of its own. A child must not inherit a pool lock that a
    # parent thread held at the fork.
    lines, _ = run(probe, env, "init", "forkstorm", "30", timeout=600)
    assert lines[1] == "forkstorm 0 0 30"  # none hung, all 30 exited 0
