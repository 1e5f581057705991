"""Issue 13 items 3-4: what the daemon learns from jobs' ends is stored, so a restart (SIGKILL
included) does not forget it, and jobs that shared a GPU across a restart are still known to
have shared it; the neighbour sets it learns from are bounded and pruned."""
from __future__ import annotations

import json
import sqlite3

import pytest

from colo.jobs import JobSpec, State
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
