"""`colo ls` on a long queue (issue 12 item 5): the daemon filters (user, state, name, open or all),
picks the newest --limit and sends only the fields the columns print; a terminal gets at most
lsview.TTY_ROWS rows (the running jobs, then the front of the queue) and a line saying what was
left out, a pipe every job; `--json` stays complete. A real daemon, the real CLI (both its short
path and the typer command), a real second user.
"""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

from colo import protocol, replies
from colo.client import Client, ClientError
from colo.jobs import JobSpec, State
from colo.cli.lsview import TTY_ROWS
from colo.store import Store
from harness.daemon import as_user, on_tty, wait_for

import pytest


def test_ls_filters_in_the_daemon_and_bounds_a_terminal(shared, other_user):
    d, c = shared, shared.client
    gate = d.root / "go"
    prep = d.submit("--process", "--gpus", "0", "--name", "prep", "--", "true")
    bad = d.submit("--process", "--gpus", "0", "--name", "bad", "--", "sh", "-c", "exit 3")
    run = d.submit("--process", "--gpus", "0", "--name", "gate", "--", "sh", "-c",
                   f"while [ ! -e {gate} ]; do sleep 0.05; done")
    d.wait_state(prep, "succeeded")
    d.wait_state(bad, "failed")
    d.wait_state(run, "running")
    # more jobs than a terminal is shown, all waiting for the gate
    spec = {"argv": ["true"], "gpus": 0, "workdir": "/tmp", "after": [run]}
    waiting = [c.submit({**spec, "name": f"w{i}"})["id"] for i in range(TTY_ROWS + 5)]
    kind, theirs = as_user(other_user, lambda: Client(d.socket).submit({**spec, "name": "theirs"})["id"])
    assert kind == "ok", theirs
    open_ids = [run, *waiting, theirs]

    def q(*args: str) -> list[int]:
        return [int(x) for x in d.cli("ls", "-q", *args, check=True).stdout.split()]

    # filters, each answered by the daemon (ended jobs from the database)
    assert q() == open_ids
    assert q("--all") == [prep, bad, *open_ids]
    assert q("-u", other_user.pw_name) == [theirs]
    assert q("-s", "failed") == [bad]
    assert q("--all", "-n", "gate", "-n", "prep") == [prep, run]
    assert q("-s", "succeeded", "-s", "running") == [prep, run]
    assert q("--all", "--limit", "3") == open_ids[-3:]
    assert q("--all", "-u", "nobody") == []
    assert q("prep", str(run)) == [prep, run] and q("nosuch") == []  # jobs named on the line: ended ones too
    # the daemon's compact reply: only the fields asked for, texts cut, at most `head` jobs
    r = c.ls_fields(["id", "state", "argv", "reason"], all=False, cut=5, head=10)
    assert [row[0] for row in r["rows"]] == [run, *waiting[:9]] and r["left"] == {"queued": len(open_ids) - 10}
    assert r["rows"][0] == [run, "running", "sh -c", "start"]
    assert c.ls_fields(["id"], all=True, head=2)["rows"] == [[run], [waiting[0]]]
    # piped: every job; on a terminal: the running one, the front of the queue, and what was left out
    piped = d.cli("ls", check=True).stdout.splitlines()
    assert piped[0].split() == ["ID", "NAME", "USER", "STATE", "GPU", "MODE", "BUDGET", "AGE", "REASON"]
    assert [int(ln.split()[0]) for ln in piped[1:]] == open_ids
    shown = on_tty(d, "ls")
    assert len(shown) == TTY_ROWS + 2, shown[-3:]
    assert [int(ln.split()[0]) for ln in shown[1:-1]] == open_ids[:TTY_ROWS]
    left = len(open_ids) - TTY_ROWS
    assert shown[-1].startswith(f"... {left} more jobs not shown ({left} queued)") and "--limit 0" in shown[-1], shown[-1]
    assert len(on_tty(d, "ls", "--limit", "0")) == len(open_ids) + 1
    assert len(on_tty(d, "ls", "-q")) == len(open_ids)
    # the short path and the typer command print the same
    args = ["ls", "--all", "-o", "id,name,user,state,exit,priority,command,budget", "--limit", "4"]
    typer_out = subprocess.run([sys.executable, "-m", "colo.cli.app", *args], capture_output=True, text=True,
                               env=d.env(), check=True).stdout
    assert typer_out == d.cli(*args, check=True).stdout
    assert [ln.split()[:4] for ln in typer_out.splitlines()[1:]] == [
        [str(waiting[-3]), f"w{TTY_ROWS + 2}", "root", "queued"], [str(waiting[-2]), f"w{TTY_ROWS + 3}", "root", "queued"],
        [str(waiting[-1]), f"w{TTY_ROWS + 4}", "root", "queued"], [str(theirs), "theirs", other_user.pw_name, "queued"]]
    # --json: every job whole, as before (filtered by the daemon)
    rows = json.loads(d.cli("ls", "--all", "-n", "prep", "-n", "gate", "--json", check=True).stdout)
    assert [j["id"] for j in rows] == [prep, run] and rows[0]["exit_code"] == 0 and rows[1]["argv"][0] == "sh"
    assert set(rows[0]) >= {"id", "name", "user", "uid", "state", "gpus", "mode", "budget", "argv", "reason",
                            "submitted_at", "started_at", "ended_at", "exit_code", "priority", "held_by"}
    assert rows[0] == c.ls(names=["prep"])[0]
    # what the daemon sends has the shapes colo/replies.py declares for the client
    top, summary = c.top(), replies.keys(replies.JobSummary)
    assert set(top) == replies.keys(replies.TopReply) and top["gpus"]
    assert all(set(g) == replies.keys(replies.GpuRow) for g in top["gpus"])
    for j in [*top["jobs"], *rows]:
        assert replies.JobSummary.__required_keys__ <= set(j) <= summary, set(j) ^ summary


