"""Issue 11 item 5 (invariant 13): a user's runs teach only that user's own profiles.

Bob (a real second Unix user) runs a job that barely uses the GPU under `--profile rn50`, a
profile the admin configured at 95 % (71 % in the first version) mean SM. Before, his run was merged into the one stored
rn50 (71 % -> 36 %), and two rn50 jobs of alice's were then put on one GPU under MPS. Now his run
teaches his own copy; alice's jobs are placed with the admin's profile, and `colo profile ls/show`
(answered by the daemon) tell each of them which one is used.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from colo.node import fakegpu
from colo import profiles
from colo.client import Client
from harness.daemon import as_user, wait_for

GiB = 1024**3


pytestmark = pytest.mark.node(
    "colo-prof-", profiles={"rn50": dict(sm=0.95, mem=512 * 1024**2, membw=0.3, runtime=20.0)},
    then=lambda n: (n.daemon({"profile_dirs": [str(n.prof)], "mps_idle_stop": 600.0}), n.prof))


def test_bobs_run_does_not_change_how_alices_jobs_are_placed(node, other_user):
    d, prof = node
    before = (prof / "rn50.profile").read_text()
    burn = str(next(d.state_dir.glob("native-*")) / "colo-burn")  # the daemon's world-readable copy
    spec = {"argv": [burn, "--mem", "256MiB", "--duty", "0", "--seconds", "3"], "gpu_mem": GiB,
            "profile": "rn50", "workdir": "/tmp"}
    kind, bobs = as_user(other_user, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", bobs
    d.wait_state(bobs, "succeeded", timeout=60)
    # bob's own copy learned his run (started from the admin's, so 2 runs); the admin's is untouched
    kind, mine = wait_for(lambda: (r := as_user(other_user, lambda: Client(d.socket).profile("rn50")))[1]["runs"] == 2
                          and r, 30, "bob's run to be learned")
    assert mine["source"] == "own" and mine["mean_sm"] < 0.5, mine
    assert (prof / "rn50.profile").read_text() == before
    seen = json.loads(d.cli("profile", "show", "rn50", "--json", check=True).stdout)
    assert seen["source"] == "configured" and seen["runs"] == 1 and abs(seen["mean_sm"] - 0.95) < 0.01
    ls = d.cli("profile", "ls", check=True).stdout
    assert any(ln.split()[:3] == ["rn50", "configured", "1"] for ln in ls.splitlines()), ls
    admin_view = json.loads(d.cli("profile", "show", "rn50", "--user", other_user.pw_name, "--json",
                                  check=True).stdout)
    assert admin_view["source"] == "own" and admin_view["runs"] == 2
    kind, err = as_user(other_user, lambda: Client(d.socket).profiles(user="root"))
    assert kind == "err" and err[2] == "forbidden", err

    # alice's (root's) two rn50 jobs: 95 % + 95 % SM: each would run at about half speed (the H200-fitted model lets two 71 % jobs take turns), so they do not share
    gate = d.root / "go"
    hold = ["sh", "-c", f"{burn} --mem 256MiB --duty 95 --seconds 600 --quiet & b=$!; "
                        f"while [ ! -e {gate} ]; do sleep 0.05; done; kill $b; wait $b; exit 0"]
    a = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "rn50", "--", *hold)
    d.wait_state(a, "running")
    b = d.submit("--process", "--gpu-mem", "2GiB", "--profile", "rn50", "--", *hold)
    why = wait_for(lambda: "co-running" in (r := d.job(b)["reason"] or "") and r, 30, "a decision for job b")
    assert d.job(b)["state"] == "queued", why
    gate.touch()
    for j in (a, b):
        d.wait_state(j, "succeeded", timeout=60)

    # an admin may make bob's copy the shared one: then it is what everyone's jobs use
    d.cli("profile", "share", "rn50", "--user", other_user.pw_name, check=True)
    seen = json.loads(d.cli("profile", "show", "rn50", "--user", "nobody", "--json", check=True).stdout)
    assert seen["source"] == "shared" and seen["runs"] == 2  # a user with no copy of their own gets bob's now
    kind, err = as_user(other_user, lambda: Client(d.socket).profile_share("rn50"))
    assert kind == "err" and err[2] == "forbidden", err


def test_recorded_profile_reaches_the_daemon_as_the_users_own_and_is_checked(node, other_user):
    """`colo profile record` (issue 13): the profile a user records is handed to the daemon, which
    reads it as hostile input and stores it only as that user's own copy. (The CLI runs as root:
    this checkout's Python is not for other users; bob speaks to the socket from a forked child.)"""
    d, prof = node
    native = next(d.state_dir.glob("native-*"))
    env = {**d.env(), "COLO_FAKEGPU_STATE": str(d.fake_state), "LD_LIBRARY_PATH": str(native / "fakegpu"),
           "COLO_USER_PROFILES": str(d.root / "local")}
    r = subprocess.run([*d.cli_args("profile", "record", "--name", "mine", "--hz", "20", "--"),
                        str(native / "colo-burn"), "--mem", "256MiB", "--duty", "50", "--seconds", "1", "--quiet"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and "the daemon places your jobs with --profile mine by it now" in r.stdout, r
    got = json.loads(d.cli("profile", "show", "mine", "--json", check=True).stdout)
    assert got["source"] == "own" and got["runs"] == 1, got
    assert got["peak_mem"] == 256 * 1024**2 and got["peak_sm"] >= 0.4, got  # what the command did, from NVML
    assert (d.state_dir / "profiles" / "users" / "0" / "mine.profile").is_file()
    assert (d.root / "local" / "mine.profile").is_file()  # and kept locally, for colo sim
    kind, err = as_user(other_user, lambda: Client(d.socket).profile("mine"))
    assert kind == "err" and err[2] == "not_found", err  # bob's jobs do not get root's

    def put(text):
        return as_user(other_user, lambda: Client(d.socket).profile_put(text))

    good = profiles.dumps(profiles.from_samples("x", {"times": [0, 1], "sm": [0.5, 0.5], "mem": [1, 2],
                                                      "membw": [0, 0]}, runtime=2.0))
    kind, ok = put(good.replace("runs 1", "runs 999"))  # a recording is one run, whatever it claims
    assert kind == "ok" and ok["runs"] == 1 and not ok["replaced"], ok
    assert put(good)[1]["replaced"] is True
    for bad, why in [(good.replace("name x", "name ../../etc/x"), "bad profile name"),
                     (good.replace("gpu -", "gpu \x1b[2J"), "control or format characters"),
                     (good.replace("0.500 2 0.000", "nan 2 0.000"), "finite"),
                     (good.replace("0.500 2 0.000", "0.5 1e30 0.0"), "finite"),
                     (good.replace("0.500 2 0.000", "0.5 1e17 0.0"), "1 PiB"),
                     ("colo-profile 1\nname y\nseries sm mem membw\n" + "0.1 1 0.1\n" * 1001, "at most 1000"),
                     ("hello", "not a colo profile"),
                     (good + "x" * 300_000, "up to 256 KiB")]:
        kind, err = put(bad)
        assert kind == "err" and why in err[1] and err[2] in ("invalid", "bad_request"), (bad[:60], err)
    # only one's own: the request cannot name another user
    kind, err = as_user(other_user, lambda: Client(d.socket).call("profile_put", text=good, user="root"))
    assert kind == "err" and err[2] == "bad_request", err
    assert not (d.state_dir / "profiles" / "users" / "0" / "x.profile").exists()
    assert (d.state_dir / "profiles" / "users" / str(other_user.pw_uid) / "x.profile").is_file()


def test_record_without_a_daemon_keeps_the_profile_locally_and_says_so(tmp_path, native_dir):
    state = tmp_path / "gpus"
    fakegpu.create(state, count=1, mem=GiB)
    env = {**os.environ, **fakegpu.FakeNode(state).env, "COLO_SOCKET": str(tmp_path / "none.sock"),
           "COLO_USER_PROFILES": str(tmp_path / "mine")}
    r = subprocess.run([sys.executable, "-m", "colo", "profile", "record", "--name", "solo", "--",
                        "true"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and (tmp_path / "mine" / "solo.profile").is_file(), r
    assert "only on this machine's disk" in r.stderr, r.stderr
