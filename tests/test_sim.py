"""colo sim: calibration against the study figures (docs/invariants.md), hand-built cases with
known answers, the bar on the shipped mixes, determinism, history replay, and the CLI."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from colo.cli import sim as cli_sim
from colo.sched import interference as simmodel, learning, policy, sim, truth as simtruth
from colo.profiles import Profile, ProfileStore, shipped_dir

GiB = 1024**3


def flat(name, sm, bw, runtime, cache_bound=False, mem=GiB, step=None):
    step = step or runtime / 10
    n = 10
    return Profile(name=name, step=step, sm=np.full(n, sm), mem=np.full(n, mem), membw=np.full(n, bw),
                   runtime=runtime, cache_bound=cache_bound)


def pair(p, budget=2 * GiB):
    return [sim.SimJob(1, p, budget=budget), sim.SimJob(2, p, budget=budget)]


LIGHT = flat("cal-light", **{k: simmodel.CAL_LIGHT[k] for k in ("sm", "runtime", "cache_bound")}, bw=simmodel.CAL_LIGHT["membw"])
HEAVY = flat("cal-heavy", **{k: simmodel.CAL_HEAVY[k] for k in ("sm", "runtime", "cache_bound")}, bw=simmodel.CAL_HEAVY["membw"])


def test_model_reproduces_the_study_figures():
    """The policy's model (colo/sched/interference.py), calibrated to the H200 where it measured and
    to the placement study's cache-bound pair where it did not."""
    assert sim.simulate(pair(LIGHT), "mps-all").makespan == pytest.approx(0.74, abs=0.005)
    # the study's 1.50 s time-sliced contradicts the H200 (light work time-slices at no cost)
    assert sim.simulate(pair(LIGHT), "naive").makespan == pytest.approx(0.74, abs=0.005)
    sat = flat("cal-sat", **{k: simmodel.CAL_SATURATING[k] for k in ("sm", "runtime", "cache_bound")},
               bw=simmodel.CAL_SATURATING["membw"])
    assert 10.8 / sim.simulate(pair(sat), "naive").makespan == pytest.approx(1.21, rel=0.01)  # the H200's pair
    assert 10.8 / sim.simulate(pair(sat), "mps-all").makespan == pytest.approx(1.33, rel=0.01)
    assert sim.simulate(pair(HEAVY), "mps-all").makespan == pytest.approx(223.6, abs=0.2)
    assert sim.simulate(pair(HEAVY), "naive").makespan == pytest.approx(61.5, abs=0.1)


def test_colo_shares_two_light_jobs_under_mps():
    knows = policy.Learned(alone={LIGHT.name: (1, 1.0)})  # its alone time here: nothing to check
    r = sim.simulate(pair(LIGHT), "colo", learned=knows)
    assert [j["mode"] for j in r.jobs] == ["mps", "mps"] and [j["start"] for j in r.jobs] == [0.0, 0.0]
    assert r.makespan == pytest.approx(0.74, abs=0.005) and r.oom == 0
    # the daemon's default no longer runs a profile never seen alone here alone once (Config.check_alone
    # off: in the world fitted to the H200 that check was most of the cold gap, docs/sim.md); with it on,
    # the first runs alone
    r = sim.simulate(pair(LIGHT), "colo")
    assert [j["start"] for j in r.jobs] == [0.0, 0.0]
    import dataclasses
    r = sim.simulate(pair(LIGHT), "colo", config=dataclasses.replace(sim.DAEMON_CONFIG, check_alone=True))
    assert [j["start"] for j in r.jobs] == [0.0, pytest.approx(0.74)]


def test_colo_does_not_share_two_saturating_cache_bound_jobs():
    r = sim.simulate(pair(HEAVY), "colo")
    starts = sorted(j["start"] for j in r.jobs)
    assert starts[1] >= starts[0] + HEAVY.runtime - 1e-6  # one after the other
    assert r.makespan == pytest.approx(2 * HEAVY.runtime, rel=1e-3)  # beats 61.5 (TS) and 223.6 (MPS)