def test_ls_arguments_are_checked(daemon):
    c = daemon.client
    for args, said in [({"states": ["bogus"]}, "unknown ls state 'bogus'"),
                       ({"fields": ["spec"]}, "unknown ls field 'spec'"),  # env and mounts are not listed
                       ({"users": "root"}, "ls user must be a list"),
                       ({"names": [1]}, "ls name must be text"),
                       ({"names": ["x"] * (protocol.MAX_LS_FILTER + 1)}, "at most"),
                       ({"head": -1}, "ls head must be a whole number"),
                       ({"cut": True}, "ls cut must be a whole number")]:
        with pytest.raises(ClientError) as e:
            c.call("ls", **args)
        assert said in str(e.value) and e.value.code == protocol.BAD_REQUEST, (args, str(e.value))
    r = daemon.cli("ls", "-s", "bogus")
    assert r.returncode == 1 and r.stderr.startswith("colo: unknown state 'bogus'") and r.stderr.count("\n") == 1


def test_store_listing_filters_in_sql_with_indexes(tmp_path):
    s = Store(tmp_path / "colo.db")
    ids = []
    for i, (user, name) in enumerate([("ada", "a"), ("bob", "b"), ("ada", None), ("bob", "a")]):
        j = s.add_job(JobSpec.from_dict({"argv": ["run", str(i)], "gpus": 1, "gpu_mem": 1 << 30, "name": name}),
                      1000 + i, 1000, user, now=100.0 + i)
        ids.append(j.id)
    for i in ids[:3]:
        s.transition(i, State.CANCELLED, "cancelled by ada")
    ended = [State.CANCELLED, State.FAILED]
    fields = ["id", "name", "user", "gpus", "argv", "submitted_at"]
    assert s.listing(fields, ended) == [(ids[0], "a", "ada", [], ["run", "0"], 100.0),
                                        (ids[1], "b", "bob", [], ["run", "1"], 101.0),
                                        (ids[2], None, "ada", [], ["run", "2"], 102.0)]
    assert [r[0] for r in s.listing(["id"], ended, users=["ada"])] == [ids[0], ids[2]]
    assert [r[0] for r in s.listing(["id"], ended, names=["a", "b"], limit=1)] == [ids[1]]
    assert [r[0] for r in s.listing(["id"], [State.QUEUED], names=["a"])] == [ids[3]]
    assert sorted(s.listing_by_id(["id", "argv"], [ids[2], ids[0]])) == [(ids[0], ["run", "0"]), (ids[2], ["run", "2"])]
    assert [j.spec.argv for j in s.jobs_by_id([ids[1]])] == [["run", "1"]]
    assert s.listing_counts(ended, users=["ada"]) == {"cancelled": 2}
    s.close()
    db = sqlite3.connect(tmp_path / "colo.db")
    plan = " ".join(r[-1] for r in db.execute(
        "EXPLAIN QUERY PLAN SELECT id FROM jobs WHERE user IN ('ada') AND json_extract(spec, '$.name') IN ('a')"))
    assert "jobs_user" in plan or "jobs_name" in plan, plan


