"""The compiled `colo` (native/client/colo.c) and its per-user command server (colo/cli/fastserve.py,
fastrun.py): the same bytes, exit codes and effects as the Python script, on a real daemon; the
server is really used, never stale, never another user's, and a client's end is its command's.

Each test runs a private install: the built client as bin/colo beside bin/colo-py (the script, its
`#!` this interpreter), colo's package copied beside them (PYTHONPATH, so a test may edit it), and a
runtime folder of its own for the server's socket (XDG_RUNTIME_DIR)."""
from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

import colo
from colo.cli.fastserve import HOT
from harness.daemon import wait_for

REPO = Path(__file__).resolve().parent.parent


class Install:
    """bin/colo, bin/colo-py and lib/colo under a folder every user may read."""

    def __init__(self, client: Path, socket_path: str | None, python: str = sys.executable):
        self.root = Path(tempfile.mkdtemp(prefix="colo-fastcli-"))
        os.chmod(self.root, 0o755)
        (self.root / "bin").mkdir()
        shutil.copy(client, self.root / "bin" / "colo")
        text = (REPO / "bin" / "colo-py").read_text().replace("#!python", f"#!{python}", 1)
        (self.root / "bin" / "colo-py").write_text(text)
        os.chmod(self.root / "bin" / "colo-py", 0o755)
        shutil.copytree(Path(colo.__file__).parent, self.root / "lib" / "colo",
                        ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(["chmod", "-R", "a+rX", str(self.root)], check=True)
        self.socket = socket_path
        self.run_dirs: dict[int, Path] = {}

    def run_dir(self, uid: int) -> Path:
        """The user's XDG_RUNTIME_DIR: theirs, 0700."""
        if uid not in self.run_dirs:
            d = self.root / f"run-{uid}"
            d.mkdir(mode=0o700)
            os.chown(d, uid, -1)
            self.run_dirs[uid] = d
        return self.run_dirs[uid]

    def env(self, fast: bool = True, uid: int | None = None, **extra) -> dict:
        uid = os.getuid() if uid is None else uid
        e = {k: v for k, v in os.environ.items() if not k.startswith(("COLO_", "XDG_"))}
        e.update(PYTHONPATH=str(self.root / "lib"), XDG_RUNTIME_DIR=str(self.run_dir(uid)),
                 PYTHONDONTWRITEBYTECODE="1")
        if self.socket:
            e["COLO_SOCKET"] = self.socket
        if not fast:
            e["COLO_FAST"] = "0"
        e.update(extra)
        return e

    def argv(self, *args: str) -> list[str]:
        return [str(self.root / "bin" / "colo"), *args]

    def run(self, *args: str, fast: bool = True, user=None, cwd=None, env=None) -> subprocess.CompletedProcess:
        kw = {} if user is None else {"user": user.pw_uid, "group": user.pw_gid}
        uid = None if user is None else user.pw_uid
        return subprocess.run(self.argv(*args), capture_output=True, env=env or self.env(fast, uid), timeout=120,
                              cwd=cwd or "/", **kw)

    def sockets(self, uid: int) -> list[Path]:
        return sorted((self.run_dir(uid) / "colo-fast").glob("*.sock"))

    def server(self, uid: int | None = None, user=None, env: dict | None = None) -> int:
        """Start a server of the user's (a first call starts it; env: the caller's) and wait until it
        answers at a socket that was not there before: its pid."""
        uid = os.getuid() if uid is None else uid
        before = set(self.sockets(uid))

        def started() -> int | None:  # (a server that saw its files change as it started gives up)
            self.run("ls", user=user, env=env)
            return _answering([p for p in self.sockets(uid) if p not in before])

        return wait_for(started, 60, "the command server to listen")

    def close(self):
        for pid in _servers(str(self.root)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def _answering(socks: list[Path]) -> int | None:
    """The pid of the server listening at the one socket, or None."""
    if len(socks) != 1:
        return None
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(str(socks[0]))
        pid, _uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid
    except OSError:
        return None
    finally:
        s.close()


def _servers(marker: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if b"--colo-fast-server" in cmd and marker.encode() in cmd:
            out.append(int(p.name))
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _fd1(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return None


def _gone(pid: int, timeout: float = 60) -> bool:
    """Wait for pid's end (its pidfd readable): True when it ended."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


@pytest.fixture
def install(native_dir, daemon):
    inst = Install(native_dir / "colo-client", str(daemon.socket))
    yield inst
    inst.close()


@pytest.fixture
def bare(native_dir):
    """An install with no daemon to ask (every command says so): for what users do to each other, on
    the system's python3 (other users may not reach this one's; `ls` needs only the standard library)."""
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs /usr/bin/python3 for other users")
    d = Path(tempfile.mkdtemp(prefix="colo-fastcli-sock-"))
    os.chmod(d, 0o700)
    inst = Install(native_dir / "colo-client", str(d / "none.sock"), "/usr/bin/python3")
    yield inst
    inst.close()
    shutil.rmtree(d, ignore_errors=True)


def _no_age(out: bytes) -> list[list[bytes]]:
    rows = [re.split(rb"\s{2,}", ln) for ln in out.splitlines()]
    if not rows or b"AGE" not in rows[0]:
        return rows
    i = rows[0].index(b"AGE")
    return [r[:i] + r[i + 1:] for r in rows]


def _alike(install: Install, args: list[str], **kw):
    """The fast path and the Python path: the same exit code, stderr and stdout, byte for byte (once
    in three tries: an AGE cell may turn a second between two calls; only that may differ)."""
    for _ in range(3):
        fast, slow = install.run(*args, **kw), install.run(*args, fast=False, **kw)
        assert (fast.returncode, fast.stderr) == (slow.returncode, slow.stderr), (args, fast, slow)
        assert _no_age(fast.stdout) == _no_age(slow.stdout), (args, fast.stdout, slow.stdout)
        if fast.stdout == slow.stdout:
            return fast
    raise AssertionError(f"{args}: stdout differs beyond AGE: {fast.stdout!r} {slow.stdout!r}")


def test_the_client_and_the_server_know_the_same_hot_commands():
    text = (REPO / "native" / "client" / "colo.c").read_text()
    listed = re.search(r"HOT\[\] = \{(.*?)NULL\}", text).group(1)
    assert tuple(re.findall(r'"(\w+)"', listed)) == HOT


def test_this_install_has_the_compiled_colo():
    """pip install -e . (CI's, the README's) puts the compiled client at bin/colo, the script beside."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "colo-py").exists():
        pytest.skip(f"colo is not installed in {bin_dir}")
    assert (bin_dir / "colo").read_bytes()[:4] == b"\x7fELF"
    assert (bin_dir / "colo-py").read_text().startswith("#!")


def test_the_fast_path_answers_as_the_script_does(install, daemon, tmp_path):
    done = daemon.submit("--process", "--gpus", "0", "--name", "done", "--", "sh", "-c", "echo hi; exit 3")
    daemon.wait_state(done, "failed")
    held = daemon.submit("--hold", "--process", "--gpus", "0", "--name", "held", "--", "true")
    daemon.submit("--hold", "--process", "--gpus", "0", "--array", "0-3", "--name", "sweep", "--", "true")
    server = install.server()
    cases = [
        ["ls"], ["ls", "--json"], ["ls", "-a"], ["ls", "-r", "-n", "sweep"], ["ls", "-q"],
        ["ls", "-s", "bogus"],  # refused by colo: one line
        ["ls", "--bogus"],  # refused by click (the typer app, in the child)
        ["ls", "--help"],
        ["show", str(done)], ["show", "held", "--json"], ["show", "99999"],  # an unknown job
        ["logs", str(done)], ["wait", str(done)],
        ["cancel", "99999"],
        ["submit", "--process", "--gpu-mem", "12XB", "--", "true"],  # a malformed size
        ["explain", "held"], ["explain", str(done), "--json"], ["gpus"], ["gpus", "--json"],
        ["history"], ["history", "--json"], ["history", "--since", "bogus"],
    ]
    got = {" ".join(args): _alike(install, args) for args in cases}  # each alike on both paths
    assert got[f"wait {done}"].returncode == 3 and got[f"logs {done}"].stdout == b"hi\n"  # the job's exit, its output
    assert all(got[c].stdout for c in ("ls", "ls --json", "ls -a", "ls -r -n sweep", "ls -q"))
    assert [got[c].returncode for c in ("ls -s bogus", "ls --bogus", "ls --help")] == [1, 2, 0]
    assert all(got[c].returncode == 0 and got[c].stdout for c in
               ("explain held", f"explain {done} --json", "gpus", "gpus --json", "history", "history --json"))
    assert got["history --since bogus"].returncode != 0
    assert _answering(install.sockets(os.getuid())) == server  # one server answered all along
    # what changes state: a job submitted and cancelled each way, from a folder of our own
    work = tmp_path / "work"
    work.mkdir()
    ids = []
    for fast in (True, False):
        sub = install.run("submit", "--hold", "--process", "--gpus", "0", "--", "true", fast=fast, cwd=str(work))
        assert sub.returncode == 0 and not sub.stderr, sub
        ids.append(int(sub.stdout))
        assert daemon.job(ids[-1])["spec"]["workdir"] == str(work)  # the client's directory, handed over
    cancels = [install.run("cancel", str(i), fast=fast) for i, fast in zip(ids, (True, False))]
    assert [(c.returncode, c.stderr) for c in cancels] == [(0, b"")] * 2
    assert cancels[0].stdout.replace(str(ids[0]).encode(), b"N") == cancels[1].stdout.replace(str(ids[1]).encode(), b"N")
    assert [daemon.job(i)["state"] for i in ids] == ["cancelled"] * 2
    assert daemon.job(held)["state"] == "queued"


def test_a_terminal_is_the_commands_terminal(install, daemon):
    """isatty, and with it --json's indent, as the script sees its terminal."""
    daemon.submit("--hold", "--process", "--gpus", "0", "--name", "held", "--", "true")
    install.server()

    def on_pty(fast: bool, *args: str) -> bytes:
        master, slave = pty.openpty()
        p = subprocess.Popen(install.argv(*args), stdin=slave, stdout=slave, stderr=slave, env=install.env(fast))
        os.close(slave)
        out = b""
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        os.close(master)
        assert p.wait(60) == 0
        return out

    for args in (["ls", "--json"], ["ls"], ["show", "held"]):
        fast, slow = on_pty(True, *args), on_pty(False, *args)
        assert _no_age(fast) == _no_age(slow), (args, fast, slow)
    assert on_pty(True, "ls", "--json").startswith(b"[\r\n  {")  # indented: it saw a terminal


def test_the_server_runs_the_command_and_its_end_is_the_clients(install, daemon):
    """A `colo wait` is a child of the server holding the client's stdout; the client's SIGINT is
    its; a client killed with -9 takes its command with it. In the caller's locale, and in the C
    locale (no LANG, no LC_*: Python's start coerces it), a server of its own for each."""
    held = daemon.submit("--hold", "--process", "--gpus", "0", "--name", "held", "--", "true")
    c_locale = {k: v for k, v in install.env().items() if not k.startswith(("LANG", "LC_"))}
    for env, how in ((install.env(), "sigint"), (install.env(), "kill"), (c_locale, "sigint"), (c_locale, "kill")):
        if how == "sigint":
            server = install.server(env=env)
        p = subprocess.Popen(install.argv("wait", str(held)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env)
        pipe = os.readlink(f"/proc/{p.pid}/fd/1")
        child = wait_for(lambda: [c for c in _children(server) if _fd1(c) == pipe], 60,
                         "a child of the server writing to the client's pipe")[0]
        if how == "sigint":
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=60)
            # out.run's answer to Ctrl-C; or, had it come before the command began (still taking the
            # client's environment, or importing), an end by SIGINT, as a fresh interpreter's then
            assert out == b"" and (p.returncode == 130 and err.startswith(b"\n") or p.returncode == -signal.SIGINT), \
                (p.returncode, err)
        else:
            p.kill()
            p.wait(60)
            assert _gone(child), "the command outlived its client"
        assert _gone(child)
    assert daemon.job(held)["state"] == "queued"


def test_an_edit_of_a_loaded_module_is_seen_at_the_next_call(install, daemon):
    daemon.submit("--hold", "--process", "--gpus", "0", "--name", "held", "--", "true")
    server = install.server()
    before = install.run("ls")
    assert before.returncode == 0 and b"NAME" in before.stdout
    view = install.root / "lib" / "colo" / "cli" / "lsview.py"
    text = view.read_text()
    assert '("NAME", ' in text
    view.write_text(text.replace('("NAME", ', '("JOBNAME", '))
    after = install.run("ls")
    assert after.returncode == 0 and b"JOBNAME" in after.stdout, after
    assert _gone(server), "a stale server stays"
    again = install.run("ls")  # (a new server starts with the edit)
    assert b"JOBNAME" in again.stdout


def test_another_users_folder_or_server_is_never_used(bare, users):
    """bob's folder made first by alice: no fast path (and no server), the command works; a socket
    in bob's folder that root listens at: bob's client hangs up without sending a byte; bob's
    server answers no one but bob."""
    alice, bob = users
    expected = bare.run("ls", fast=False, user=bob)
    assert expected.returncode == 1 and expected.stderr.startswith(b"colo: ")  # (no daemon to reach)
    squat = Path(f"/tmp/colo-fast-{bob.pw_uid}")
    shutil.rmtree(squat, ignore_errors=True)
    squat.mkdir(mode=0o700)
    os.chown(squat, alice.pw_uid, alice.pw_gid)
    try:
        env = {k: v for k, v in bare.env(uid=bob.pw_uid).items() if k != "XDG_RUNTIME_DIR"}
        for _ in range(2):
            r = bare.run("ls", user=bob, env=env)
            assert (r.returncode, r.stdout, r.stderr) == (expected.returncode, expected.stdout, expected.stderr)
        assert not _servers(str(bare.root)), "a server started in a folder that is not bob's"
    finally:
        shutil.rmtree(squat, ignore_errors=True)

    server = bare.server(bob.pw_uid, user=bob)
    (path,) = bare.sockets(bob.pw_uid)
    # root (another uid) asks bob's server: no answer, the connection closed
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(path))
    s.settimeout(60)
    try:
        s.sendall(b"\0" * 64)
        answer = s.recv(64)
    except (BrokenPipeError, ConnectionResetError):  # (closed before our bytes were sent, or with them unread)
        answer = b""
    assert answer == b""
    s.close()
    # bob's server gone, root listens at its socket: bob's client sees root's uid and sends nothing
    os.kill(server, signal.SIGKILL)
    assert _gone(server)
    path.unlink()
    fake = socket.socket(socket.AF_UNIX)
    fake.bind(str(path))
    os.chmod(path, 0o777)  # (bob may connect)
    fake.listen(4)
    fake.settimeout(120)
    heard = []

    def listen():
        conn, _ = fake.accept()
        conn.settimeout(60)
        heard.append(conn.recv(1 << 16))
        conn.close()

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    r = bare.run("ls", user=bob)
    t.join(60)
    fake.close()
    assert heard == [b""], "bob's client sent to a server of another uid"
    assert (r.returncode, r.stdout, r.stderr) == (expected.returncode, expected.stdout, expected.stderr)


def test_colo_fast_0_and_other_commands_take_the_script(native_dir, tmp_path):
    """Without a server (COLO_FAST=0, or a command not in HOT) nothing starts one."""
    inst = Install(native_dir / "colo-client", str(tmp_path / "none.sock"))
    try:
        for args, env in ((["ls"], inst.env(fast=False)), (["--version"], inst.env()), (["hold"], inst.env()),
                          ([], inst.env())):
            r = inst.run(*args, env=env)
            assert b"Traceback" not in r.stderr and (r.stdout or r.stderr), r
        assert not _servers(str(inst.root))
    finally:
        inst.close()


def test_the_server_holds_nothing_of_its_first_caller(native_dir, tmp_path):
    """The call that starts the server leaves it none of its descriptors: a pipe it was given is at
    its end once that call is (`x=$(colo ls)` returns)."""
    inst = Install(native_dir / "colo-client", str(tmp_path / "none.sock"))
    try:
        first = inst.server()  # (once the install's files are older than a server's start: it stays)
        os.kill(first, signal.SIGKILL)
        assert _gone(first)
        for sock in inst.sockets(os.getuid()):
            sock.unlink()
        r, w = os.pipe()
        p = subprocess.run(inst.argv("ls"), stdout=w, stderr=w, pass_fds=(w,), env=inst.env(), timeout=120)
        os.close(w)
        out = b""
        while True:
            assert select.select([r], [], [], 60)[0], "the pipe is held open"
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            out += chunk
        os.close(r)
        assert p.returncode == 1 and out.startswith(b"colo: "), out
        assert wait_for(lambda: _answering(inst.sockets(os.getuid())), 60, "the command server")  # (it started)
    finally:
        inst.close()
