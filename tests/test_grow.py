"""Issue 13 item 4 in the daemon: a --grow job starts with more than it asked for, lent out of
memory no queued job fits in or learned from its own user's earlier runs, and that budget is the
one everything counts (interposer, invariant 1, a restarted daemon). Real daemon, real processes
(colo-burn) on the simulated driver."""
from __future__ import annotations

import json
import os

import pytest

from colo.client import Client
from harness.daemon import DaemonProc, as_user, burn_path, wait_for
from harness.node import SimNode

GiB, MiB = 1024**3, 1024**2


def _starter(n: SimNode):
    """start(**config): a daemon on the node, in a folder of its own."""
    def start(**cfg) -> DaemonProc:
        return n.daemon({"profile_dirs": [str(n.prof)], "mps_idle_stop": 600.0, **cfg},
                        home=f"d{len(n.daemons)}", reachable=False)
    return start


# One simulated 4 GiB GPU (reserve 0), a profile whose memory (1 GiB) is ~10 % short of what its jobs
# use (1100 MiB).
pytestmark = pytest.mark.node("colo-grow-", mem=4 * GiB,
                              profiles={"under": dict(sm=0.3, mem=GiB, membw=0.2, runtime=2.0, n=10)}, then=_starter)


def explain(d: DaemonProc, job_id: int) -> dict:
    return json.loads(d.cli("explain", str(job_id), "--json", check=True).stdout)


def test_a_grow_job_is_lent_what_it_needs_and_the_lent_budget_counts_across_a_restart(node):
    d = node()
    over = ["--process", "--gpu-mem", "1GiB", "--profile", "under"]
    plain = d.submit(*over, "--", burn_path(d), "--mem", "1100MiB", "--seconds", "1")
    j = d.wait_state(plain, "failed", timeout=60)  # without --grow: refused, its failure as before
    assert "refused by its budget of 1.0GiB" in j["reason"] and j["spec"]["asked_mem"] is None, j

    gate = d.root / "go"
    grown = d.submit(*over, "--grow", "--", "sh", "-c", f"{burn_path(d)} --mem 1100MiB --seconds 600 --quiet & b=$!; "
                     f"while [ ! -e {gate} ]; do sleep 0.05; done; kill $b; wait $b; exit 0")
    j = d.wait_state(grown, "running", timeout=60)
    assert j["budget"] == 1280 * MiB and j["spec"]["asked_mem"] == GiB, j  # 1.25x: no queued job fits in 3 GiB
    assert "asked 1.0GiB" in j["reason"], j["reason"]  # what ls shows while it runs
    shown = d.cli("show", str(grown), check=True).stdout
    assert "budget:    1.25GiB x 1 GPU(s) (asked 1GiB, more given under --grow)" in shown, shown
    why = d.cli("explain", str(grown), check=True).stdout
    assert "256MiB more lent (--grow" in why and "budget 1.2GiB (asked 1.0GiB; lent: --grow)" in why, why
    # the interposer enforces the lent budget: its ledger's header says so
    from colo.node import interposer
    assert wait_for(lambda: (u := d.job(grown).get("used")) and u >= 1100 * MiB, 30, "the allocation")
    assert interposer.read_ledger(d.state_dir / "jobs" / str(grown) / "ledger").budget == 1280 * MiB

    # invariant 1 with the lend: 3 GiB no longer fits beside 1.25 GiB on 4 GiB
    big = d.submit("--process", "--gpu-mem", "3GiB", "--", "true")
    dec = wait_for(lambda: (e := explain(d, big))["decision"] and e["decision"], 30, "a decision for the big job")
    assert dec["action"] == "wait" and dec["details"]["most_free"] == 4 * GiB - 1280 * MiB, dec

    # a restarted daemon counts the budget the job was started with, not the one it asked for
    d.kill9()
    d.start()
    assert d.wait_state(grown, "running")["budget"] == 1280 * MiB
    probe = d.submit("--process", "--gpu-mem", "3GiB", "--", "true")
    dec = wait_for(lambda: (e := explain(d, probe))["decision"] and e["decision"], 30, "a decision after the restart")
    assert dec["action"] == "wait" and dec["details"]["most_free"] == 4 * GiB - 1280 * MiB, dec
    assert d.job(big)["state"] == "queued"

    gate.touch()
    j = d.wait_state(grown, "succeeded", timeout=60)
    assert not any("refused" in e["reason"] for e in j["events"]), j["events"]
    assert j["budget"] == 1280 * MiB  # what it ran with, in the history
    # run again (colo requeue), the copy asks for what was asked, not what was lent
    again = int(d.cli("requeue", str(grown), check=True).stdout.split()[-1])
    j = d.wait_state(again, "succeeded", timeout=60)
    assert any("asked 1.0GiB" in e["reason"] for e in j["events"]), j["events"]


