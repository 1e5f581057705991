"""Who answers on the socket, proven before a byte is sent (colo/client.py): real users plant a
fake daemon where a victim's client would look, and the fake must get nothing."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from user_cli import colo_as as _as

# The attacker's fake daemon: bind (as whoever runs it), drop to the attacker's uid, listen, then
# report every connection's bytes until the test's own sentinel connection comes (the backlog is
# FIFO, so a victim's connection, had there been one, is accepted first: no timing involved).
FAKE = r"""
import json, os, socket, sys
path, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_UNIX)
s.bind(path)
os.chmod(path, 0o666)
os.setgroups([]); os.setgid(gid); os.setuid(uid)
s.listen(16)
print("ready", flush=True)
got = []
while True:
    c, _ = s.accept()
    c.settimeout(120)
    data = b""
    while (chunk := c.recv(65536)):
        data += chunk
        if data.startswith(b"SENTINEL"):
            print(json.dumps(got), flush=True)
            sys.exit(0)
    got.append(len(data))
"""


class Fake:
    def __init__(self, path: Path, pw):
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", FAKE, str(path), str(pw.pw_uid), str(pw.pw_gid)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def connections(self) -> list[int]:
        """Bytes of each connection before the sentinel's (ends the fake)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.path))
            s.sendall(b"SENTINEL")
            out = self.proc.stdout.readline()
        self.proc.wait(timeout=60)
        return json.loads(out)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("COLO_SOCKET", "XDG_RUNTIME_DIR")}
    env.update(kw)
    return env


@pytest.fixture
def folder():
    d = Path(tempfile.mkdtemp(prefix="colo-trust-"))
    os.chmod(d, 0o755)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


SUBMIT = ["submit", "--process", "--env", "HF_TOKEN=secret", "--", "true"]


def test_a_socket_in_another_users_folder_is_refused_and_gets_nothing(users, folder):
    alice, bob = users  # alice plants, bob is the victim
    planted = folder / "alice"
    planted.mkdir(mode=0o755)
    os.chown(planted, alice.pw_uid, alice.pw_gid)
    fake = Fake(planted / "colo.sock", alice)
    try:
        r = _as(bob, SUBMIT, _env(COLO_SOCKET=str(planted / "colo.sock")))
        assert r.returncode != 0
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert f"refusing the daemon socket {planted}/colo.sock" in err
        assert f"belongs to user {alice.pw_name}" in err and "nothing was sent" in err, err
        assert fake.connections() == []  # not even a connection
    finally:
        fake.close()


def test_a_listener_of_another_user_is_refused_before_a_byte_is_sent(users, folder):
    """The folder is root's (as /run/colo is), but the process answering is the attacker's: the
    kernel's peer credentials give it away, and the client closes having sent nothing."""
    alice, bob = users
    fake = Fake(folder / "colo.sock", alice)  # bound as root, listened as alice
    try:
        r = _as(bob, SUBMIT, _env(COLO_SOCKET=str(folder / "colo.sock")))
        assert r.returncode != 0
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert f"served by user {alice.pw_name} (uid {alice.pw_uid})" in err and "nothing was sent" in err, err
        assert fake.connections() == [0]  # connected, then closed with no request bytes
    finally:
        fake.close()


def test_a_world_writable_folder_is_refused(users, folder):
    _, bob = users
    os.chmod(folder, 0o777)
    r = _as(bob, ["ls"], _env(COLO_SOCKET=str(folder / "colo.sock")))
    assert r.returncode != 0 and "is writable by other users (mode 777)" in r.stderr, r.stderr


def test_with_no_setting_a_user_looks_only_for_the_system_daemon(users):
    """No COLO_SOCKET and no XDG_RUNTIME_DIR (su, cron, ssh without pam_systemd): the client looked in
    /tmp/colo-UID/ once, a path any user can take first. It looks at /run/colo/colo.sock only now."""
    alice, bob = users
    old = Path(f"/tmp/colo-{bob.pw_uid}/colo")
    if os.path.exists("/run/colo/colo.sock"):
        pytest.skip("a system colo daemon runs on this machine")
    subprocess.run(["rm", "-rf", f"/tmp/colo-{bob.pw_uid}"], check=True)
    old.mkdir(parents=True)
    for p in (old.parent, old):
        os.chown(p, alice.pw_uid, alice.pw_gid)
    fake = Fake(old / "colo.sock", alice)
    try:
        r = _as(bob, ["ls"], _env())
        assert r.returncode != 0 and "no socket at /run/colo/colo.sock" in r.stderr, r.stderr
        assert fake.connections() == []
    finally:
        fake.close()
        subprocess.run(["rm", "-rf", f"/tmp/colo-{bob.pw_uid}"], check=True)


def test_doctor_as_a_user_says_which_daemon_and_why_it_is_trusted(shared_daemon, users):
    _, bob = users
    r = _as(bob, ["doctor"], _env(COLO_SOCKET=str(shared_daemon.socket)))
    trust = [ln for ln in r.stdout.splitlines() if ln[6:].startswith("trust")]
    assert trust and trust[0].startswith("ok"), r.stdout
    assert f"the system daemon: pid {shared_daemon.proc.pid} runs as root" in trust[0], trust
    assert f"its folder {shared_daemon.socket.parent} belongs to root" in trust[0], trust


def test_doctor_fails_when_no_daemon_answers(tmp_path):
    r = subprocess.run([sys.executable, "-m", "colo", "doctor", "--socket", str(tmp_path / "none.sock")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout.startswith("FAIL  daemon"), r.stdout
