"""Shell completion of job ids and names (`colo --install-completion` sets it up: bash, zsh, fish).

Both the typer commands (their autocompletion callbacks) and the fast path below offer the same
words, asked of the daemon: the caller's open jobs (with `jobs`, also the newest ended ones), as
ids, names and, once a `_` is typed, ARRAY_INDEX. A key press asks the daemon without importing
typer: `fast()` answers what shells send (typer's own protocol: _COLO_COMPLETE, COMP_WORDS and
COMP_CWORD for bash, _TYPER_COMPLETE_ARGS for zsh and fish) when the word is a job argument;
anything else (an option's name, a file) goes to typer.
"""
from __future__ import annotations

import os
import sys

RECENT = 20  # ended jobs offered besides the open ones


def job_words(incomplete: str, open_only: bool = False) -> list[str]:
    from ..client import Client, ClientError

    c = Client(os.environ.get("COLO_SOCKET") or None, timeout=2)
    users = None if os.getuid() == 0 else [_me()]
    fields = ["id", "name", "array"]
    try:
        rows = c.ls_fields(fields, all=False, users=users)["rows"]
        if not open_only:
            rows += c.ls_fields(fields, states=["succeeded", "failed", "cancelled", "lost"], users=users,
                                limit=RECENT)["rows"]
    except ClientError:
        return []
    words = [str(i) for i, _, _ in sorted(rows)]
    words += sorted({n for _, n, _ in rows if n})
    if "_" in incomplete:
        words += [a for _, _, a in rows if a]
    return [w for w in dict.fromkeys(words) if w.startswith(incomplete)]


def _me() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _words(shell: str) -> tuple[list[str], str] | None:
    """(the words before the one being completed, without the program's; that word)."""
    if shell == "bash":
        words = os.environ.get("COMP_WORDS", "").split()
        try:
            cword = int(os.environ.get("COMP_CWORD", ""))
        except ValueError:
            return None
        return words[1:cword], (words[cword] if cword < len(words) else "")
    line = os.environ.get("_TYPER_COMPLETE_ARGS", "")
    args = line.split()[1:]
    if args and not line.endswith(" "):
        return args[:-1], args[-1]
    return args, ""


def _slot(args: list[str], incomplete: str) -> str | None:
    """Which kind of job (jobs, open) the word being completed is, or None when it is not a job."""
    from .options import BY_NAME, Arg, Opt

    if not args or incomplete.startswith("-"):
        return None
    cmd = BY_NAME.get(args[0])
    if cmd is None:
        return None
    opts = {n: p for p in cmd.params if isinstance(p, Opt) for n in p.names}
    before = opts.get(args[-1]) if len(args) > 1 else None
    if before is not None and before.type is not bool:
        return before.complete  # the value of an option (--after: a job)
    n, i = 0, 1
    while i < len(args):
        a = args[i]
        if a == "--":
            n += len(args) - i - 1
            break
        o = opts.get(a.partition("=")[0])
        if o is not None:
            i += 2 if o.type is not bool and "=" not in a else 1
            continue
        n += 1
        i += 1
    arg = next((p for p in cmd.params if isinstance(p, Arg)), None)
    if arg is None or not arg.complete or (n and not arg.many):
        return None
    return arg.complete


def fast() -> bool:
    """Answer a shell's completion request for a job argument; False: typer answers it."""
    shell = os.environ.get("_COLO_COMPLETE", "").removeprefix("complete_")
    if shell not in ("bash", "zsh", "fish"):
        return False
    got = _words(shell)
    if got is None:
        return False
    args, incomplete = got
    which = _slot(args, incomplete)
    if which is None:
        return False
    words = job_words(incomplete, open_only=which == "open")
    if shell == "bash":
        out = "\n".join(words)
    elif shell == "zsh":  # as typer's ZshComplete writes them
        def esc(s: str) -> str:
            return s.replace('"', '""').replace("'", "''").replace("$", "\\$").replace("`", "\\`").replace(":", r"\\:")
        out = "_arguments '*: :((" + "\n".join(f'"{esc(w)}"' for w in words) + "))'" if words else "_files"
    else:
        action = os.environ.get("_TYPER_COMPLETE_FISH_ACTION", "")
        if action == "is-args":
            sys.exit(0 if words else 1)
        out = "\n".join(words)
    if out:
        sys.stdout.write(out + "\n")
    return True
