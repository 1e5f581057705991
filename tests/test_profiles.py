"""Profiles: text format, store, learning, recording with a real child process, shipped set."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from colo import profiles as P

MiB = 1024**2
GiB = 1024**3
REPO = Path(__file__).resolve().parent.parent


def mk(name="p", sm=(0.2, 0.4), mem=(100 * MiB, 300 * MiB), bw=(0.1, 0.3), pcie=None, step=1.0, **kw):
    return P.Profile(name=name, step=step, sm=np.array(sm), mem=np.array(mem), membw=np.array(bw),
                     pcie=None if pcie is None else np.array(pcie), **kw)


def test_round_trip_and_summary(tmp_path):
    p = mk(pcie=(1e6, 2e6), runtime=2.0, cache_bound=True, runs=3, gpu="NVIDIA H100")
    q = P.load(P.save(p, tmp_path / "p.profile"))
    assert np.allclose(q.sm, p.sm) and (q.mem == p.mem).all() and np.allclose(q.pcie, p.pcie)
    assert (q.cache_bound, q.runs, q.gpu, q.runtime, q.version) == (True, 3, "NVIDIA H100", 2.0, P.VERSION)
    assert q.peak_sm == pytest.approx(0.4) and q.mean_sm == pytest.approx(0.3)
    assert q.peak_mem == 300 * MiB and q.mean_membw == pytest.approx(0.2)
    assert (tmp_path / "p.profile").read_text().startswith("colo-profile 1\n")


@pytest.mark.parametrize("text,msg", [
    ("hello\n", "not a colo profile"),
    ("colo-profile 99\nname x\nseries sm mem membw\n0.1 1 0.1\n", "newer"),
    ("colo-profile 1\nname x\nseries sm mem membw\n0.1 1\n", "expected 3 numbers"),
    ("colo-profile 1\nname x\n", "incomplete"),
    ("colo-profile 1\nseries sm gpu\n0.1 1\n", "series columns"),
])
def test_malformed_profiles_are_refused(text, msg):
    with pytest.raises(P.ProfileError, match=msg):
        P.loads(text)


def test_store_order_save_and_learn(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    b.mkdir()
    P.save(mk("x", sm=(0.9, 0.9)), b / "x.profile")
    P.save(mk("y"), b / "y.profile")
    store = P.ProfileStore([a, b])
    assert store.get("x").peak_sm == pytest.approx(0.9)
    assert store.save(mk("x", sm=(0.1, 0.1))) == a / "x.profile"  # first writable folder
    assert store.get("x").peak_sm == pytest.approx(0.1)  # first folder wins
    assert [p.name for p in store.ls()] == ["x", "y"]
    assert store.get("nope") is None and store.get("../etc/passwd") is None
    # learning: running mean over runs, run count kept
    s1 = {"times": [0, 1, 2, 3], "sm": [0.2] * 4, "mem": [MiB] * 4, "membw": [0.1] * 4}
    s2 = {"times": [0, 1, 2, 3], "sm": [0.4] * 4, "mem": [3 * MiB] * 4, "membw": [0.3] * 4}
    store.learn("job-a", s1)
    learned = store.learn("job-a", s2)
    assert learned.runs == 2 and learned.mean_sm == pytest.approx(0.3)
    assert learned.peak_mem == 2 * MiB and learned.mean_membw == pytest.approx(0.2)
    assert P.ProfileStore([a]).get("job-a").runs == 2
    third = store.learn("job-a", [{"t": 0, "sm": 0.6, "mem": 2 * MiB, "membw": 0.2}, {"t": 3, "sm": 0.6, "mem": 2 * MiB, "membw": 0.2}])
    assert third.runs == 3 and third.mean_sm == pytest.approx(0.4)


def test_store_skips_unwritable_first_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = P.ProfileStore([blocker / "sub", tmp_path / "ok"])
    assert store.save(mk("z")).parent == tmp_path / "ok"


def test_key_for_is_stable_and_distinct():
    k = P.key_for("docker.io/lab/train:1.2", ["python", "train.py", "--lr", "0.1"])
    assert k == P.key_for("docker.io/lab/train:1.2", ["python", "train.py", "--lr", "0.1"])
    assert k.startswith("train-python-") and P.valid_name(k)
    assert k != P.key_for("docker.io/lab/train:1.2", ["python", "train.py", "--lr", "0.2"])
    assert P.valid_name(P.key_for(None, ["/bin/weird name", "x"]))


def test_a_new_hyperparameter_starts_from_its_familys_profile(tmp_path):
    """Its own key (these arguments) first, then its family's (the image or program and the
    script): a run teaches both, so the next member of the family is not a stranger."""
    run = ["python", "train.py", "--lr", "0.1"]
    other = ["python", "train.py", "--lr", "0.2"]
    assert P.key_for("reg/img:1", run) != P.key_for("reg/img:1", other)
    assert P.family_for("reg/img:1", run) == P.family_for("reg/img:1", other) == P.names_for("reg/img:1", other)[1]
    assert P.family_for("reg/img:1", run) != P.family_for("reg/img:1", ["python", "eval.py", "--lr", "0.1"])
    assert P.family_for("reg/img:1", run) != P.family_for("reg/img:2", run)  # another image: another family
    assert P.script_of(["torchrun", "--nproc", "2", "train.py", "-x"]) == "train.py"
    assert P.script_of(["python", "-m", "pkg.train", "--lr", "1"]) == "-m pkg.train"
    assert P.script_of(["./solver", "100"]) == "" and P.family_for(None, ["./solver", "1"]) == P.family_for(None, ["./solver", "2"])
    assert P.names_for("img", run, profile="mine") == ["mine"]  # --profile names it
    assert all(P.valid_name(n) for n in P.names_for("reg/img:1", run))
    store = P.ProfileStore([tmp_path / "own"])
    key, family = P.names_for("reg/img:1", run)
    samples = {"times": [0, 1, 2, 3], "sm": [0.5] * 4, "mem": [GiB] * 4, "membw": [0.2] * 4}
    store.learn(key, samples, runtime=4.0, family=family)
    new = P.names_for("reg/img:1", other)
    assert store.get(new[0]) is None and store.first(new).name == family and store.first(new).mean_sm == pytest.approx(0.5)
    store.learn(new[0], samples, runtime=4.0, family=family)
    assert store.get(family).runs == 2 and store.first(new).name == new[0]


def test_a_running_job_gets_a_provisional_profile_from_its_first_samples():
    t = np.arange(0, 45, 1.0)
    samples = {"times": t, "sm": np.where(t < 20, 0.2, 0.4), "mem": np.full(len(t), 3 * GiB), "membw": np.full(len(t), 0.1)}
    assert P.provisional("x", {k: v[:20] for k, v in samples.items()}) is None  # too few seconds to say
    p = P.provisional("x", samples)
    assert p.provisional and p.runtime == P.PROVISIONAL_HOLD and p.peak_mem == 3 * GiB
    # what it showed, then its highest levels held: how long it runs on is unknown
    assert p.sm[0] == pytest.approx(0.2) and p.sm[-1] == pytest.approx(0.4) and p.peak_sm == pytest.approx(0.4)
    assert not P.loads(P.dumps(p)).provisional  # never stored as one


def test_a_run_that_has_launched_no_kernels_yet_speaks_for_nobody():
    """A job loading its data reads 0 % SM: a minute of that says nothing of what it will do (qmcpack
    is idle 94 s, then saturates), so it makes no provisional profile until it computes."""
    t = np.arange(0, 120, 1.0)
    samples = {"times": t, "sm": np.where(t < 90, 0.0, 1.0), "mem": np.full(len(t), 5 * GiB), "membw": np.zeros(len(t))}
    assert P.provisional("x", {k: v[:60] for k, v in samples.items()}) is None
    p = P.provisional("x", samples)
    assert p.provisional and p.peak_sm == pytest.approx(1.0) and p.sm[-1] == pytest.approx(1.0)


def test_from_samples_bins_peak_memory_and_mean_sm():
    p = P.from_samples("s", {"times": [0, 0.4, 0.8, 1.2], "sm": [0, 1, 0.5, 0.5], "mem": [1, 9, 2, 3],
                             "membw": [0, 0, 0, 0]}, runtime=2.0, step=1.0)
    assert list(p.mem) == [9, 3] and np.allclose(p.sm, [0.5, 0.5])


@pytest.mark.slow  # a real child process, sampled until it ends
def test_record_runs_a_real_command_and_samples_it(tmp_path):
    """The child writes its 'usage' to a file; the sampler reads it, as NVML would be read. The
    child replaces the file whole (a reader never sees it half written) and goes on only once the
    sampler has seen each value (under load a fixed sleep may pass between two samples)."""
    usage = tmp_path / "usage"
    usage.write_text("0.1 1000")
    child = ("import os, sys, time, pathlib\n"
             f"d = pathlib.Path({str(tmp_path)!r})\n"
             "def seen(v):\n"
             "    end = time.monotonic() + 60\n"
             "    while not (d / ('seen ' + v)).exists():\n"
             "        if time.monotonic() > end: sys.exit(9)\n"
             "        time.sleep(0.01)\n"
             "seen('0.1 1000'); time.sleep(0.4)\n"
             "(d / 'usage.new').write_text('0.8 5000'); os.replace(d / 'usage.new', d / 'usage')\n"
             "seen('0.8 5000'); time.sleep(0.6)\n")

    def sampler():
        text = usage.read_text()
        (tmp_path / f"seen {text}").touch()
        sm, mem = text.split()
        return {"sm": float(sm), "mem": int(mem), "membw": 0.2, "pcie": None}

    p = P.record([sys.executable, "-c", child], sampler, hz=20, name="rec")
    assert p.name == "rec" and p.runs == 1 and p.pcie is None
    assert 0.9 < p.runtime < 60
    assert p.peak_mem == 5000 and p.peak_sm == pytest.approx(0.8) and p.sm[0] == pytest.approx(0.1)
    with pytest.raises(P.ProfileError, match="exited with status 3"):
        P.record([sys.executable, "-c", "raise SystemExit(3)"], sampler)
    with pytest.raises(P.ProfileError, match="cannot run"):
        P.record([str(tmp_path / "missing")], sampler)


def test_shipped_profiles_follow_design(tmp_path, monkeypatch):
    store = P.ProfileStore([P.shipped_dir()])
    names = {p.name for p in store.ls()}
    assert {"vgg11", "vgg16", "resnet50", "resnet101", "resnet152", "alexnet", "googlenet",
            "lammps", "gromacs", "qmcpack", "hoomd"} <= names
    g12 = 12 * 1024**3
    for n in ("vgg11", "vgg16", "resnet50", "resnet101", "resnet152", "qmcpack", "hoomd", "lammps"):
        assert store.get(n).mean_sm >= 0.40, n
    for n in ("alexnet", "gromacs"):
        assert store.get(n).mean_sm < 0.40, n
    for n in ("vgg11", "vgg16", "resnet50", "resnet101", "resnet152"):
        assert store.get(n).peak_mem >= g12 / 2, n
    for n in ("alexnet", "googlenet", "qmcpack", "hoomd", "gromacs"):
        assert store.get(n).peak_mem < g12 / 2, n
    lam, qmc = store.get("lammps"), store.get("qmcpack")
    assert lam.mem[0] == 363 * MiB and lam.peak_mem == 8499 * MiB and lam.sm[-1] == pytest.approx(1.0)
    assert qmc.mem[qmc.at(90)] == 0 and qmc.mem[qmc.at(100)] == 5135 * MiB
    monkeypatch.setenv("COLO_PROFILES_DIR", str(tmp_path))
    assert P.shipped_dir() == tmp_path


def test_make_shipped_is_deterministic(tmp_path):
    sys.path.insert(0, str(REPO / "profiles"))
    try:
        import make_shipped
    finally:
        sys.path.pop(0)
    make_shipped.main(tmp_path)
    for f in sorted((REPO / "profiles").glob("*.profile")):
        assert (tmp_path / f.name).read_text() == f.read_text(), f.name
