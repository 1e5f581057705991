"""Issue 13 items 3-4: what the daemon learns from jobs' ends is stored, so a restart (SIGKILL
included) does not forget it, and jobs that shared a GPU across a restart are still known to
have shared it; the neighbour sets it learns from are bounded and pruned."""
from __future__ import annotations

import json
import sqlite3

import pytest

from colo.config import Config
from colo.daemon.jobtable import JobTable
from colo.daemon.learner import Learner, stored_learning
from colo.jobs import JobSpec, State
from colo.sched import policy
from colo.store import MIGRATIONS, Store
from harness.daemon import burn, wait_for

GiB, MiB = 1024**3, 1024**2


# pair: two of them share the GPU under MPS; 2 s alone. The test starts the daemon.
pytestmark = pytest.mark.node(
    "colo-learn-", profiles={"pair": dict(sm=0.3, mem=256 * MiB, membw=0.2, runtime=2.0)},
    then=lambda n: n.daemon({"profile_dirs": [str(n.prof)], "mps_idle_stop": 600.0}, start=False))


def test_what_was_learned_survives_a_sigkill_of_the_daemon(node):
    d = node.start()
    alone = d.submit("--process", "--gpu-mem", "1GiB", "--profile", "pair",
                     *burn(d, "--mem", "300MiB", "--duty", "30", "--seconds", "2"))
    d.wait_state(alone, "succeeded", timeout=60)
    # a shared pair that runs across a SIGKILL of the daemon (4 s at least, then until the gate)
    gate = d.root / "go"
    pair = ["--process", "--gpu-mem", "1GiB", "--profile", "pair", "--", "sh", "-c",
            f"{burn(d)[1]} --mem 256MiB --duty 30 --seconds 600 --quiet & b=$!; sleep 4; "
            f"while [ ! -e {gate} ]; do sleep 0.05; done; kill $b; wait $b; exit 0"]
    a, b = d.submit(*pair), d.submit(*pair)
    for j in (a, b):
        assert d.wait_state(j, "running", timeout=60)["mode"] == "mps"
    # the second to start predicted the first's rest beside it: the first's end is compared with that too
    db = sqlite3.connect(d.state_dir / "colo.db")
    stored = [json.loads(db.execute("SELECT details FROM decisions WHERE job_id=?", (j,)).fetchone()[0]) for j in (a, b)]
    db.close()
    assert sum("expect" in x for x in stored) == 1, stored
    d.kill9()
    d.start()
    gate.touch()
    for j in (a, b):
        d.wait_state(j, "succeeded", timeout=60)

    def learned():
        return json.loads(d.cli("profile", "show", "pair", "--json", check=True).stdout)["learned"]

    before = wait_for(lambda: (lr := learned()).get("corun") and lr["corun"][0]["runs"] == 2 and lr,
                      60, "both shared runs to be learned")
    # the uncontended run only: the restarted daemon knew the pair had shared the GPU
    assert before["alone"]["runs"] == 1
    assert json.loads(d.cli("profile", "show", "pair", "--json", check=True).stdout)["runs"] == 2  # stored + alone
    assert before["max_mem"] >= 300 * MiB and before["suggested_budget"] == 512 * MiB  # 300 MiB + 10 %, 256 MiB steps
    assert [(c["with"], c["mode"]) for c in before["corun"]] == [("pair", "mps")]
    assert before["errors"] == 2  # both shared runs' error against the prediction
    explained = d.cli("explain", str(a), check=True).stdout
    assert "observed" in explained and "shared with pair" in explained, explained
    db = sqlite3.connect(d.state_dir / "colo.db")
    assert db.execute("SELECT count(*) FROM job_neighbours").fetchone()[0] == 0  # forgotten at the ends
    db.close()

    d.kill9()
    d.start()
    assert learned() == before  # the same figures, read back from the store
    shown = d.cli("profile", "show", "pair", check=True).stdout
    assert "# learned: beside pair (mps) it ran" in shown and "suggested budget 512MiB" in shown, shown
    assert d.cli("explain", str(a), check=True).stdout == explained
    # and the next pair is planned with it: its decision carries the learned co-run factor
    c = d.submit("--process", "--gpu-mem", "1GiB", "--profile", "pair", *burn(d, "--mem", "256MiB", "--duty", "30", "--seconds", "30"))
    d.wait_state(c, "running", timeout=60)
    e = d.submit("--process", "--gpu-mem", "1GiB", "--profile", "pair", "--", "true")
    factor = before["corun"][0]["factor"]
    db = sqlite3.connect(d.state_dir / "colo.db")  # the bandwidth curve's steps the restart read back
    curve = db.execute("SELECT max(factor) FROM learned_bw WHERE mode='mps'").fetchone()[0] or 1.0
    db.close()
    got = wait_for(lambda: (d.client.explain(e)["decision"] or {}).get("details", {}).get("learned_factor"),
                   60, "a decision for the second job")
    assert got["mps"] == pytest.approx(max(1.0, factor) * max(1.0, curve)), got
    # e's pairing had been seen: its error sizes the seen pairings' margin, and a restart keeps it
    d.wait_state(e, "succeeded", timeout=60)
    # the seen pairings' own errors (they size the margin of pairings runs have shown) are read
    # back at a start, not replaced by the margin of all errors until five more arrive
    d.kill9()
    uid = next(iter(Store(d.state_dir / "colo.db").learned()))
    st = Store(d.state_dir / "colo.db")
    st.save_learned(uid, errors_seen=[1.3] * 6)
    st.close()
    d.start()
    got = learned()
    assert got["seen_errors"] == 6 and got["seen_margin"] == pytest.approx(0.3), got