def test_naive_sharing_ooms_where_budgets_queue():
    grow = Profile(name="grow", step=10, sm=np.full(10, 0.5), membw=np.full(10, 0.3),
                   mem=(np.linspace(1, 8, 10) * GiB).astype(np.int64), runtime=100)
    jobs = pair(grow, budget=8 * GiB + GiB // 2)
    naive = sim.simulate(jobs, "naive")
    assert naive.oom >= 1
    colo = sim.simulate(jobs, "colo")
    assert colo.oom == 0 and colo.lost == 0 and colo.makespan == pytest.approx(200, rel=1e-3)
    assert sim.simulate(jobs, "mean-pack").oom >= 1  # packs by mean use: runs out


def test_a_job_past_its_budget_fails_alone():
    grow = Profile(name="grow", step=10, sm=np.full(10, 0.2), membw=np.full(10, 0.1),
                   mem=(np.linspace(1, 4, 10) * GiB).astype(np.int64), runtime=100)
    ok = flat("ok", 0.2, 0.1, 100)
    r = sim.simulate([sim.SimJob(1, grow, budget=2 * GiB), sim.SimJob(2, ok, budget=2 * GiB)], "colo")
    by = {j["id"]: j for j in r.jobs}
    assert by[1]["state"] == "lost" and "passes its budget" in by[1]["reason"] and by[1]["ooms"] == sim.MAX_TRIES
    assert by[2]["state"] == "done" and by[2]["ooms"] == 0


def test_colo_in_sim_is_policy_plan(monkeypatch):
    calls = []
    real = policy.plan

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(policy, "plan", spy)
    sim.simulate(pair(LIGHT), "colo")
    assert calls


@pytest.mark.slow
def test_mixes_are_deterministic_and_match_the_shipped_files():
    for kind in sim.MIXES:
        a, b = sim.make_mix(kind, 7), sim.make_mix(kind, 7)
        assert sim.dumps_workload(a) == sim.dumps_workload(b)
        assert sim.dumps_workload(a) == (sim.workloads_dir() / f"{kind}.workload").read_text()
        assert len(a.jobs) == sim.SIZES.get(kind, (30,))[0] and {j.profile.name for j in a.jobs} <= set(sim.CLASSES[kind])
    assert sim.dumps_workload(sim.make_mix("random", 8)) != sim.dumps_workload(sim.make_mix("random", 7))
    w = sim.load_workload("random")
    first = [r.summary() for r in sim.compare(w.jobs, ["colo", "tetris"])]
    assert first == [r.summary() for r in sim.compare(w.jobs, ["colo", "tetris"])]


@pytest.fixture(scope="module")
def mix_results():
    return {k: {r.policy: r for r in sim.compare(sim.load_workload(k).jobs)} for k in sim.MIXES}


@pytest.mark.parametrize("kind", ["heavy", "memory-heavy"])
def test_bar_heavy_mixes_no_worse_than_sjf_by_3_percent(mix_results, kind):
    r = mix_results[kind]
    assert r["colo"].makespan <= 1.03 * r["exclusive-sjf"].makespan


@pytest.mark.parametrize("kind", ["light", "memory-light"])
def test_bar_light_mixes_clearly_better(mix_results, kind):
    r = mix_results[kind]
    assert r["colo"].makespan <= 0.8 * r["exclusive-sjf"].makespan


def test_bar_colo_never_loses_a_job_to_oom(mix_results):
    for kind, r in mix_results.items():
        assert (r["colo"].oom, r["colo"].lost) == (0, 0), kind
    assert sum(r["naive"].oom for r in mix_results.values()) > 0  # the model can OOM at all


def test_workload_file_round_trip_and_errors(tmp_path):
    store = ProfileStore([shipped_dir()])
    text = ("colo-workload 1\nname mine\ngpu_mem 24GiB\n# a comment\n"
            "job 0 alexnet 3GiB\njob 12.5 gromacs - uid=1001 priority=2 known=no\n")
    w = sim.loads_workload(text, store)
    assert (w.name, w.gpu_mem, len(w.jobs)) == ("mine", 24 * GiB, 2)
    j = w.jobs[1]
    assert (j.arrival, j.budget, j.uid, j.priority, j.known) == (12.5, None, 1001, 2, False)
    assert sim.loads_workload(sim.dumps_workload(w), store).jobs[1].uid == 1001
    for bad, msg in [("job 0 x 1G\n", "not a workload"), ("colo-workload 1\njob 0 nosuch 1G\n", "no profile"),
                     ("colo-workload 1\njob 0 alexnet lots\n", "malformed size"),
                     ("colo-workload 1\nfrob 1\n", "unknown line")]:
        with pytest.raises(sim.SimError, match=msg):
            sim.loads_workload(bad, store)


def test_jobs_from_history():
    rows = [
        {"id": 3, "uid": 1000, "spec": {"profile": "alexnet", "gpu_mem": 3 * GiB, "gpus": 1}, "submitted_at": 100.0,
         "started_at": 101.0, "ended_at": 150.0},
        {"id": 4, "uid": 1001, "spec": {"profile": None, "gpu_mem": 2 * GiB, "gpus": 1}, "submitted_at": 110.0,
         "started_at": 120.0, "ended_at": 180.0},
        {"id": 5, "uid": 1001, "spec": {"gpu_mem": 2 * GiB, "gpus": 1}, "submitted_at": 111.0,
         "started_at": None, "ended_at": 112.0},  # cancelled in the queue
        {"id": 6, "uid": 0, "spec": {"gpus": 0}, "submitted_at": 100.0, "started_at": 100.0, "ended_at": 101.0},
    ]
    jobs = sim.jobs_from_history(rows)
    assert [j.id for j in jobs] == [3, 4]
    assert jobs[0].known and jobs[0].profile.name == "alexnet" and jobs[0].arrival == 0.0
    assert not jobs[1].known and jobs[1].profile.runtime == pytest.approx(60.0) and jobs[1].arrival == 10.0
    r = sim.simulate(jobs, "colo")
    assert r.lost == 0 and [j["mode"] for j in r.jobs][1] == "timesliced"


# ---- CLI ----------------------------------------------------------------------------------------

@pytest.fixture
def cli(tmp_path, monkeypatch):
    monkeypatch.setenv("COLO_USER_PROFILES", str(tmp_path / "mine"))
    monkeypatch.setattr(cli_sim, "load_history_rows", None)  # colo.cli.app wires it when another test imported it
    app = typer.Typer()
    cli_sim.register(app)
    return lambda *args: CliRunner().invoke(app, list(args))


@pytest.mark.slow  # three whole mixes through the CLI
def test_cli_sim_json_and_table(cli):
    r = cli("sim", "light", "--json", "-p", "colo", "-p", "exclusive-sjf")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [x["policy"] for x in d["results"]] == ["colo", "exclusive-sjf"] and d["jobs"] == 30
    r = cli("sim", "light", "--gpus", "2", "--plot", "-p", "colo")
    assert r.exit_code == 0 and "GPU1 SM" in r.stdout and "colo" in r.stdout


@pytest.mark.parametrize("args,msg", [(["sim", "nosuch"], "no workload file"),
                                      (["sim", "light", "-p", "magic"], "unknown policy"),
                                      (["sim", "--from-history"], "not wired"),
                                      (["profile", "show", "nosuch"], "no profile named"),
                                      (["profile", "record"], "give the command")])
def test_cli_errors_are_one_line_exit_1(cli, args, msg):
    r = cli(*args)
    assert r.exit_code == 1 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_profile_ls_show(cli):
    r = cli("profile", "ls")
    assert r.exit_code == 0 and "vgg16" in r.stdout and "gromacs" in r.stdout
    r = cli("profile", "show", "qmcpack")
    assert r.exit_code == 0 and r.stdout.startswith("colo-profile 1\nname qmcpack\n")
    assert json.loads(cli("profile", "show", "qmcpack", "--json").stdout)["peak_mem"] == 5135 * 1024**2


def test_cli_from_history_hook(cli, monkeypatch):
    rows = [{"id": 1, "uid": 0, "spec": {"profile": "alexnet", "gpu_mem": 3 * GiB, "gpus": 1},
             "submitted_at": 0.0, "started_at": 0.0, "ended_at": 45.0}]
    monkeypatch.setattr(cli_sim, "load_history_rows", lambda: rows)
    r = cli("sim", "--from-history", "--json", "-p", "colo", "--truth", "exact")
    assert r.exit_code == 0 and json.loads(r.stdout)["results"][0]["makespan"] == pytest.approx(45.0)


# ---- truth apart from prediction (issue 13) ----------------------------------------------------

def test_study_truth_keeps_the_mps_study_pairs():
    light = flat("s-light", **{k: simmodel.CAL_LIGHT[k] for k in ("sm", "runtime", "cache_bound")}, bw=simmodel.CAL_LIGHT["membw"])
    h = simtruth.calibration_pair("heavy")
    heavy = flat("s-heavy", h["sm"], h["membw"], h["runtime"], h["cache_bound"])
    exact_physics = simtruth.Truth("study", spreads=simtruth.NO_SPREAD)
    assert sim.simulate(pair(light), "mps-all", truth=exact_physics).makespan == pytest.approx(0.74, abs=0.005)
    assert sim.simulate(pair(light), "naive", truth=exact_physics).makespan == pytest.approx(1.50, abs=0.005)
    assert sim.simulate(pair(heavy), "mps-all", truth=exact_physics).makespan == pytest.approx(223.6, abs=0.2)
    assert sim.simulate(pair(heavy), "naive", truth=exact_physics).makespan == pytest.approx(61.5, abs=0.1)


def test_policies_decide_from_stored_profiles_not_from_the_truth():
    """SJF orders by the *stored* run time: a job that really runs longer than stored keeps its
    place; the truth moves only how long things take."""
    short, long_ = flat("short", 0.5, 0.2, 100), flat("long", 0.5, 0.2, 300)
    jobs = [sim.SimJob(1, long_, budget=2 * GiB), sim.SimJob(2, short, budget=2 * GiB)]
    for kind in simtruth.TRUTHS:
        for seed in range(3):
            r = sim.simulate(jobs, "exclusive-sjf", truth=simtruth.Truth(kind, seed))
            by = {j["id"]: j for j in r.jobs}
            assert by[2]["start"] == 0.0 and by[1]["start"] == pytest.approx(by[2]["alone"]), (kind, seed)
    spread = simtruth.Spreads(duration=(2.0, 2.0), corun=(0.0, 0.0))
    r = sim.simulate(jobs, "exclusive-sjf", truth=simtruth.Truth("noisy", 0, spread))
    assert [j["alone"] for j in r.jobs] == pytest.approx([600.0, 200.0])  # the truth, not the profile


def test_noisy_truth_is_reproducible_and_differs_by_seed():
    w = sim.load_workload("light").jobs[:8]
    a = [sim.simulate(w, "tetris", truth=simtruth.Truth("noisy", 3)).summary() for _ in range(2)]
    assert a[0] == a[1]
    assert sim.simulate(w, "tetris", truth=simtruth.Truth("noisy", 4)).makespan != a[0]["makespan"]


def test_a_job_failing_at_its_first_step_does_not_lose_the_queue():
    """It used to: the node looked idle with nothing pending, so every queued job was 'lost'."""
    huge = Profile(name="huge", step=1, sm=np.full(5, 0.5), membw=np.full(5, 0.1), mem=np.full(5, 20 * GiB),
                   runtime=5)
    ok = flat("ok", 0.5, 0.1, 50)
    r = sim.simulate([sim.SimJob(1, huge), sim.SimJob(2, ok)], "exclusive-fifo")
    by = {j["id"]: j for j in r.jobs}
    assert by[1]["state"] == "lost" and by[1]["ooms"] == sim.MAX_TRIES
    assert by[2]["state"] == "done" and r.makespan == pytest.approx(50.0)
    assert r.failed


def test_lost_jobs_are_a_failure_never_a_shorter_makespan():
    w = sim.load_workload("light").jobs
    res = {r.policy: r for r in sim.compare(w, ["naive", "colo"])}  # SJF is run for the ratio
    assert res["naive"].lost > 0 and res["naive"].ratio is None
    assert res["colo"].lost == 0 and res["colo"].ratio is not None and res["colo"].ratio < 1.0
    text = sim.table(list(res.values()))
    assert re.search(r"naive\s+FAILED\s+-", text) and "FAILED: jobs were lost" in text


def test_grow_requeues_a_job_refused_by_its_budget_once_with_a_larger_one():
    grow = Profile(name="grow", step=10, sm=np.full(10, 0.2), membw=np.full(10, 0.1),
                   mem=(np.linspace(1, 4, 10) * GiB).astype(np.int64), runtime=100)
    jobs = [sim.SimJob(1, grow, budget=3 * GiB)]
    assert sim.simulate(jobs, "colo").lost == 1
    no_lend = policy.PolicyConfig(lend=1.0)
    r = sim.simulate(jobs, "colo", grow=True, config=no_lend)
    j = r.jobs[0]
    # refused at 3.33 GiB: 1.25 x that, rounded up to 256 MiB
    assert (r.lost, j["state"], j["ooms"]) == (0, "done", 1) and j["budget"] == int(4.25 * GiB)
    capped = sim.simulate(jobs, "colo", grow=True, gpu_mem=int(3.5 * GiB), config=no_lend)
    assert capped.lost == 1 and capped.jobs[0]["budget"] == int(3.5 * GiB)  # no more than the GPU has
    # lent what no queued job fits in (policy.lend): a profile a little short costs no re-run
    r = sim.simulate([sim.SimJob(1, grow, budget=int(3.5 * GiB))], "colo", grow=True)
    assert (r.oom, r.lost) == (0, 0) and r.jobs[0]["budget"] == int(4.5 * GiB)


def test_a_job_of_no_profile_starts_with_the_budget_an_earlier_one_of_its_name_was_refused_at():
    """As the daemon (grow.budget_of, Learner.grown_budget): the budget a --grow job of a name was
    refused at is learned under that name whether or not a profile was known (what more it asked
    for no sample shows), and the next of the name starts with it + 10 %."""
    grow = Profile(name="grow", step=10, sm=np.full(10, 0.2), membw=np.full(10, 0.1),
                   mem=(np.repeat([1.0, 3.5], 5) * GiB).astype(np.int64), runtime=100)
    jobs = [sim.SimJob(1, grow, budget=3 * GiB, known=False), sim.SimJob(2, grow, arrival=300.0, budget=3 * GiB, known=False)]
    r = sim.simulate(jobs, "colo", grow=True, config=policy.PolicyConfig(lend=1.0))
    assert (r.lost, [j["ooms"] for j in r.jobs]) == (0, [1, 0]), r.jobs
    assert r.jobs[1]["budget"] == int(3.5 * GiB)  # refused at 3 GiB, + 10 %, in 256 MiB steps


@pytest.mark.slow
def test_cli_sim_truth_and_seeds(cli):
    r = cli("sim", "light", "--truth", "noisy", "--seeds", "2", "--json", "-p", "colo", "-p", "tetris", "--grow")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["truth"] == "noisy" and [(x["seed"], x["policy"]) for x in d["results"]] == [
        (0, "colo"), (0, "tetris"), (1, "colo"), (1, "tetris")]
    assert all({"ratio", "lost", "oom", "p95_slowdown", "max_slowdown", "makespan"} <= set(x) for x in d["results"])
    r = cli("sim", "light", "--truth", "study", "--seeds", "2", "-p", "colo")
    assert r.exit_code == 0 and "over 2 seeds" in r.stdout and "median vs SJF" in r.stdout
    r = cli("sim", "light", "-p", "colo")  # h200 unless told: exact is colo's own model, circular
    assert r.exit_code == 0 and "truth h200: jobs run off their profiles under a physics fitted" in r.stdout
    r = cli("sim", "light", "--truth", "magic")
    assert r.exit_code == 1 and "unknown truth" in r.stderr


def test_colo_in_sim_learns_across_repeated_mixes():
    """A pair whose co-running really costs far more than the model knows: shared the first
    time, not once colo has seen it (and each alone)."""
    a, b = flat("la", 0.3, 0.2, 100), flat("lb", 0.3, 0.2, 100)
    truth = simtruth.Truth("noisy", 0, simtruth.Spreads((1, 1), (1, 1), (1, 1), 0.0, (1, 1), (2.0, 2.0)))
    learned = policy.Learned()
    alone = sim.simulate([sim.SimJob(1, a, budget=GiB)], "colo", truth=truth, learned=learned)
    alone2 = sim.simulate([sim.SimJob(1, b, budget=GiB)], "colo", truth=truth, learned=learned)
    assert alone.makespan == alone2.makespan == pytest.approx(100.0) and set(learned.alone) == {"la", "lb"}
    jobs = [sim.SimJob(1, a, budget=GiB), sim.SimJob(2, b, budget=GiB)]
    first = sim.simulate(jobs, "colo", truth=truth, learned=learned)
    assert [j["start"] for j in first.jobs] == [0.0, 0.0] and first.makespan == pytest.approx(300.0)
    # the pair's 3x, taken by the bandwidth curve at the pair's summed bandwidth (0.4): nothing is left to the pairing
    assert learned.factor("la", "lb", "mps") * learned.curve("mps", 0.4) == pytest.approx(3.0, rel=0.01)
    # the mode no run has shown yet (a time-sliced context beside the MPS client: the H200-calibrated
    # model has time slices of such work cost nothing) is tried once, and pays too
    other = sim.simulate(jobs, "colo", truth=truth, learned=learned)
    assert sorted(j["mode"] for j in other.jobs) == ["mps", "timesliced"] and other.makespan > 300.0
    again = sim.simulate(jobs, "colo", truth=truth, learned=learned)
    assert sorted(j["start"] for j in again.jobs) == [0.0, pytest.approx(100.0)] and again.makespan == pytest.approx(200.0)
    # budgets learn too: with --grow a job starts with what its profile needed before
    grow = Profile(name="grow", step=10, sm=np.full(10, 0.2), membw=np.full(10, 0.1),
                   mem=(np.linspace(1, 4, 10) * GiB).astype(np.int64), runtime=100)
    sim.simulate([sim.SimJob(1, grow, budget=3 * GiB)], "colo", grow=True, learned=learned)
    r = sim.simulate([sim.SimJob(1, grow, budget=3 * GiB)], "colo", grow=True, learned=learned)
    assert (r.oom, r.lost) == (0, 0) and r.jobs[0]["budget"] >= 4 * GiB


def test_colo_in_sim_orders_the_queue_by_fair_share_as_the_daemon_does():
    """Three jobs of uid 1 queued before one of uid 2, one GPU each at a time: users take turns
    (colo/sched/fairshare.py), so uid 2's job runs second, not last; the baselines keep arrival order."""
    big = flat("big", 0.5, 0.2, 100, mem=10 * GiB)
    jobs = [sim.SimJob(i, big, budget=11 * GiB, uid=1) for i in (1, 2, 3)] + [sim.SimJob(4, big, budget=11 * GiB, uid=2)]
    r = sim.simulate(jobs, "colo", truth=simtruth.Truth("exact"))
    assert [j["id"] for j in sorted(r.jobs, key=lambda j: j["start"])] == [1, 4, 2, 3]
    fifo = sim.simulate(jobs, "exclusive-fifo", truth=simtruth.Truth("exact"))
    assert [j["id"] for j in sorted(fifo.jobs, key=lambda j: j["start"])] == [1, 2, 3, 4]


@pytest.mark.slow
def test_oracle_bound_keeps_every_job_within_the_bound_by_the_truth_it_reads():
    """Two jobs that would pay off together (1.65x each under MPS or time-sliced, sooner than one
    after the other) break the 1.5x bound: the reference overlaps them only as far as the bound allows; jobs that do not slow each
    other share. On a slice of a random mix under every truth, nobody passes the bound."""
    fat, thin = flat("fat", 1.0, 0.6, 100), flat("thin", 0.3, 0.2, 100)
    exact = simtruth.Truth("exact")
    r = sim.simulate(pair(fat), "oracle-bound", truth=exact)
    # the second starts once the first has little enough left: 30 s in, each ends within 1.5x its alone time
    assert sorted(j["start"] for j in r.jobs) == [0.0, pytest.approx(30.0)] and r.max_slowdown <= 1.5 + 1e-6
    assert sim.simulate(pair(fat), "mps-all", truth=exact).max_slowdown == pytest.approx(1.65)  # what sharing costs
    r = sim.simulate(pair(thin), "oracle-bound", truth=exact)
    assert [j["start"] for j in r.jobs] == [0.0, 0.0] and r.makespan == pytest.approx(100.0)
    w = sim.make_mix("random", 5).jobs[:8]
    for truth in (simtruth.Truth("noisy", 1), simtruth.Truth("study", 1)):
        res = {x.policy: x for x in sim.compare(w, ["exclusive-sjf", "oracle-bound"], truth=truth)}
        o = res["oracle-bound"]
        assert o.lost == 0 and o.over_bound == 0 and o.max_slowdown <= 1.5 + 1e-6, truth.kind
        assert o.ratio < 1.0, truth.kind  # it does share


def test_colo_in_sim_learns_profiles_from_uncontended_runs_as_the_daemon_does():
    """A job whose real SM is far below its stored profile: two at once are predicted to saturate
    the GPU, so colo runs them one after the other; once an uncontended run was merged into its
    profile (the daemon's learn()), a later mix shares them. A shared run teaches the profile nothing."""
    fat = flat("fat", 0.9, 0.2, 100)
    truth = simtruth.Truth("noisy", 0, simtruth.Spreads((0.2, 0.2), (1, 1), (1, 1), 0.0, (1, 1), (0, 0)))
    before = sim.simulate(pair(fat), "colo", truth=truth, learned=policy.Learned(alone={"fat": (1, 1.0)}))
    assert sorted(j["start"] for j in before.jobs) == [0.0, pytest.approx(100.0)]
    learned, profiles = policy.Learned(), {}
    sim.simulate([sim.SimJob(1, fat, budget=2 * GiB)], "colo", truth=truth, learned=learned, profiles=profiles)
    got = profiles["fat"]
    # NVML's readings are noisy (Truth.sample_noise): the mean of 10 points of them, a percent or two off
    assert got.runs == 2 and got.mean_sm == pytest.approx((0.9 + 0.18) / 2, rel=0.02) and got.runtime == pytest.approx(100.0)
    after = sim.simulate(pair(fat), "colo", truth=truth, learned=learned, profiles=profiles)
    assert [j["start"] for j in after.jobs] == [0.0, 0.0] and after.makespan == pytest.approx(100.0)
    assert profiles["fat"].runs == 2  # both shared their GPU: nothing merged
    # a job without a profile (known=no) learns its first from its run
    new = {}
    sim.simulate([sim.SimJob(1, fat, budget=2 * GiB, known=False)], "colo", truth=truth, learned=policy.Learned(),
                 profiles=new)
    assert new["fat"].runs == 1 and new["fat"].mean_sm == pytest.approx(0.18, rel=0.05)
    assert sim.simulate(pair(fat), "colo", truth=truth, learn=False, profiles=new).makespan == pytest.approx(200.0)


def test_colo_in_sim_compares_a_joined_job_with_what_the_start_beside_it_predicted():
    """A job started alone that another joins halfway, both then 1.3x slower as runs showed
    before: its end matches what was predicted (alone, then 1.3x), so no error is learned;
    compared with its own start's 1x only, it would teach a 15 % error."""
    a, b = flat("ja", 0.3, 0.2, 200), flat("jb", 0.3, 0.2, 100)
    truth = simtruth.Truth("noisy", 0, simtruth.Spreads((1, 1), (1, 1), (1, 1), 0.0, (1, 1), (0.3, 0.3)))
    learned = policy.Learned(alone={"ja": (1, 1.0), "jb": (1, 1.0)}, bw={("mps", 4): (3, 1.0)},
                             corun={("ja", "jb", "mps"): (3, 1.3), ("jb", "ja", "mps"): (3, 1.3)})
    r = sim.simulate([sim.SimJob(1, a, budget=GiB), sim.SimJob(2, b, arrival=100.0, budget=GiB)], "colo",
                     truth=truth, learned=learned)
    assert [(j["start"], j["end"]) for j in r.jobs] == [(0.0, pytest.approx(230.0)), (100.0, pytest.approx(230.0))]
    assert learned.errors == [pytest.approx(1.0, abs=0.01)] * 2
    assert learned.factor("ja", "jb", "mps") <= 1.3 + 1e-6  # not raised by it
    assert learned.errors_seen == learned.errors  # both pairings were seen when each prediction was made


def test_colo_in_sim_compares_a_job_its_neighbour_left_with_its_profile_from_then_on():
    """Two jobs start together, both 1.3x slower beside each other as runs showed before; the
    short one ends at 130 s and the long one runs alone from then on (300 s of work left): its
    end (430 s) is what was predicted (1.3x while shared, then 1x), so no error is learned.
    Compared with 1.3x for the whole run it would teach 0.83 (the model was too pessimistic)."""
    a, b = flat("ja", 0.3, 0.2, 400), flat("jb", 0.3, 0.2, 100)
    truth = simtruth.Truth("noisy", 0, simtruth.Spreads((1, 1), (1, 1), (1, 1), 0.0, (1, 1), (0.3, 0.3)))
    learned = policy.Learned(alone={"ja": (1, 1.0), "jb": (1, 1.0)}, bw={("mps", 4): (3, 1.0)},
                             corun={("ja", "jb", "mps"): (3, 1.3), ("jb", "ja", "mps"): (3, 1.3)})
    r = sim.simulate([sim.SimJob(1, a, budget=GiB), sim.SimJob(2, b, budget=GiB)], "colo", truth=truth, learned=learned)
    assert [(j["start"], j["end"]) for j in r.jobs] == [(0.0, pytest.approx(430.0)), (0.0, pytest.approx(130.0))]
    assert learned.errors == [pytest.approx(1.0, abs=0.01)] * 2


def test_the_share_of_a_run_spent_beside_others_is_counted_and_too_little_teaches_nothing():
    e = policy.expectation({"predicted_slowdown": 1.3, "peak_membw": 0.5, "residents": {"mps": {"1": (1.3, 1.0, 0.0)}}},
                           "mps", 0.0)
    e = policy.left(e, 130.0)  # its neighbour ended: alone from then on
    assert policy.shared(e, 0.0, 430.0) == pytest.approx(130 / 430)
    assert policy.expected(e, 0.0, 430.0)[0] == pytest.approx(430 / 400)
    assert policy.left(e, 200.0) == e  # alone already
    lr = policy.Learned(alone={"ja": (1, 1.0)})
    # beside others for a twentieth of its run, 2x slower than predicted: too little of it to tell sharing's cost
    assert lr.observe("ja", ["jb"], "mps", 1.0, 200.0, 100.0, group_bw=0.9, shared=0.05) is None
    assert lr.errors == [] and not lr.explored("mps", 0.9)
    assert lr.observe("ja", ["jb"], "mps", 1.0, 200.0, 100.0, group_bw=0.9, shared=0.5) == pytest.approx(2.0)


# ---- a simulator that does not tilt (issue 30) ----------------------------------------------------

def test_smooth_truth_keeps_the_mps_study_pairs_and_two_saturating_jobs_cost_3_percent_time_sliced():
    exact = simtruth.Truth("smooth", spreads=simtruth.NO_SPREAD)
    for kind, mps, ts in (("light", 0.74, 1.50), ("heavy", 223.6, 61.5)):
        c = simtruth.smooth_pair(kind)
        p = flat(f"sm-{kind}", c["sm"], c["membw"], c["runtime"], c["cache_bound"])
        assert sim.simulate(pair(p), "mps-all", truth=exact).makespan == pytest.approx(mps, rel=1e-3), kind
        assert sim.simulate(pair(p), "naive", truth=exact).makespan == pytest.approx(ts, rel=1e-3), kind
    sat = flat("sat", 1.0, 0.2, 100)
    assert sim.simulate(pair(sat), "naive", truth=exact).makespan == pytest.approx(200 / 0.97)  # 3 % past back to back
    # no knee: each more light job costs a little more, from the first
    rates = [simtruth.smooth_rates(np.full(n, 0.2), np.full(n, 0.15), np.zeros(n, bool), np.ones(n, bool))[0, 0]
             for n in range(1, 8)]
    assert rates[0] == 1.0 and all(a > b for a, b in zip(rates, rates[1:]))


def test_h200_truth_reproduces_what_the_h200_measured_through_the_simulator():
    """bench/results/gpu-2026-11-28: 6 light PyTorch jobs (NVML SM 2.8 %) one after another vs all at
    once time-sliced 5.25x; a saturating matmul pair back to back vs time-sliced 1.21x, vs MPS 1.33x;
    each within 10 %, as the simulator runs them (the fit: colo/sched/truth_h200.json)."""
    h200 = simtruth.Truth("h200", spreads=simtruth.NO_SPREAD)
    alone = [5.38, 5.76, 5.88, 6.29, 5.46, 5.66]  # run3's per-job alone times
    light = [sim.SimJob(i, flat(f"light{i}", 0.028, 0.0, a, mem=GiB), budget=2 * GiB) for i, a in enumerate(alone)]
    serial = sim.simulate(light, "exclusive-fifo", truth=h200).makespan
    assert serial == pytest.approx(sum(alone), rel=1e-6)
    assert serial / sim.simulate(light, "naive", truth=h200).makespan == pytest.approx(5.25, rel=0.10)
    sat = flat("sat", 1.0, 0.0, 5.4)
    for policy_name, measured in (("naive", 1.21), ("mps-all", 1.33)):
        assert 10.8 / sim.simulate(pair(sat), policy_name, truth=h200).makespan == pytest.approx(measured, rel=0.10)
    # its node: contexts hold what the H200 showed (NVML: 518 MiB over the ledger; the MPS server 66 MiB)
    assert 500 * 2**20 < h200.ctx_mem < 560 * 2**20 and h200.mps_server_mem < 100 * 2**20


def test_every_attempt_counts_in_slowdown():
    grow = Profile(name="grow", step=10, sm=np.full(10, 0.2), membw=np.full(10, 0.1),
                   mem=(np.linspace(1, 4, 10) * GiB).astype(np.int64), runtime=100)
    r = sim.simulate([sim.SimJob(1, grow, budget=3 * GiB)], "colo", grow=True, config=policy.PolicyConfig(lend=1.0))
    j = r.jobs[0]
    assert j["ooms"] == 1 and j["state"] == "done" and j["ran"] == pytest.approx(j["end"] - 0.0)
    assert r.max_slowdown == pytest.approx(j["ran"] / 100.0) and r.max_slowdown > 1.5  # the refused run counts


def test_baselines_learn_a_job_without_a_profile_from_its_run_as_colo_does():
    """Unknown jobs: the packers count one as a whole GPU until a run of it was sampled, then
    pack it by what that run showed (before, only colo ever learned them)."""
    thin = flat("thin", 0.2, 0.1, 100)
    jobs = [sim.SimJob(i, thin, budget=2 * GiB, known=False) for i in (1, 2, 3)]
    r = sim.simulate(jobs, "tetris", truth=simtruth.Truth("exact"))
    starts = sorted(j["start"] for j in r.jobs)
    assert starts[0] == 0.0 and starts[1] > 0.0 and starts[2] == starts[1]  # the 2nd and 3rd beside each other


def test_a_job_without_a_profile_gets_a_provisional_one_within_its_first_minute():
    """colo samples a running job that has no profile and places queued jobs of it beside it from
    what its first PROVISIONAL_AFTER seconds showed, instead of after its end."""
    thin = flat("thin", 0.1, 0.05, 600)
    jobs = [sim.SimJob(i, thin, budget=2 * GiB, known=False) for i in (1, 2, 3)]
    r = sim.simulate(jobs, "colo", truth=simtruth.Truth("exact"))
    starts = sorted(j["start"] for j in r.jobs)
    assert starts[0] == 0.0 and starts[-1] <= 60.0, starts
    assert r.lost == 0 and r.max_slowdown <= 1.5 + 1e-9  # as predicted (the first is time-sliced beside them)


def test_a_job_loading_its_data_does_not_speak_for_its_family_until_it_computes():
    """A first run idle for 90 s (loading), then saturating: the provisional profile of its idle
    minute said it costs nothing, and its family joined it, all slowed past the bound once they
    computed (the h200 truth's fits mix with every profile unknown: p95 1.82x). Now they wait
    until it has shown what it does."""
    loads = Profile(name="loads", step=10.0, sm=np.where(np.arange(30) < 9, 0.0, 1.0), mem=np.full(30, GiB),
                    membw=np.where(np.arange(30) < 9, 0.0, 0.5), runtime=300.0)
    jobs = [sim.SimJob(i, loads, budget=2 * GiB, known=False) for i in (1, 2, 3)]
    r = sim.simulate(jobs, "colo", truth=simtruth.Truth("exact"))
    assert r.lost == 0 and r.max_slowdown <= 1.5 + 1e-9, sorted((j["start"], j["end"]) for j in r.jobs)
    assert min(j["start"] for j in r.jobs if j["id"] != 1) >= 90.0  # none joined it while it loaded


def test_a_family_on_its_first_minute_is_watched_and_a_level_it_runs_at_opens_the_next():
    """Three jobs of a family nobody profiled, 0.35 SM each. The second joins the first on the
    provisional profile its first half minute made, at the one step past the levels known to cost
    nothing (0.7); the third (1.05) is one step past that. The watch sees the pair take turns at
    0.7 as predicted within LIVE_MIN and the third joins then, not at the first end 10 minutes later
    (issue 39: provisional groups were not watched, and a family's first run was its only teacher)."""
    steady = flat("steady", 0.35, 0.1, 600)
    jobs = [sim.SimJob(i, steady, budget=2 * GiB, known=False) for i in (1, 2, 3)]
    r = sim.simulate(jobs, "colo", truth=simtruth.Truth("exact"))
    starts = sorted(j["start"] for j in r.jobs)
    assert starts[:2] == [0.0, 30.0] and starts[2] <= 30.0 + 2 * learning.LIVE_MIN, starts
    assert r.lost == 0 and r.max_slowdown <= 1.0 + 1e-9


def test_the_first_running_job_of_a_family_speaks_for_it_while_it_runs():
    """As in the daemon: the second of a family, started beside the first, samples only its share
    of the GPU. Under `study` (taking turns costs 2x) it read 0.2 SM where the first read 0.43,
    its provisional profile replaced the first's, and a third joined at 60 s into a pair already
    running 2x slow."""
    steady = flat("steady", 0.35, 0.1, 600)
    jobs = [sim.SimJob(i, steady, budget=2 * GiB, known=False) for i in (1, 2, 3)]
    r = sim.simulate(jobs, "colo", truth=simtruth.Truth("study", 0))
    by = {j["id"]: j for j in r.jobs}
    assert by[2]["start"] == 30.0 and by[3]["start"] >= by[1]["end"], by


def test_contexts_take_device_memory_outside_the_budgets():
    """A time-sliced job's own context (CTX_MEM, which a profile sampled alone holds) against an
    MPS client's smaller one beside its server's: two jobs whose profiles sum to just past the GPU
    run out of it time-sliced and fit under MPS."""
    big = flat("big", 0.2, 0.1, 100, mem=int(6.05 * GiB))
    truth = simtruth.Truth("noisy", 0, simtruth.Spreads((1, 1), (1, 1), (1, 1), 0.0, (1, 1), (0, 0)))
    assert sim.simulate(pair(big, budget=7 * GiB), "naive", truth=truth).oom > 0
    assert sim.simulate(pair(big, budget=7 * GiB), "mps-all", truth=truth).oom == 0
    # `exact` has no contexts: each job holds its profile's memory whatever its mode
    assert sim.simulate(pair(big, budget=7 * GiB), "mps-all", truth=simtruth.Truth("exact")).oom > 0


def test_nvml_gives_mps_clients_their_servers_activity_split_unless_told():
    """A first run learned under MPS beside another job: the driver gives the server's SM, split
    equally among its clients (as the daemon apportions it), not the job's own."""
    busy, quiet = flat("busy", 0.6, 0.1, 100), flat("quiet", 0.1, 0.1, 100)
    jobs = [sim.SimJob(1, busy, budget=GiB, known=False), sim.SimJob(2, quiet, budget=GiB, known=False)]
    for per_client, want in ((False, 0.35), (True, 0.1)):
        got = {}
        t = simtruth.Truth("noisy", 0, simtruth.Spreads((1, 1), (1, 1), (1, 1), 0.0, (1, 1), (0, 0)),
                           nvml_per_client=per_client, sample_noise=0.0)
        sim.simulate(jobs, "mps-all", truth=t, profiles=got)  # the baselines learn as colo does
        assert got["quiet"].mean_sm == pytest.approx(want, abs=0.01), per_client


def test_the_daemon_and_the_simulator_learn_the_same_from_the_same_runs(monkeypatch):
    """One end-of-job rule (colo/sched/learning.py): every end the simulator taught, fed again as
    the daemon's learner feeds it (its stored decision through JSON, the job's Mode, its start and
    end, sorted neighbour names; then the profile's merged alone time), gives the same learned
    state, field by field."""
    import copy

    from colo.jobs import Mode
    from colo.sched import learning

    events, end_of_job, profile_learned = [], learning.end_of_job, learning.profile_learned

    def spy_end(learned, *args):
        events.append(("end", copy.deepcopy(args)))
        return end_of_job(learned, *args)

    def spy_profile(learned, *args):
        events.append(("profile", args))
        return profile_learned(learned, *args)

    monkeypatch.setattr(learning, "end_of_job", spy_end)
    monkeypatch.setattr(learning, "profile_learned", spy_profile)
    w = sim.make_mix("memory-light", 3)
    learned, profiles = policy.Learned(), {}
    for jobs in (w.jobs[:1], w.jobs[:12]):  # one alone, then a crowd
        sim.simulate(jobs, "colo", 1, w.gpu_mem, truth=simtruth.Truth("h200", 3), grow=True, learned=learned,
                     profiles=profiles)
    ends = [a for k, a in events if k == "end"]
    assert len(ends) >= 5 and any(a[1] for a in ends) and any(not a[1] for a in ends)
    daemon = policy.Learned()
    for kind, args in events:
        if kind == "profile":
            profile_learned(daemon, *args)
            continue
        name, nb, mode, decision, start, end, runtime, peak = args
        stored = json.loads(json.dumps(decision))  # as store.decision() gives it back
        end_of_job(daemon, name, sorted(set(nb)), Mode(mode), stored, start, end, runtime, peak)
    for f in ("corun", "alone", "errors", "errors_seen", "bw", "max_mem", "clock"):
        assert getattr(daemon, f) == getattr(learned, f), f
