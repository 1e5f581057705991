"""Graph memory through every entry point that builds, instantiates, updates, uploads or launches a
graph, against the simulated driver, from the C caller (tests/native_helpers/interpose_probe.c)."""
from __future__ import annotations

import pytest

from colo.node import interposer
from harness.interpose import JOB_BUDGET as BUDGET
from harness.interpose import MiB, codes, info, run

LOOKUPS = [("direct", []), ("dlsym", []), ("gpa", ["--ver", "12080"]), ("gpa", ["--ver", "12080", "--ptds"])]


def rawused(lines):
    return [int(x.split()[2]) for x in lines if x.startswith("rawused")]


@pytest.mark.parametrize("via,extra", LOOKUPS)
@pytest.mark.parametrize("inst", [["instantiate"], ["instantiate1"], ["instantiate2"], ["instparams", "0"]])
def test_every_instantiation_hands_the_graph_size_to_its_launch(probe, job, inst, via, extra):
    env, ledger = job
    # A 40 MiB graph allocation, instantiated through each ABI (cuGraphInstantiateWithFlags, the
    # CUDA 10 cuGraphInstantiate, the CUDA 11 _v2, cuGraphInstantiateWithParams): with 30 MiB held
    # its launch would pass the 64 MiB budget, so it fails before the driver runs it.
    lines, err = run(probe, env, "init", "streamnew", "graph", "gnode", "40M", *inst, "alloc", "30M",
                     "launch", "rawused", "free", "launch", "info", "rawused",
                     "gfreeout", "sync", "gtrim", "info", via=via, extra=extra)
    assert codes(lines, inst[0]) == [0] and codes(lines, "launch") == [2, 0]
    assert rawused(lines) == [30 * MiB, 40 * MiB]
    assert info(lines) == [(BUDGET - 40 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert "refused" in err and interposer.read_ledger(ledger).counted[0] == 0


@pytest.mark.parametrize("via,extra", LOOKUPS[:3])
def test_an_upload_is_held_to_the_budget_like_a_launch(probe, job, via, extra):
    env, ledger = job
    # cuGraphUpload, and instantiation with CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD, back the graph's
    # allocations before any launch: the graph pool grows then, so the check comes then.
    lines, _ = run(probe, env, "init", "streamnew", "graph", "gnode", "40M", "gfree",
                   "alloc", "30M", "instparams", "2", "rawused", "free",
                   "instparams", "2", "info", "rawused", "launch", "info", "rawused",
                   "gtrim", "execdestroy", "instantiate", "alloc", "30M", "upload", "rawused", "free",
                   "upload", "info", "rawused", "gtrim", "info", via=via, extra=extra)
    assert codes(lines, "instparams") == [2, 0] and codes(lines, "upload") == [2, 0]
    assert codes(lines, "launch") == [0]
    assert rawused(lines) == [30 * MiB, 40 * MiB, 40 * MiB, 30 * MiB, 40 * MiB]
    assert info(lines) == [(BUDGET - 40 * MiB, BUDGET)] * 3 + [(BUDGET, BUDGET)]
    assert interposer.read_ledger(ledger).counted[0] == 0


def test_nodes_added_any_way_and_child_graphs_count(probe, job):
    env, ledger = job
    # 24 MiB through the generic cuGraphAddNode, in a graph then moved into a parent as a child
    # graph node (ownership MOVE), beside 16 MiB of the parent's own: 40 MiB at launch.
    lines, _ = run(probe, env, "init", "streamnew", "graph", "addnode", "24M", "gfree", "childmove",
                   "gnode", "16M", "gfree", "instantiate", "alloc", "30M", "launch", "rawused", "free",
                   "launch", "info", "rawused", "gtrim", "info",
                   # a child graph with memory nodes cannot be cloned (the driver refuses it)
                   "graph", "gnode", "8M", "childclone")
    assert codes(lines, "addnode") == [0] and codes(lines, "childmove") == [0]
    assert codes(lines, "launch") == [2, 0] and codes(lines, "childclone") == [1]
    assert rawused(lines) == [30 * MiB, 40 * MiB]
    assert info(lines) == [(BUDGET - 40 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert interposer.read_ledger(ledger).counted[0] == 0


def test_an_updated_graph_is_launched_at_its_new_size(probe, job):
    env, ledger = job
    # Instantiated at 8 MiB, then updated (cuGraphExecUpdate) from a graph that allocates 40 MiB.
    lines, _ = run(probe, env, "init", "streamnew", "graph", "gnode", "8M", "gfree", "instantiate",
                   "graph", "gnode", "40M", "gfree", "update", "alloc", "30M", "launch", "rawused",
                   "free", "launch", "info", "gtrim", "info")
    assert codes(lines, "update") == [0] and codes(lines, "launch") == [2, 0]
    assert rawused(lines) == [30 * MiB]
    assert info(lines) == [(BUDGET - 40 * MiB, BUDGET), (BUDGET, BUDGET)]
    assert interposer.read_ledger(ledger).counted[0] == 0


@pytest.mark.parametrize("via", ["gpa", "gpa2"])
def test_graph_entry_points_are_wrapped_by_name_and_version(probe, job, via):
    env, _ = job
    lines, _ = run(probe, env, "init",
                   "which", "cuGraphInstantiate", "10000", "0",
                   "which", "cuGraphInstantiate", "11040", "0",
                   "which", "cuGraphInstantiate", "12000", "0",  # the ABI of ...WithFlags from 12.0
                   "which", "cuGraphInstantiateWithParams", "12080", "2",
                   "which", "cuGraphUpload", "12080", "0",
                   "which", "cuGraphExecUpdate", "11040", "0",
                   "which", "cuGraphExecUpdate", "12080", "0",
                   "dlsym", "cuGraphInstantiate_v3",  # an ABI this library does not know: refused
                   via=via)
    got = [line.split()[1:] for line in lines if line.startswith(("which", "dlsym"))]
    assert got == [
        ["0", "cuGraphInstantiate", "interpose", "cuGraphInstantiate"],
        ["0", "cuGraphInstantiate", "interpose", "cuGraphInstantiate_v2"],
        ["0", "cuGraphInstantiate", "interpose", "cuGraphInstantiateWithFlags"],
        ["0", "cuGraphInstantiateWithParams", "interpose", "cuGraphInstantiateWithParams_ptsz"],
        ["0", "cuGraphUpload", "interpose", "cuGraphUpload"],
        ["0", "cuGraphExecUpdate", "interpose", "cuGraphExecUpdate"],
        ["0", "cuGraphExecUpdate", "interpose", "cuGraphExecUpdate_v2"],
        ["500", "cuGraphInstantiate_v3"],
    ]


def test_a_graph_on_two_devices_is_charged_to_each_all_or_nothing(probe, job):
    env, ledger = job
    # 24 MiB on device 0 and 16 MiB on device 1: each device's graph pool is charged its own share
    # (read at exit: the process leaves them held).
    lines, _ = run(probe, env, "init", "streamnew", "graph", "gnodeon", "0", "24M", "gnodeon", "1", "16M",
                   "instantiate", "launch", "rawused", "rawused1", "exit")
    assert codes(lines, "launch") == [0] and [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [
        24 * MiB, 16 * MiB]
    counted = interposer.read_ledger(ledger).counted
    assert (counted.get(0), counted.get(1)) == (24 * MiB, 16 * MiB)
    # With 30 MiB held on device 1, 40 MiB there does not fit: device 0's reservation is rolled back.
    interposer.create_ledger(ledger, BUDGET)
    lines, _ = run(probe, env, "init", "1", "streamnew", "alloc", "30M", "graph", "gnodeon", "0", "40M",
                   "gnodeon", "1", "40M", "instantiate", "launch", "exit")
    assert codes(lines, "launch") == [2]
    counted = interposer.read_ledger(ledger).counted
    assert (counted.get(0, 0), counted.get(1)) == (0, 30 * MiB)


def test_an_instantiation_whose_size_cannot_be_kept_is_undone(probe, job):
    env, ledger = job
    # The table is capped at 1,024 cells (test hook), full at 512 entries: an executable graph whose
    # size could not be kept would launch unchecked, so its instantiation is undone and fails.
    lines, _ = run(probe, {**env, "COLO_TEST_TABLE_MAX": "1024"}, "init", "streamnew", "many", "512", "1K",
                   "graph", "gnode", "40M", "gfree", "instantiate", "free", "instantiate", "free", "alloc", "30M",
                   "launch", "freeall")
    assert lines[2] == "many 0 512" and codes(lines, "instantiate") == [2, 0]
    assert codes(lines, "alloc") == [0] and codes(lines, "launch") == [2]
    assert interposer.read_ledger(ledger).counted[0] == 0


def counts(lines):
    """(synchronisations, trims) the process asked the simulated driver for, at each `counts`."""
    return [tuple(map(int, x.split()[2:4])) for x in lines if x.startswith("counts")]


@pytest.mark.parametrize("sync", ["0", "1"])
def test_a_replayed_graph_takes_nothing_more_and_trims_nothing(probe, job, sync):
    env, ledger = job
    # A graph whose memory nodes take 40 of 64 MiB, freed inside it, launched 20 times (with or
    # without a synchronisation between launches), as PyTorch replays a captured step: the driver
    # keeps the graph's memory for it, so every launch fits and nothing is trimmed to make room.
    lines, err = run(probe, env, "init", "streamnew", "graph", "gnode", "40M", "gfree", "instantiate",
                     "replay", "20", sync, "counts", "greserved", "info")
    assert lines[6] == f"replay 0 20 0 {40 * MiB}"  # ran 20, refused none, the driver held 40 MiB
    assert counts(lines) == [(20 if sync == "1" else 0, 0)]
    assert info(lines) == [(BUDGET - 40 * MiB, BUDGET)] and "refused" not in err
    assert interposer.read_ledger(ledger).refused == 0


def test_a_graph_whose_allocations_outlive_it_is_replayed_with_auto_free(probe, job):
    env, ledger = job
    # PyTorch's graphs leave their outputs allocated and are instantiated with
    # CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH: each launch frees the last one's first, so
    # 40 MiB is all it ever holds.
    lines, err = run(probe, env, "init", "streamnew", "graph", "gnode", "40M", "instflags", "1",
                     "replay", "10", "0", "counts", "greserved", "info")
    assert lines[5] == f"replay 0 10 0 {40 * MiB}" and counts(lines) == [(0, 0)]
    assert info(lines) == [(BUDGET - 40 * MiB, BUDGET)] and "refused" not in err


def test_memory_a_trim_took_is_reserved_again_and_held_to_the_budget(probe, job):
    env, ledger = job
    # After a trim the graph's next launch maps its memory afresh: reserved again, so with 30 MiB
    # held meanwhile its 40 MiB no longer fit. On another stream (graphs that may run at once cannot
    # share memory) it is not taken as kept either: what it reuses is what the driver says the
    # graph pool holds unused (here all of it: the simulated driver maps nothing to a graph
    # between launches).
    lines, _ = run(probe, env, "init", "streamnew", "graph", "gnode", "40M", "gfree", "instantiate",
                   "replay", "2", "0", "gtrim", "alloc", "30M", "replay", "1", "0", "rawused", "free",
                   "replay", "1", "0", "alloc", "20M", "streamnew", "replay", "1", "0", "rawused",
                   "free", "alloc", "30M", "gtrim", "replay", "1", "0", "rawused")
    assert [x.split()[1:4] for x in lines if x.startswith("replay")] == [
        ["0", "2", "0"], ["2", "0", "1"], ["0", "1", "0"], ["0", "1", "0"], ["2", "0", "1"]]
    assert [int(x.split()[2]) for x in lines if x.startswith("rawused")] == [30 * MiB, 60 * MiB, 30 * MiB]
    assert interposer.read_ledger(ledger).peak[0] <= BUDGET