def test_a_job_whose_neighbour_ended_is_compared_with_running_alone_from_then_on(node):
    """As colo sim (policy.left): when a job's last neighbour ends, its stored prediction says it
    runs alone from then on, and its end counts only the shared stretch as shared."""
    d = node.start()
    gate = d.root / "go-left"
    long = ["--process", "--gpu-mem", "1GiB", "--profile", "pair", "--", "sh", "-c",
            f"while [ ! -e {gate} ]; do sleep 0.05; done"]
    a = d.submit(*long)
    d.wait_state(a, "running", timeout=60)
    b = d.submit("--process", "--gpu-mem", "1GiB", "--profile", "pair", "--", "sleep", "1")
    assert d.wait_state(b, "succeeded", timeout=60)["mode"] == "mps"

    def expect():
        db = sqlite3.connect(d.state_dir / "colo.db")
        got = json.loads(db.execute("SELECT details FROM decisions WHERE job_id=?", (a,)).fetchone()[0])
        db.close()
        return got.get("expect")

    e = wait_for(lambda: (x := expect()) and x.get("sharing") is False and x, 60, "b's end to leave a alone")
    assert e["slowdown"] == 1.0 and 0.5 < e["shared"] < 30, e  # beside b for about its second
    gate.touch()
    d.wait_state(a, "succeeded", timeout=60)


