"""Man pages for `colo` and each of its commands, made from the typer app itself: the commands of
colo/cli/options.py's table and app.py's own, with the help `--help` prints, so that the two never
disagree. colo.1 lists the commands; colo-COMMAND.1 (colo-profile-ls.1 for a group's command) says
what one takes.

    python -m colo.cli.manpage OUTDIR      (packaging/build-deb.sh: /usr/share/man/man1)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import typer
import typer.main

from .. import __version__
from .app import app

SECTION = "1"


def _roff(text: str) -> str:
    """Plain text as roff: backslashes and hyphens escaped, no line read as a request."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    text = "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in text)  # man pages stay ASCII
    return "\n".join("\\&" + line if line[:1] in (".", "'") else line for line in text.splitlines())


def _paragraphs(help_text: str) -> tuple[list[str], list[str]]:
    """A command's help, less its first line (the NAME's): (paragraphs, examples)."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", help_text.replace("\b", "")) if p.strip()]
    body, examples = [], []
    for p in paras[1:]:
        if p.startswith("Example") or (examples and p.startswith("\u00b7")):  # "· b": one more
            text = p.split(":", 1)[1] if p.startswith("Example") else p
            examples.extend(e.strip() for line in text.strip().splitlines()
                            for e in line.split("\u00b7") if e.strip())  # "a · b": two examples
        else:
            body.append(" ".join(line.strip() for line in p.splitlines()))
    return body, examples


def _commands(group, ctx, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object, object]]:
    """(words after `colo`, command, its context) for every command that is not a group, depth first."""
    out = []
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        sub = type(ctx)(cmd, info_name=name, parent=ctx)
        if hasattr(cmd, "list_commands"):
            out.extend(_commands(cmd, sub, (*prefix, name)))
        else:
            out.append(((*prefix, name), cmd, sub))
    return out


def _summary(cmd) -> str:
    return (cmd.short_help or (cmd.help or "").strip().split("\n", 1)[0]).strip().rstrip(".")


def _options(cmd, ctx) -> list[str]:
    lines = []
    for p in cmd.params:
        if getattr(p, "hidden", False):
            continue
        if p.param_type_name == "argument":
            lines += [".TP", f".I {_roff(_metavar(p))}"]
            lines.append(_roff(getattr(p, "help", None) or ""))
            continue
        names = ", ".join(f"\\fB{_roff(n)}\\fR" for n in (*p.opts, *p.secondary_opts))
        meta = "" if p.is_flag else f" \\fI{_roff(_metavar(p))}\\fR"
        text = p.help or ""
        if p.show_default and p.default not in (None, False, [], ()) and not callable(p.default):
            text += f" (default: {p.default})"
        if p.envvar:
            text += f" (environment: {p.envvar})"
        lines += [".TP", names + meta, _roff(text)]
    return lines


def _metavar(p) -> str:
    """The option's metavar where the table gives one (PATH), else its name (REASON); GPUS... for an
    argument that repeats."""
    name = p.metavar or (p.name or "").upper()
    return name + ("..." if p.param_type_name == "argument" and p.nargs == -1 else "")


def _page(words: tuple[str, ...], cmd, ctx) -> str:
    title = "colo-" + "-".join(words)
    body, examples = _paragraphs(cmd.help or "")
    usage = " ".join(["[OPTIONS]", *(_metavar(a) if a.required else f"[{_metavar(a)}]"
                                     for a in cmd.params if a.param_type_name == "argument")])
    lines = [f'.TH {_roff(title.upper())} {SECTION} "" "colo {__version__}" "colo manual"',
             ".SH NAME", f"{_roff(title)} \\- {_roff(_summary(cmd))}",
             ".SH SYNOPSIS", f".B colo {_roff(' '.join(words))}", _roff(usage),
             ".SH DESCRIPTION"]
    for p in body or [_summary(cmd) + "."]:
        lines += [".PP", _roff(p)]
    opts = _options(cmd, ctx)
    if opts:
        lines += [".SH OPTIONS", *opts]
    if examples:
        lines += [".SH EXAMPLES", ".nf", *(_roff(e) for e in examples), ".fi"]
    lines += [".SH SEE ALSO", "\\fBcolo\\fR(1)"]
    return "\n".join(lines) + "\n"


def _index(root, ctx, commands) -> str:
    lines = [f'.TH COLO {SECTION} "" "colo {__version__}" "colo manual"',
             ".SH NAME", f"colo \\- {_roff(_summary(root).removeprefix('colo: '))}",
             ".SH SYNOPSIS", ".B colo", "\\fICOMMAND\\fR [\\fIOPTIONS\\fR] [\\fIARGS\\fR]...",
             ".SH DESCRIPTION", ".PP",
             _roff("colo queues jobs with a GPU-memory budget and starts each as soon as it fits, as an MPS "
                   "client or time-sliced, beside what already runs. Each command has a page of its own, "
                   "colo-COMMAND(1); `colo COMMAND --help` says the same."),
             ".SH COMMANDS"]
    for words, cmd, _ in commands:
        lines += [".TP", f"\\fBcolo {_roff(' '.join(words))}\\fR", _roff(_summary(cmd)) + "."]
    opts = _options(root, ctx)
    if opts:
        lines += [".SH OPTIONS", *opts]
    lines += [".SH FILES", ".TP", "/etc/colo/colo.toml", _roff("the daemon's config (colo config check FILE checks it)"),
              ".TP", "/usr/share/colo/colo.toml", _roff("every key with its default"),
              ".TP", "/run/colo/colo.sock", _roff("the system daemon's socket, where every user's colo looks"),
              ".SH SEE ALSO",
              ", ".join(f"\\fB{_roff('colo-' + '-'.join(w))}\\fR({SECTION})" for w, _, _ in commands)]
    return "\n".join(lines) + "\n"


def _fakegpu() -> str:
    """colo-fakegpu(1), from its argparse parser: each command's own help, as `COMMAND --help` prints it."""
    import argparse

    from ..node.fakegpu import _parser

    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    lines = [f'.TH COLO\\-FAKEGPU {SECTION} "" "colo {__version__}" "colo manual"',
             ".SH NAME", f"colo\\-fakegpu \\- {_roff(p.description.rstrip('.'))}",
             ".SH SYNOPSIS", ".B colo\\-fakegpu", "\\fICOMMAND\\fR \\fIPATH\\fR [\\fIARGS\\fR]...",
             ".SH DESCRIPTION", ".PP", _roff(p.description), ".SH COMMANDS"]
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, parser in sub.choices.items():
        lines += [".SS " + _roff(name), _roff(helps.get(name) or ""), ".PP", ".nf",
                  _roff(parser.format_help().rstrip()), ".fi"]
    lines += [".SH EXAMPLES", ".nf", _roff(p.epilog.removeprefix("Example: ")), ".fi",
              ".SH SEE ALSO", "\\fBcolo\\fR(1), \\fBcolo\\-daemon\\fR(1)"]
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    """File name -> the page's roff text, for colo, every command, and colo-fakegpu."""
    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="colo")
    commands = _commands(root, ctx)
    out = {f"colo.{SECTION}": _index(root, ctx, commands)}
    for words, cmd, sub in commands:
        out[f"colo-{'-'.join(words)}.{SECTION}"] = _page(words, cmd, sub)
    out[f"colo-fakegpu.{SECTION}"] = _fakegpu()
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m colo.cli.manpage OUTDIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, text in pages().items():
        (out / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
