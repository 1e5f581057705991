"""Issue 42: the man pages are made from the typer app itself (colo/cli/manpage.py), so that they
say what `--help` says: a page for every command, every option and argument on it, and roff that
groff renders without a warning (as lintian's check does)."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import typer.main

from colo.cli import manpage
from colo.cli.app import app
from colo.cli.options import COMMANDS


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    out = tmp_path_factory.mktemp("man")
    assert manpage.main([str(out)]) == 0
    return out


def _commands():
    root = typer.main.get_command(app)
    return manpage._commands(root, root.context_class(root, info_name="colo"))


def test_every_command_has_a_page_with_every_option_it_takes(pages):
    commands = _commands()
    index = (pages / "colo.1").read_text()
    for words, cmd, _ in commands:
        page = (pages / f"colo-{'-'.join(words)}.1").read_text()
        assert f"\\fBcolo {manpage._roff(' '.join(words))}\\fR" in index
        for p in cmd.params:
            if p.param_type_name == "argument":
                assert manpage._roff(manpage._metavar(p)) in page, (words, p.name)
            for name in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())):
                if p.param_type_name == "option":
                    assert f"\\fB{manpage._roff(name)}\\fR" in page, (words, name)
            if getattr(p, "help", None):
                assert manpage._roff(p.help.split(".")[0]) in page.replace("\n", " "), (words, p.name)
    # the options' table is what the daemon's commands are made of: each of its commands is here
    names = {w[0] for w, _, _ in commands}
    assert {c.name for c in COMMANDS} | {a for c in COMMANDS for a in c.aliases} <= names
    assert {"daemon", "doctor", "config", "drain", "undrain"} <= names
    assert len(list(pages.glob("*.1"))) == len(commands) + 2  # colo.1, and colo-fakegpu.1:


def test_colo_fakegpu_has_a_page_with_each_of_its_commands(pages):
    import argparse

    from colo.node.fakegpu import _parser

    page = (pages / "colo-fakegpu.1").read_text()
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sub.choices and all(f".SS {manpage._roff(name)}\n" in page for name in sub.choices)
    assert ".SS xid\n" in page and ".SS ecc\n" in page


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_groff_renders_every_page_without_a_warning(pages):
    for f in sorted(pages.glob("*.1")):
        r = subprocess.run(["groff", "-man", "-ww", "-z", str(f)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stderr == "", (f.name, r.stderr)
        assert f.read_text().isascii(), f.name