def test_schema_4_keeps_an_older_database_and_bounds_neighbours(tmp_path):
    path = tmp_path / "colo.db"
    db = sqlite3.connect(path)
    for i in range(3):  # a colo of schema 3 made it, with a job in it
        db.executescript(f"BEGIN;{MIGRATIONS[i]};PRAGMA user_version={i + 1};COMMIT;")
    spec = JobSpec(argv=["true"], gpu_mem=GiB)
    db.execute("INSERT INTO jobs(spec, uid, gid, user, state, submitted_at) VALUES (?,0,0,'root','queued',1.0)",
               (json.dumps(spec.to_dict()),))
    db.commit()
    db.close()
    st = Store(path)
    assert st.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert [j.id for j in st.jobs()] == [1]
    st.save_learned(0, corun={("a", "b", "mps"): (2, 1.3)}, alone={"a": (1, 1.1)}, max_mem={"a": 5, "b": 7},
                    errors=[1.2, 1.4], now=1.0)
    st.save_learned(0, corun={("a", "c", "mps"): (1, 1.5)}, forget_mem=["b"], now=2.0)
    st.save_learned(0, bw={("mps", 7): (2, 1.8), ("timesliced", 3): (1, 1.1)}, now=3.0)
    st.save_learned(0, bw={("mps", 7): (3, 1.6)}, now=4.0)
    assert st.learned() == {0: {"corun": {("a", "b", "mps"): (2, 1.3), ("a", "c", "mps"): (1, 1.5)},
                                "alone": {"a": (1, 1.1)}, "max_mem": {"a": 5}, "errors": [1.2, 1.4],
                                "errors_seen": [], "bw": {("timesliced", 3): (1, 1.1), ("mps", 7): (3, 1.6)},
                                "clock": 0, "at": {}, "ts": {}, "ts_slow": {}, "live": {}}}
    st.save_learned(0, errors_add=[1.5], errors_keep=2)  # one more error, the newest 2 kept
    assert st.learned()[0]["errors"] == [1.4, 1.5]
    # the seen pairings' errors are a list of their own (schema 6): kept and trimmed apart
    st.save_learned(0, errors_seen=[1.1, 1.05, 1.3])
    st.save_learned(0, errors_add=[1.6], errors_keep=2, errors_seen_add=[1.02], errors_seen_keep=3)
    assert st.learned()[0]["errors"] == [1.5, 1.6] and st.learned()[0]["errors_seen"] == [1.05, 1.3, 1.02]
    # a running job keeps at most `most` neighbour names; an ended one's are pruned
    st.transition(1, State.STARTING)
    st.add_neighbours([(1, f"p{i}") for i in range(10)], most=3)
    assert len(st.neighbours(1)) == 3
    assert st.prune_neighbours([State.SUCCEEDED, State.FAILED]) == 0
    st.transition(1, State.FAILED, "x")
    assert st.prune_neighbours([State.SUCCEEDED, State.FAILED]) == 3 and st.neighbours(1) == set()
    st.close()


def test_error_list_changes_are_stored_as_appends():
    from colo.daemon.learner import _errors_delta

    assert _errors_delta([], [1.0]) == ([1.0], [])  # first: the whole list
    assert _errors_delta([1.0], [1.0, 2.0]) == (None, [2.0])
    assert _errors_delta([1.0, 2.0, 3.0], [2.0, 3.0, 4.0]) == (None, [4.0])  # full: the oldest dropped
    assert _errors_delta([1.0, 2.0], [1.0, 2.0]) == (None, [])
    assert _errors_delta([1.0, 2.0], [7.0]) == ([7.0], [])  # replaced wholesale: stored whole
    assert _errors_delta([1.0, 2.0], [2.0]) == ([2.0], [])  # shrunk: stored whole


# light contexts (30 % SM each), time-sliced (no MPS): two take turns at 60 % summed SM, one job
# past KNOWN_TS (50 %). `rest` runs until the test lets it end, the others 1 s
@pytest.mark.node("colo-turns-", profiles={name: dict(sm=0.3, mem=256 * MiB, membw=0.1, runtime=runtime)
                                           for name, runtime in (("rest", 600.0), ("slow", 1.0), ("probe", 1.0))},
                  then=lambda n: n.daemon({"profile_dirs": [str(n.prof)], "use_mps": False}, start=False))
