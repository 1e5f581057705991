"""Open jobs held in memory share what repeats from job to job (issue 41 item 2): a queue of 50,000
read back from the store holds one command list per command, one empty env, one int per uid, gid
and budget; what each spec says, and what it sends and stores, is unchanged."""
from __future__ import annotations

import json

from colo.jobs import NO_ENV, JobSpec
from colo.store import Store

GiB = 1 << 30


def test_jobs_read_back_share_their_command_env_and_numbers_and_say_the_same(tmp_path):
    s = Store(tmp_path / "colo.db")
    asked = {"argv": ["python", "train.py", "--epochs", "3"], "gpus": 1, "gpu_mem": 3 * GiB, "workdir": "/tmp"}
    jobs = [s.add_job(JobSpec.from_dict({**asked, "name": f"q{i}"}), 70001, 70002, "ada") for i in range(3)]
    own = s.add_job(JobSpec.from_dict({**asked, "env": {"A": "1"}, "argv": ["python", "other.py"]}), 70001, 70002, "ada")
    a, b = jobs[0], jobs[2]
    assert a.spec.argv is b.spec.argv and a.spec.env is b.spec.env is NO_ENV
    assert a.uid is b.uid and a.gid is b.gid and a.spec.gpu_mem is b.spec.gpu_mem
    assert own.spec.env == {"A": "1"} and own.spec.env is not NO_ENV and own.spec.argv is not a.spec.argv
    # what is sent and stored: plain lists and dicts of its own, equal to what was asked
    for j in (*jobs, own):
        d = j.spec.to_dict()
        assert type(d["argv"]) is list and type(d["env"]) is dict and d["argv"] is not j.spec.argv
        assert d["env"] is not NO_ENV
        stored = json.loads(s.db.execute("SELECT spec FROM jobs WHERE id=?", (j.id,)).fetchone()[0])
        assert stored == d
    assert jobs[1].spec.to_dict()["argv"] == asked["argv"] and jobs[1].spec.name == "q1"
    assert NO_ENV == {}  # never written to
    s.close()


def test_a_long_command_is_its_own_list():
    words = [f"arg{i}" for i in range(40)]
    a, b = JobSpec.from_dict({"argv": words}), JobSpec.from_dict({"argv": list(words)})
    assert a.argv == b.argv == words and a.argv is not b.argv
