"""The Debian package and the wheel: built from a clean clone by one command, installed into a
clean Debian container built here, the daemon started with the unit's own ExecStart, a job run
through it; then an upgrade keeps the edited config, and a purge leaves nothing."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from dataclasses import fields
from pathlib import Path

import pytest

from colo.config import Config
from debian_util import PACKAGE_IMAGE_INCLUDE, clone_head as _clone, debian_image

REPO = Path(__file__).resolve().parent.parent
PACKAGING = REPO / "packaging"


def test_the_config_has_every_key_with_its_default():
    """packaging/colo.toml (the reference, /usr/share/colo/colo.toml), uncommented, is colo's
    defaults as root; keys unset by default are examples, marked so. The /etc file sets none."""
    assert not [ln for ln in (PACKAGING / "colo-etc.toml").read_text().splitlines() if not ln.startswith("#")]
    text = (PACKAGING / "colo.toml").read_text()
    lines = text.splitlines()
    found = {}
    for i, line in enumerate(lines):
        m = re.match(r"^#([a-z_]+) = (.*)$", line)
        if m:
            assert m.group(1) not in found, f"{m.group(1)} twice"
            found[m.group(1)] = (tomllib.loads(f"v = {m.group(2)}")["v"], lines[i - 1])
    assert set(found) == {f.name for f in fields(Config)}
    defaults = Config(state_dir=Path("/var/lib/colo"), socket=Path("/run/colo/colo.sock"))  # as root
    loaded = Config.load(None, **{k: v for k, (v, _) in found.items() if getattr(defaults, k) is not None})
    for f in fields(Config):
        if getattr(defaults, f.name) is None:
            assert "nset by default" in found[f.name][1], f.name
        else:
            assert getattr(loaded, f.name) == getattr(defaults, f.name), f.name


def test_pip_install_without_a_c_compiler_fails_in_one_line(tmp_path):
    bin_dir = tmp_path / "bin"  # make, but no cc
    bin_dir.mkdir()
    (bin_dir / "make").symlink_to("/usr/bin/make")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "out"), str(_clone(tmp_path))],
                       capture_output=True, text=True, env={**os.environ, "PATH": str(bin_dir)}, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "colo: building colo's native parts needs cc (a C compiler and make; Debian/Ubuntu: `apt-get install gcc make" in out
    assert "Traceback" not in out and "CalledProcessError" not in out


def test_the_wheel_is_tagged_for_the_glibc_its_binaries_need(built, tmp_path):
    _, whl = built
    m = re.fullmatch(r"colo_gpu-[0-9.]+-py3-none-manylinux_(\d+)_(\d+)_x86_64\.whl", whl.name)
    assert m, whl.name
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        assert "Root-Is-Purelib: false" in z.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
        scripts = {n.rsplit("/", 1)[1]: z.read(n)[:9] for n in names if ".data/scripts/" in n}
    assert "colo/_native/libcolo-interpose.so" in names and not any("/purelib/" in n for n in names)
    # `colo` is the compiled client, beside the Python script it runs (docs/fastcli.md)
    assert scripts["colo"][:4] == b"\x7fELF" and scripts["colo-py"] == b"#!python\n", scripts
    # auditwheel (PyPI's tool for manylinux tags) reads the same binaries and agrees
    venv.create(tmp_path / "aw", with_pip=True)
    subprocess.run([str(tmp_path / "aw" / "bin" / "pip"), "install", "-q", "auditwheel"], check=True, timeout=300,
                   capture_output=True)
    shown = subprocess.run([str(tmp_path / "aw" / "bin" / "auditwheel"), "show", str(whl)], capture_output=True,
                           text=True, timeout=120)
    assert f'"manylinux_{m.group(1)}_{m.group(2)}_x86_64"' in " ".join(shown.stdout.split()), shown.stdout + shown.stderr


INSTALL_AND_RUN = r"""
set -e
say() { echo "== $*"; }
deb=$(ls /pkg/*.deb)
dpkg -i "$deb" >/dev/null
say installed $(colo --version)
for p in /usr/bin/colo /usr/bin/colo-fakegpu /opt/colo/bin/python3 /usr/lib/colo/colo_spank.so /usr/lib/colo/libcolo-interpose.so /usr/lib/colo/slurm-healthcheck /etc/colo/colo.toml /usr/share/colo/colo.toml /lib/systemd/system/colo.service \
    /usr/share/man/man1/colo.1.gz /usr/share/man/man1/colo-drain.1.gz /usr/share/man/man1/colo-fakegpu.1.gz \
    /usr/share/bash-completion/completions/colo /usr/share/zsh/vendor-completions/_colo /usr/share/fish/vendor_completions.d/colo.fish; do
  test -e "$p" || { echo "missing $p"; exit 1; }
done
test -x /usr/lib/colo/slurm-healthcheck || { echo "the health check is not executable"; exit 1; }
# no .pth hook (setuptools' came with the venv) runs at every colo command's start
pth=$(ls /opt/colo/lib/python3*/site-packages/*.pth 2>/dev/null || true)
test -z "$pth" || { echo "a .pth runs at every start: $pth"; exit 1; }
say layout ok
# simulated GPUs, set in the conffile as an admin would (it holds only what the admin changes)
colo-fakegpu create /var/lib/colo-fake/gpus --count 1 --mem 4GiB >/dev/null
echo 'fakegpu_state = "/var/lib/colo-fake/gpus"' >> /etc/colo/colo.toml
start() {
  # as systemd runs the unit: its RuntimeDirectory and StateDirectory, then its own ExecStart line
  install -d -m 0755 /run/colo; install -d -m 0711 /var/lib/colo
  exec_start=$(sed -n 's/^ExecStart=//p' /lib/systemd/system/colo.service)
  say ExecStart $exec_start
  $exec_start >>/tmp/daemon.log 2>&1 &
  daemon=$!
  i=0; until colo gpus >/dev/null 2>&1; do i=$((i+1)); [ $i -lt 150 ] || { cat /tmp/daemon.log; exit 1; }; sleep 0.2; done
}
start
j=$(colo submit --process --gpus 0 -- sh -c 'echo hello from $(id -u)')
colo wait $j
say cpu job: $(colo logs $j)
burn=$(ls /var/lib/colo/native-*/colo-burn)
j=$(colo submit --process --gpu-mem 256MiB -- "$burn" --mem 128MiB --over 256MiB)
colo wait $j
say gpu job: $(colo show $j --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["reason"])')
# day two (issue 42): the config checked as the unit's ExecStartPre checks it, a drain and an undrain,
# the man page as man(1) would read it, bash completion as a shell asks it
say config: $(colo config check /etc/colo/colo.toml)
say drain: $(colo drain 0 --reason "driver update") / $(colo gpus | grep -c 'drained by root: driver update') / $(colo undrain 0)
say man: $(zcat /usr/share/man/man1/colo.1.gz | sed -n 's/^\.TH //p')
say completion: $(env COMP_WORDS="colo dra" COMP_CWORD=1 _COLO_COMPLETE=complete_bash colo)
# a plain user's first submit, with no setting at all: the system daemon, trusted as root's
useradd -M alice; useradd -M bob
cd /tmp
u=$(env -u COLO_SOCKET -u XDG_RUNTIME_DIR runuser -u alice -- colo submit --process --gpus 0 -- id -un)
runuser -u alice -- colo wait $u
say plain user: $(runuser -u alice -- colo logs $u)
kill $daemon; wait $daemon || true
# an upgrade to a release whose defaults changed, with the config edited: no question asked
dpkg-deb -R "$deb" /tmp/next
sed -i 's/^Version: .*/&.1/' /tmp/next/DEBIAN/control
echo '# a key the next release documents' >> /tmp/next/usr/share/colo/colo.toml
dpkg-deb -Znone -b /tmp/next /tmp/next.deb >/dev/null  # uncompressed: xz takes minutes here
dpkg -i /tmp/next.deb </dev/null >/dev/null
say upgraded unattended, config kept: $(grep -c '^fakegpu_state = "/var/lib/colo-fake/gpus"' /etc/colo/colo.toml)
start
colo wait $j
say after restart $(colo ls --all -q | wc -l) jobs
# removal strands no job: refused while two users' jobs run, then told to cancel them
a=$(runuser -u alice -- colo submit --process --gpus 0 -- sleep 600)
b=$(runuser -u bob -- colo submit --process --gpus 0 -- sleep 600)
i=0; until [ "$(colo ls --state running -q | wc -l)" = 2 ]; do i=$((i+1)); [ $i -lt 600 ] || { colo ls; exit 1; }; sleep 0.2; done
dpkg -r colo-gpu >/tmp/remove.log 2>&1 && { echo "removed with jobs running"; exit 1; }
say refused: $(grep -c 'job(s) of colo are open' /tmp/remove.log) $(dpkg-query -W -f '${Status}' colo-gpu)
COLO_REMOVE_CANCELS=1 dpkg -r colo-gpu >/dev/null 2>&1
say jobs left: $(grep -lx sleep /proc/[0-9]*/comm 2>/dev/null | wc -l)
kill $daemon; wait $daemon || true
dpkg --purge colo-gpu >/dev/null
say purged: $(ls -d /opt/colo /usr/bin/colo /usr/lib/colo /etc/colo /var/lib/colo /usr/share/colo /lib/systemd/system/colo.service 2>/dev/null | wc -l) left
"""


@pytest.mark.docker
@pytest.mark.timeout(900)  # the build (fixture), then install, jobs, upgrade, removal: ~5 min on a busy 2-core machine
def test_installed_in_a_clean_debian_the_units_execstart_serves_jobs(built, docker_client):
    deb, _ = built
    codename = re.search(r"^VERSION_CODENAME=(\w+)", Path("/etc/os-release").read_text(), re.M).group(1)
    image = debian_image(docker_client, codename, include=PACKAGE_IMAGE_INCLUDE)
    out = docker_client.containers.run(image, ["sh", "-c", INSTALL_AND_RUN], remove=True, stderr=True,
                                       volumes={str(deb.parent): {"bind": "/pkg", "mode": "ro"}},
                                       labels={"colo.test": "package"}).decode()
    said = [line[3:] for line in out.splitlines() if line.startswith("== ")]
    assert said[0].startswith("installed colo ") and said[1] == "layout ok", out
    assert said[2] == "ExecStart /opt/colo/bin/colo daemon --config /etc/colo/colo.toml", out
    assert said[3] == "cpu job: hello from 0", out
    assert said[4] == "gpu job: exited with code 0; 1 allocation(s) refused by its budget of 256MiB", out
    assert said[5:9] == ["config: ok", "drain: GPU 0: drained by root: driver update / 1 / GPU 0: back in service",
                         'man: COLO 1 "" "colo ' + said[0].split()[-1] + '" "colo manual"', "completion: drain"], out
    assert said[9] == "plain user: alice", out
    assert said[10:] == ["upgraded unattended, config kept: 1",
                        "ExecStart /opt/colo/bin/colo daemon --config /etc/colo/colo.toml",
                        "after restart 3 jobs", "refused: 1 deinstall ok installed",  # asked to go, still installed
                        "jobs left: 0", "purged: 0 left"], out


@pytest.mark.skipif(shutil.which("lintian") is None, reason="lintian is not installed (.ci/run installs it)")
@pytest.mark.timeout(900)  # lintian alone takes ~100 s on a busy 2-core machine
def test_lintian_accepts_the_package_at_warning_level(built):
    """Debian's own check, at warning level and above: the man pages, completion, changelog and
    copyright are where it looks; what /opt/colo holds from PyPI is overridden, each with its
    reason (packaging/debian/lintian-overrides)."""
    deb, _ = built
    r = subprocess.run(["lintian", "-L", ">=warning", "--fail-on", "warning", str(deb)], capture_output=True,
                       text=True, timeout=900)
    said = [line for line in (r.stdout + r.stderr).splitlines() if re.match(r"[EW]: ", line)]
    assert r.returncode == 0 and not said, r.stdout + r.stderr


def test_the_docs_name_the_packages_paths():
    unit = (PACKAGING / "colo.service").read_text()
    assert "ExecStart=/opt/colo/bin/colo daemon --config /etc/colo/colo.toml" in unit
    plug = "required /usr/lib/colo/colo_spank.so python=/opt/colo/bin/python3 socket=/run/colo/colo.sock"
    for doc in ("docs/slurm.md", "README.md"):
        assert plug in (REPO / doc).read_text(), doc  # the container test finds both paths installed