def test_the_collapsed_queue_from_its_index_is_the_walked_one(daemon):
    """`colo ls` (an array's queued tasks in one row) without a filter is made from the queue's
    index of arrays, kept as jobs come and go (listing.Listing._collapsed); with a filter, by
    walking the queue. Both give the same rows while tasks leave (the first, one in the middle),
    are held and released, come back (requeue), and single jobs come and go."""
    c = daemon.client
    fields = ["id", "name", "user", "state", "gpus", "mode", "budget", "submitted_at", "reason", "array"]
    # every job waits on `gate`, running until the end: a task released or requeued stays queued
    gate = c.submit({"argv": ["sleep", "600"], "gpus": 0, "workdir": "/tmp", "name": "gate"})["id"]
    daemon.wait_state(gate, "running")
    held = {"argv": ["true"], "gpus": 0, "workdir": "/tmp", "hold": True, "after": [gate]}

    def both() -> list:
        # the queued rows (the index's part; `gate`'s moves on its own), once two listings in a row
        # agree: a pass may rewrite a reason between them; an index gone wrong never agrees again
        def agree():
            indexed = [r for r in c.ls_fields(fields, all=False, tasks=False)["rows"] if r[3] == "queued"]
            walked = [r for r in c.ls_fields(fields, all=False, tasks=False, users=["root"])["rows"] if r[3] == "queued"]
            return (indexed,) if indexed == walked else None
        return wait_for(agree, 60, "the indexed and the walked listing to agree")[0]

    a = c.submit({**held, "array": "0-9", "name": "a"})["id"]
    single = c.submit({**held, "name": "one"})["id"]
    b = c.submit({**held, "array": "3,5,8-9", "name": "b"})["id"]
    assert [r[0] for r in both()] == [f"{a}_[0-9]", single, f"{b}_[3,5,8-9]"]
    c.cancel(a)  # the array's first task: the row is the next one's
    c.cancel(a + 4)
    assert [r[0] for r in both()] == [f"{a}_[1-3,5-9]", single, f"{b}_[3,5,8-9]"]
    c.release(a + 1)
    c.hold(a + 1)
    c.requeue(a)  # back in the queue, as a new job of the array
    rows = both()
    assert rows[0][0] == f"{a}_[0-3,5-9]", rows
    for t in range(b, b + 4):
        c.cancel(t)
    c.cancel(single)
    other = c.submit({**held, "name": "two"})["id"]
    rows = both()
    assert [r[0] for r in rows][-1] == other and all(not str(r[0]).startswith(f"{b}_") for r in rows), rows
    assert "index" not in daemon.log.read_text()  # the index was right throughout: never made again
    c.cancel(gate)