def test_a_level_of_taking_turns_learned_survives_a_sigkill_of_the_daemon(node):
    """Issue 39: what the daemon learned of taking turns (here: a group at 60 % summed SM ran far
    slower than predicted, so no share goes there while that is recent) is stored, and a daemon
    restarted after a SIGKILL decides as the one before it did, not as a cold one (which steps one
    job past KNOWN_TS and starts the share again). Corrupt stored values are refused with a log line."""
    d = node.start()
    gate = d.root / "go"
    job = ["--process", "--gpu-mem", "1GiB", "--profile"]
    rest = d.submit(*job, "rest", "--", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done")
    d.wait_state(rest, "running", timeout=60)
    # cold, a second light context is one job past KNOWN_TS: it starts, a step. Its profile says
    # 1 s and it takes 4: far past the margin's cap, so its end takes that level back
    slow = d.submit(*job, "slow", "--", "sleep", "4")
    assert d.wait_state(slow, "running", timeout=60)["mode"] == "timesliced"
    started = d.client.explain(slow)["decision"]["details"]
    assert started["ts_step"] and started["ts_level"] == pytest.approx(0.6), started
    d.wait_state(slow, "succeeded", timeout=60)
    wait_for(lambda: json.loads(d.cli("profile", "show", "slow", "--json", check=True).stdout)["learned"].get("errors"),
             60, "slow's end to be learned")

    def decided(j):
        got = d.client.explain(j)
        return got["decision"] and got["decision"]["action"] in ("wait", "start") and got["decision"]

    probe = d.submit(*job, "probe", "--", "true")
    before = wait_for(lambda: decided(probe), 60, "a decision for the probe")
    assert before["action"] == "wait" and "where one ran slower lately" in before["reason"], before
    d.client.cancel(probe)
    d.wait_state(probe, "cancelled", timeout=60)

    def restarted(damage=None) -> dict:
        d.kill9()
        if damage:
            db = sqlite3.connect(d.state_dir / "colo.db")
            damage(db)
            db.commit()
            db.close()
        d.start()
        j = d.submit(*job, "probe", "--", "true")
        got = wait_for(lambda: decided(j), 60, "a decision for the probe after the restart")
        assert got["action"] == "wait", got  # a cold daemon starts it: time-sliced, one job past KNOWN_TS
        assert got["reason"] == before["reason"] and got["details"]["ts_level"] == before["details"]["ts_level"]
        d.client.cancel(j)
        d.wait_state(j, "cancelled", timeout=60)
        return got

    restarted()
    # damaged rows beside it (a level out of range, a warning's level that is no number): each
    # refused and said in the log, the rest used
    db = sqlite3.connect(d.state_dir / "colo.db")
    assert db.execute("SELECT slow, bin FROM learned_ts").fetchall() == [(1, 2)]
    uid = db.execute("SELECT uid FROM learned_ts").fetchone()[0]
    db.close()

    def damage(db):
        db.execute("INSERT INTO learned_ts(uid, slow, bin, clock) VALUES (?, 0, 99, 1)", (uid,))
        db.execute("INSERT INTO learned_live(uid, mode, bin, level, clock) VALUES (?, 'mps', 3, 'x', 1)", (uid,))

    restarted(damage)
    log = d.log.read_text()
    assert "2 stored value(s) refused, corrupt or out of range" in log and "learned_ts 99" in log, log[-3000:]
    again = d.submit(*job, "probe", "--", "true")
    gate.touch()
    d.wait_state(rest, "succeeded", timeout=60)
    d.wait_state(again, "succeeded", timeout=60)  # alone, it starts


def _learner(path) -> Learner:
    """The daemon's learner on the store at `path` (no GPUs: learning and loading never read them)."""
    return Learner(Config(state_dir=path.parent), JobTable(Store(path)), None, policy.PolicyConfig())


def test_a_restarted_learner_holds_everything_the_one_before_it_learned(tmp_path):
    """Every field of policy.Learned plan() reads (co-run factors, alone times, errors, memory,
    the bandwidth curve, the observation clock and each entry's age, the early warnings, the
    levels of taking turns explored and those a group ran slower at) is read back equal, and a
    verdict that changes nothing writes nothing (bounded writes: not per tick)."""
    path = tmp_path / "colo.db"
    lr = _learner(path)
    lr._learning(0, lambda m: m.observe("a", ["b"], "mps", 1.0, 3.0, 1.0, peak_mem=5, group_bw=0.9, unseen=1.0))
    lr._learning(0, lambda m: m.observe("a", [], "mps", 1.0, 1.1, 1.0))
    lr._learning(0, lambda m: m.observe_live("timesliced", 0.3, 0.8, 0.8, 30.0, 1.1))  # 1.1 explored
    lr._learning(0, lambda m: m.observe("c", ["a"], "timesliced", 1.0, 4.0, 1.0, group_sm=0.6))  # slower at 0.6
    lr._learning(0, lambda m: m.observe_live("mps", 0.9, 0.8, 0.2, 60.0))  # an early warning
    lr._learning(7, lambda m: m.observe_live("timesliced", 0.3, 0.8, 0.8, 30.0, 0.8))
    mine = lr.learned[0]
    assert mine.clock == 3 and mine.ts_slow == {2: 3} and mine.live and mine.bw and mine.at, mine
    writes = lr.store.db.total_changes
    lr._learning(7, lambda m: m.observe_live("timesliced", 0.3, 0.8, 0.8, 30.0, 0.8))  # the same verdict again
    assert lr.store.db.total_changes == writes
    again = _learner(path)
    again.load()
    assert again.learned == lr.learned
    assert again.learned[0].ts_beyond(0.6, 0.3) and not policy.Learned().ts_beyond(0.6, 0.3)


def test_schema_14_reads_what_schema_13_learned_and_refuses_what_is_out_of_range(tmp_path, caplog):
    """A database of the previous schema (13) migrates: its learning is read as before (no clock,
    no age: as old as the count's start, as a daemon of that schema read it), and the new state is
    stored beside it. Stored values out of range are refused, one log line per user, the rest used."""
    path = tmp_path / "colo.db"
    db = sqlite3.connect(path)
    for i in range(13):
        step = MIGRATIONS[i]
        if callable(step):
            db.execute("BEGIN")
            step(db)
            db.execute(f"PRAGMA user_version={i + 1}")
            db.commit()
        else:
            db.executescript(f"BEGIN;{step};PRAGMA user_version={i + 1};COMMIT;")
    db.execute("INSERT INTO learned_corun VALUES (0, 'a', 'b', 'mps', 2, 1.3, 1.0)")
    db.execute("INSERT INTO learned_bw VALUES (0, 'mps', 7, 1, 1.6, 2.0)")
    db.commit()
    db.close()
    lr = _learner(path)
    assert lr.store.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) == 14
    lr.load()
    assert lr.learned == {0: policy.Learned(corun={("a", "b", "mps"): (2, 1.3)}, bw={("mps", 7): (1, 1.6)})}
    lr._learning(0, lambda m: m.observe("c", ["a"], "timesliced", 1.0, 4.0, 1.0, group_sm=0.6))
    # damaged values beside good ones
    db = lr.store.db
    db.execute("INSERT INTO learned_ts(uid, slow, bin, clock) VALUES (0, 0, 41, 1), (0, 0, 'two', 1), (0, 0, 1, 5)")
    db.execute("INSERT INTO learned_live(uid, mode, bin, level, clock) VALUES (0, 'mps', 3, 'nan', 1), (0, 'mps', 4, 0.5, 1)")
    db.execute("UPDATE learned_corun SET factor='big' WHERE neighbour='b'")
    db.commit()
    again = _learner(path)
    with caplog.at_level("WARNING", logger="colo"):
        again.load()
    got = again.learned[0]
    assert got.ts_slow == {2: 1} and got.ts == {} and got.live == {} and got.clock == 1
    assert ("a", "b", "mps") not in got.corun and ("c", "a", "timesliced") in got.corun
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "6 stored value(s) refused" in lines[0] and "learned_ts 41" in lines[0], lines