def test_a_grow_job_starts_with_what_its_users_earlier_runs_used(node, other_user):
    d = node(lend=1.0)  # no lending: the learned budget alone
    over = ["--process", "--profile", "under"]
    first = d.submit(*over, "--gpu-mem", "2GiB", "--", burn_path(d), "--mem", "1100MiB", "--duty", "30", "--seconds", "2")
    d.wait_state(first, "succeeded", timeout=60)
    wait_for(lambda: json.loads(d.cli("profile", "show", "under", "--json", check=True).stdout)["learned"]
             .get("suggested_budget") == 1280 * MiB, 30, "the learned budget")  # 1100 MiB + 10 %, 256 MiB steps

    again = ["--gpu-mem", "1GiB", "--", burn_path(d), "--mem", "1100MiB", "--seconds", "1"]
    grown = d.submit(*over, "--grow", *again)
    j = d.wait_state(grown, "succeeded", timeout=60)
    assert j["budget"] == 1280 * MiB and j["spec"]["asked_mem"] == GiB, j
    assert not any("refused" in e["reason"] for e in j["events"]), j["events"]
    assert any("budget 1.2GiB (asked 1.0GiB; its profile's runs used that much (+10 %): --grow)" in e["reason"]
               for e in j["events"]), j["events"]
    plain = d.submit(*over, *again)  # the same job without --grow: refused
    assert "refused by its budget of 1.0GiB" in d.wait_state(plain, "failed", timeout=60)["reason"]

    # another user's job of the same profile learns nothing from root's runs: it starts with what
    # it asked for, is refused, and only --grow's requeue after that gives it more
    os.chmod(d.socket.parent, 0o755)
    spec = {"argv": again[3:], "gpu_mem": "1GiB", "profile": "under", "grow": True, "workdir": "/tmp"}
    kind, theirs = as_user(other_user, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", theirs
    j = d.wait_state(theirs, "succeeded", timeout=90)
    assert any("refused by its budget of 1.0GiB; requeued with budget 1.2GiB (--grow)" in e["reason"]
               for e in j["events"]), j["events"]


def test_a_refused_grow_job_teaches_its_name_its_budget_though_it_had_no_profile(node):
    """A job of no profile refused by its budget needed more than that budget, whatever its
    samples show (the refused allocation never showed): the next of its name starts with that
    budget + 10 %, not with the budget that was refused."""
    d = node(lend=1.0)  # no lending: the learned budget alone
    job = ["--process", "--grow", "--gpu-mem", "1GiB", "--", burn_path(d), "--mem", "1100MiB", "--seconds", "1"]
    j = d.wait_state(d.submit(*job), "succeeded", timeout=60)
    assert any("refused by its budget of 1.0GiB; requeued with budget 1.2GiB (--grow)" in e["reason"]
               for e in j["events"]), j["events"]
    j = d.wait_state(d.submit(*job), "succeeded", timeout=60)
    assert j["budget"] == 1280 * MiB and not any("refused" in e["reason"] for e in j["events"]), j["events"]


def test_nothing_is_lent_out_of_memory_a_waiting_job_fits_in(node):
    """plan() is given only the jobs a pass plans: one waiting for a dependency is not among
    them, and the memory it fits in is not lent to a --grow job all the same."""
    d = node()
    gate = d.root / "go"
    first = d.submit("--process", "--gpu-mem", "1GiB", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    d.wait_state(first, "running")
    after = d.submit("--process", "--gpu-mem", "2GiB", "--after", str(first), "--", "true")
    grown = d.submit("--process", "--gpu-mem", "1GiB", "--grow", "--", "sh", "-c",
                     f"while [ ! -e {gate} ]; do sleep 0.05; done")
    j = d.wait_state(grown, "running")
    assert j["budget"] == GiB and j["spec"]["asked_mem"] is None, j  # 4 - 1 - 1 GiB left: the waiting 2 GiB fit
    assert "not lent after all: a queued job fits" in explain(d, grown)["decision"]["reason"]
    gate.touch()
    d.wait_state(after, "succeeded", timeout=60)


def test_a_lend_that_would_pass_the_users_memory_limit_is_not_made(node):
    d = node(max_gpu_mem_per_user="1GiB")
    grown = d.submit("--process", "--gpu-mem", "1GiB", "--grow", "--", "true")
    j = d.wait_state(grown, "succeeded", timeout=60)
    assert j["budget"] == GiB and j["spec"]["asked_mem"] is None, j
    assert "not lent after all: waiting for a limit" in explain(d, grown)["decision"]["reason"]
