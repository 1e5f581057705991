"""Issue 11 item 4 (invariant 10): text another user chose cannot drive your terminal.

A real second Unix user submits a job whose name, command and environment hold ESC sequences,
newlines, a C1 CSI and a bidi override; root then reads it with the real CLI. Nothing that
reaches the terminal may hold a control character (other than the line breaks colo itself
writes), no row may be forged, and --json keeps the exact value.
"""
from __future__ import annotations

import json

from colo.textsafe import safe, safe_all, safe_tree
from colo.client import Client
from harness.daemon import as_user

EVIL_NAME = "evil\x1b[2J\x1b[H\n99  root  running  forged\r\x9b31m\u202e"
EVIL_ARG = "x\x1b]0;pwned\x07\ny"


def controls(text: str) -> set[str]:
    """Control characters in text, leaving out the newlines between lines."""
    return {c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) <= 0x9f or c == "\u202e"}


def test_safe_escapes_controls_and_keeps_plain_text():
    assert safe("train-1 ü 日本") == "train-1 ü 日本"
    assert safe(EVIL_NAME) == "evil\\x1b[2J\\x1b[H\\n99  root  running  forged\\r\\x9b31m\\u202e"
    assert safe("a\nb\tc\x1b", keep="\n\t") == "a\nb\tc\\x1b"
    assert safe("bad \udcff byte") == "bad \\udcff byte"  # an undecodable byte, as surrogateescape carries it
    assert safe_tree({"E\x1b": ["\x1b", 3, None]}) == {"E\\x1b": ["\\x1b", 3, None]}
    plain = ["train-1", "root", "queued"]
    assert safe_all(plain) is plain  # a column with nothing to escape is checked in one go
    assert safe_all(["ok", EVIL_NAME, "日本"]) == ["ok", safe(EVIL_NAME), "日本"]


def test_another_users_job_cannot_forge_rows_or_clear_the_screen(shared, other_user):
    d = shared
    gate = d.root / "go"
    # names are refused unless plain (validate.py); a command is anything: its program is a link
    # to sh whose name holds the escapes, so `top` (which shows argv[0] of an unnamed job) meets them
    prog = d.root / "bin" / EVIL_NAME
    prog.parent.mkdir(mode=0o755)
    prog.symlink_to("/bin/sh")
    spec = {"argv": [str(prog), "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done", EVIL_ARG], "gpus": 0,
            "workdir": "/tmp", "env": {"K": EVIL_ARG}}
    # the other user's own process on the socket (the interpreter here is not readable to them)
    kind, j = as_user(other_user, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", j
    try:
        d.wait_state(j, "running")
        ls = d.cli("ls", check=True).stdout
        assert not controls(ls), ls
        assert len(ls.splitlines()) == 2  # the header and the one job: no forged row
        wide = d.cli("ls", "-o", "id,name,user,command,reason", "-w", check=True).stdout
        assert not controls(wide) and len(wide.splitlines()) == 2, wide
        assert "evil\\x1b[2J\\x1b[H\\n99" in wide and "x\\x1b]0;pwned\\x07\\ny" in wide, wide
        show = d.cli("show", str(j), check=True).stdout
        assert not controls(show), show
        assert "x\\x1b]0;pwned\\x07\\ny" in show and "evil\\x1b[2J\\x1b[H\\n99" in show
        assert not any(ln.startswith("99") for ln in show.splitlines())
        top = d.cli("top", "--once", check=True).stdout
        assert not controls(top), top
        assert not any(ln.split()[:1] == ["99"] for ln in top.splitlines())
        assert "evil\\x1b[2J" in top, top
        exact = json.loads(d.cli("ls", "--json", check=True).stdout)
        assert exact[0]["argv"] == spec["argv"] and exact[0]["argv"][-1] == EVIL_ARG
        # a daemon error quoting what a user typed is one escaped line too
        err = d.cli("submit", "--image", "no\x1b[2Jsuch", "--gpus", "0", "--", "true")
        assert err.returncode != 0 and not controls(err.stderr) and err.stderr.count("\n") == 1, err.stderr
    finally:
        gate.touch()
        d.wait_state(j, "succeeded", "failed", "cancelled")