def test_stored_learning_refuses_each_value_out_of_its_range():
    got = {"corun": {("a", "b", "mps"): (2, 1.3), ("a", "b", "hmm"): (1, 1.0), ("a", "c", "mps"): (0, 1.0)},
           "alone": {"a": (1, 1.1), "b": (1, float("inf"))}, "max_mem": {"a": 5, "b": -1},
           "errors": [1.2, "x", -1.0], "errors_seen": [1.1], "bw": {("mps", 7): (1, 1.6), ("mps", 31): (1, 1.0)},
           "clock": "3", "at": {("a", "b", "mps"): 2, ("mps", 7): -2}, "ts": {2: 1, 3: 2.5}, "ts_slow": {},
           "live": {("mps", 3): (1.5, 2), ("mps", 4): (0.9, 1)}}
    out, refused = stored_learning(got)
    assert out == dict(corun={("a", "b", "mps"): (2, 1.3)}, alone={"a": (1, 1.1)}, max_mem={"a": 5}, errors=[1.2],
                       errors_seen=[1.1], bw={("mps", 7): (1, 1.6)}, clock=2, at={("a", "b", "mps"): 2},
                       ts={2: 1}, ts_slow={}, live={("mps", 3): (1.5, 2)})
    assert len(refused) == 11, refused  # the clock refused is the newest any entry was taught at
