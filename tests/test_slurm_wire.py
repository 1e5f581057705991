"""The lines colo's SPANK plugin sends the daemon itself (issue 49 item 5): the batch script's end
and the job's end, so that a job costs one Python start, not three.

The plugin's own C (native/slurm/colo_spank.c, included whole into a small caller linked against
libslurm) formats the lines and talks to real sockets: its lines are colo/protocol.py's byte for
byte; it sends them only to a socket in a root-owned folder no one else may write, answered by a
root peer; it tells a peer that went away mid-request (the helper then runs with --lost) from one
that refused or hung. The daemon refuses these lines from a non-root peer, and malformed ones."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from colo import protocol
from harness.daemon import as_user

SRC = Path(__file__).resolve().parent.parent / "native" / "slurm"
# The caller (spank_* are slurmstepd's: stubs, never called): `line J STATUS` prints the two lines the plugin sends and its OK head; `tell SOCKET
# TIMEOUT J` sends the end of job J as the epilog does and prints what came of it (enum tell).
CALLER = r"""
#include "colo_spank.c"
int spank_remote(spank_t sp) { (void)sp; return 0; }
spank_err_t spank_option_register(spank_t sp, struct spank_option *o) { (void)sp; (void)o; return ESPANK_ERROR; }
spank_err_t spank_get_item(spank_t sp, spank_item_t i, ...) { (void)sp; (void)i; return ESPANK_ERROR; }
spank_err_t spank_getenv(spank_t sp, const char *v, char *b, int n) { (void)sp; (void)v; (void)b; (void)n; return ESPANK_ERROR; }
spank_err_t spank_setenv(spank_t sp, const char *v, const char *x, int o) { (void)sp; (void)v; (void)x; (void)o; return ESPANK_ERROR; }
int main(int argc, char **argv)
{
    char line[256], why[1400] = "";
    if (argc == 4 && !strcmp(argv[1], "line")) {
        printf(COLO_BATCH_EXIT_FMT, (uint32_t)strtoul(argv[2], NULL, 10), (unsigned)strtoul(argv[3], NULL, 10));
        printf(COLO_END_FMT, (uint32_t)strtoul(argv[2], NULL, 10));
        printf("%s\n", COLO_OK_HEAD);
        return 0;
    }
    if (argc != 5 || strcmp(argv[1], "tell"))
        return 2;
    snprintf(g_socket, sizeof g_socket, "%s", argv[2]);
    g_timeout = atoi(argv[3]);
    snprintf(line, sizeof line, COLO_END_FMT, (uint32_t)atoi(argv[4]));
    static const char *names[] = {"TOLD", "UNREACHED", "LOST", "REFUSED", "HUNG"};
    enum tell t = tell_daemon(line, why, sizeof why);
    printf("%s %s\n", names[t], why);
    return 0;
}
"""


# Another user's listener: `up` once it listens, then how many bytes its one caller sent.
LISTENER = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(1)
print("up", flush=True)
c, _ = s.accept()
c.settimeout(5)
print("got", len(c.recv(100)))
"""


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    if not Path("/usr/include/slurm/spank.h").exists() or shutil.which("cc") is None:
        if os.environ.get("COLO_REQUIRE_SLURM") == "1":
            pytest.fail("COLO_REQUIRE_SLURM=1 but Slurm's headers (libslurm-dev) or cc are missing")
        pytest.skip("Slurm's headers (libslurm-dev) or cc are missing")
    d = tmp_path_factory.mktemp("wire")
    (d / "caller.c").write_text(CALLER)
    exe = d / "caller"
    r = subprocess.run(["cc", "-std=gnu11", "-Wall", "-I", str(SRC), "-o", str(exe), str(d / "caller.c"), "-lslurm"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


def tell(caller: Path, sock: Path | str, job: int = 7, timeout: int = 2) -> tuple[str, str]:
    out = subprocess.run([str(caller), "tell", str(sock), str(timeout), str(job)], capture_output=True, text=True,
                         timeout=60).stdout.strip()
    kind, _, why = out.partition(" ")
    return kind, why


def test_the_plugins_lines_are_the_protocols(caller):
    out = subprocess.run([str(caller), "line", "4294967295", "35072"], capture_output=True, text=True,
                         check=True).stdout.encode()
    batch, end, head, _ = out.split(b"\n")
    assert batch + b"\n" == protocol.slurm_request(protocol.SLURM_BATCH_EXIT, job=4294967295, status=35072)
    assert end + b"\n" == protocol.slurm_request(protocol.SLURM_END, job=4294967295)
    assert protocol.parse_request(batch) == ("slurm", {"action": "batch_exit", "job": 4294967295, "status": 35072})
    assert protocol.ok({"job": None}).startswith(head) and not protocol.error("no").startswith(head)
    with pytest.raises(ValueError):
        protocol.slurm_request(protocol.SLURM_END, job=1, status=0)


def _serve(path: Path, answer: bytes | None, got: list) -> threading.Thread:
    """A root peer at `path` that reads one line, then answers `answer` (None: closes at once)."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def run():
        c, _ = srv.accept()
        f = c.makefile("rb")
        got.append(f.readline())
        if answer:
            c.sendall(answer)
            c.recv(1)  # until the caller closes
        c.close()
        srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_plugin_tells_only_a_root_peer_in_a_folder_only_root_writes(caller, daemon, other_user):
    assert os.geteuid() == 0
    # a real daemon: the end of a job it does not follow is taken (and changes nothing)
    assert tell(caller, daemon.socket) == ("TOLD", "")
    assert daemon.client.ls(all=True) == []
    top = Path(tempfile.mkdtemp(prefix="colo-wire-"))
    try:
        os.chmod(top, 0o755)
        ok = top / "ok"
        ok.mkdir(mode=0o755)
        # a folder others may write: nothing is sent (another user could have put the socket there)
        loose = top / "loose"
        loose.mkdir()
        os.chmod(loose, 0o777)
        got: list = []
        _serve(loose / "s.sock", protocol.ok({}), got)
        kind, why = tell(caller, loose / "s.sock")
        assert kind == "UNREACHED" and "is not a folder of root's that only root may write" in why, why
        # a symlink to a good folder is not followed
        (top / "link").symlink_to(ok)
        kind, why = tell(caller, top / "link" / "s.sock")
        assert kind == "UNREACHED" and "not a folder of root's" in why, why
        assert got == []
        # a socket that another user listens on, though root's folder holds it and root owns its file
        theirs = subprocess.Popen(["/usr/bin/python3", "-I", "-c", LISTENER, str(loose / "theirs.sock")], stdout=subprocess.PIPE,
                                  user=other_user.pw_uid, group=other_user.pw_gid, extra_groups=[])
        assert theirs.stdout.readline() == b"up\n"
        os.rename(loose / "theirs.sock", ok / "theirs.sock")
        os.chown(ok / "theirs.sock", 0, 0)
        kind, why = tell(caller, ok / "theirs.sock")
        assert kind == "UNREACHED" and "is not answered by root" in why, why
        assert theirs.communicate(timeout=60)[0] == b"got 0\n"  # it was sent nothing
        # a root peer that goes away in the middle, one that refuses, one that never answers
        got = []
        _serve(ok / "gone.sock", None, got)
        assert tell(caller, ok / "gone.sock", 9) == ("LOST", "colo's daemon went away while answering")
        assert got == [protocol.slurm_request(protocol.SLURM_END, job=9)]
        _serve(ok / "no.sock", protocol.error("no such thing", protocol.INVALID), [])
        kind, why = tell(caller, ok / "no.sock")
        assert kind == "REFUSED" and "no such thing" in why, why
        hung = socket.socket(socket.AF_UNIX)
        hung.bind(str(ok / "hung.sock"))
        hung.listen(1)  # accepted by the kernel, never read: the caller gives up after (2 + 1) / 2 s
        assert tell(caller, ok / "hung.sock") == ("HUNG", "colo's daemon did not answer within 1 s")
        hung.close()
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _raw(path: str, line: bytes) -> dict:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(path)
    s.sendall(line)
    return protocol.loads(s.makefile("rb").readline())


def test_the_daemon_refuses_these_lines_from_others_and_malformed_ones(shared_daemon, other_user):
    d = shared_daemon
    end = protocol.slurm_request(protocol.SLURM_END, job=1)
    kind, reply = as_user(other_user, lambda: _raw(str(d.socket), end))
    assert kind == "ok" and reply["ok"] is False and reply["code"] == protocol.FORBIDDEN, reply
    kind, reply = as_user(other_user, lambda: _raw(str(d.socket), protocol.slurm_request(
        protocol.SLURM_BATCH_EXIT, job=1, status=0)))
    assert reply["code"] == protocol.FORBIDDEN, reply
    assert _raw(str(d.socket), end) == {"v": 1, "ok": True, "result": {"job": None}}  # root: taken
    for bad in (b'{"v":1,"op":"slurm","args":{"action":"end","job":"1"}}\n',
                b'{"v":1,"op":"slurm","args":{"action":"end","job":0}}\n',
                b'{"v":1,"op":"slurm","args":{"action":"batch_exit","job":1,"status":-1}}\n',
                b'{"v":1,"op":"slurm","args":{"action":"end","job":1,"evil":"$(reboot)"}}\n',
                b'{"v":1,"op":"slurm","args":{"action":"rm -rf","job":1}}\n',
                b'{"v":1,"op":"slurm","args":{"action":"end","job":1}\n',
                b'{"v":1,"op":"slurm","args":{"action":"attach","job":1,"uid":0,"gid":0,"gpu_mem":1073741824,'
                b'"gpu_index":[0],"comment":"a\\nb"}}\n'):
        reply = _raw(str(d.socket), bad)
        assert reply["ok"] is False and reply["code"] in (protocol.BAD_REQUEST, protocol.INVALID), (bad, reply)
    assert d.client.ls(all=True) == []
