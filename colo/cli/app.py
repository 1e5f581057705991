"""The `colo` command's typer app: --help, shell completion, and the commands that do not talk to the
daemon (daemon, run-budgeted, doctor, demo, sim, profile).

The daemon's commands are built here from colo/cli/options.py's table, each calling the same
function colo/cli/entry.py runs without typer: one place says what a command takes.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import List, Optional

import typer

from . import sessions as cli_sessions
from . import sim as cli_sim
from .acctview import HISTORY_TTY_ROWS  # noqa: F401 - where tests and scripts have found it
from .options import COMMANDS, Arg, Cmd, Opt
from . import out
from ..client import Client, ClientError
from ..textsafe import safe
from ..units import BadSize, parse_size

app = typer.Typer(help="colo: share this node's GPUs: a queue, memory budgets, MPS or time-slicing.",
                  no_args_is_help=True, pretty_exceptions_enable=False)  # --install-completion: bash, zsh, fish


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"colo {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print colo's version and exit")):
    """colo: share this node's GPUs: a queue, memory budgets, MPS or time-slicing."""


def fail(msg: str, code: int = 1) -> None:
    typer.echo(f"colo: {safe(msg)}", err=True)  # daemon errors may quote what a user typed
    raise typer.Exit(code)


def _call(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except ClientError as e:
        fail(str(e))


# the daemon's commands, from the table -------------------------------------------------------
def _completer(which: str):
    def jobs(incomplete: str) -> list[str]:
        from .complete import job_words

        return job_words(incomplete, open_only=which == "open")
    return jobs


def _param(p: Arg | Opt) -> inspect.Parameter:
    done = _completer(p.complete) if p.complete else None
    if isinstance(p, Arg):
        default = typer.Argument(... if p.required else None, help=p.help, autocompletion=done, show_default=False)
        kind = Optional[List[str]] if p.many else str
    elif p.type is bool:
        default, kind = typer.Option(False, *p.names, help=p.help), bool
    else:
        default = typer.Option(p.default, *p.names, help=p.help, min=p.min, envvar=p.envvar, metavar=p.metavar,
                               autocompletion=done, show_default=p.default not in (None, []))
        kind = List[p.type] if p.many else Optional[p.type]
    return inspect.Parameter(p.dest, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)


def _command(cmd: Cmd):
    module, _, name = cmd.run.partition(":")
    many = [p.dest for p in cmd.params if isinstance(p, Arg) and p.many]

    def run(**kw):
        from importlib import import_module

        for k in many:  # typer gives None for a list argument left out
            kw[k] = kw[k] or []
        raise typer.Exit(out.run(getattr(import_module(module), name), kw))

    run.__signature__ = inspect.Signature([_param(p) for p in cmd.params])
    run.__name__ = name
    settings = {} if cmd.interspersed else {"allow_interspersed_args": False}
    app.command(cmd.name, help=f"{cmd.summary}\n\n{cmd.help}", short_help=cmd.summary,
                context_settings=settings)(run)
    for alias in cmd.aliases:
        app.command(alias, help=f"The same as `colo {cmd.name}`.\n\nExample: colo {alias} 7",
                    short_help=f"The same as `colo {cmd.name}`.", context_settings=settings)(run)


for _cmd in COMMANDS:
    _command(_cmd)


# the daemon ----------------------------------------------------------------------------------
@app.command()
def daemon(
    socket: Optional[Path] = typer.Option(None, "--socket", envvar="COLO_SOCKET", help="where to listen"),
    state_dir: Optional[Path] = typer.Option(None, "--state-dir", envvar="COLO_STATE_DIR",
                                             help="where the database, logs and profiles are kept"),
    config: Optional[Path] = typer.Option(None, "--config", envvar="COLO_CONFIG", help="TOML file"),
    fake_gpus: Optional[Path] = typer.Option(None, "--fake-gpus", help="use this simulated-driver state file"),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="log each decision and start"),
):
    """Run the colo daemon in the foreground.

    Example: sudo colo daemon --config /etc/colo.toml -v
    """
    import asyncio
    import os
    import sys

    from ..config import Config, ConfigError
    from ..daemon.core import AlreadyRunning
    from ..daemon.server import serve
    from ..daemon.systemd import setup_logging
    from ..store import StoreError

    setup_logging(verbose)
    try:
        cfg = Config.load(config, socket=socket, state_dir=state_dir, fakegpu_state=fake_gpus)
    except ConfigError as e:  # 78 (EX_CONFIG): the unit's RestartPreventExitStatus, no restart loop
        fail(str(e), 78)
    try:
        if os.geteuid() != 0 and socket is None:  # clients look for the system daemon unless told
            print(f"colo: a private daemon on {cfg.socket}: its clients need COLO_SOCKET={cfg.socket}",
                  file=sys.stderr)
        asyncio.run(serve(cfg, lambda: Config.load(config, socket=socket, state_dir=state_dir, fakegpu_state=fake_gpus)))
    except (ConfigError, AlreadyRunning, StoreError, RuntimeError, PermissionError) as e:
        fail(str(e))


@app.command("run-budgeted", context_settings={"allow_interspersed_args": False})
def run_budgeted(command: List[str] = typer.Argument(..., help="the command, after --"),
                 gpu_mem: str = typer.Option(..., "--gpu-mem", help="budget per GPU, e.g. 2GiB")):
    """Run one command under the memory-budget interposer, without the daemon.

    Example: colo run-budgeted --gpu-mem 2GiB -- python infer.py
    """
    from ..node import interposer

    try:
        budget = parse_size(gpu_mem)
    except BadSize as e:
        fail(str(e))
    raise typer.Exit(interposer.run_budgeted(list(command), budget))


@app.command()
def doctor(sock: Optional[Path] = typer.Option(None, "--socket", envvar="COLO_SOCKET", help="daemon socket")):
    """Check the pieces colo needs: interposer, NVML, MPS, Docker (as the daemon reaches it), daemon.

    Example: colo doctor
    """
    from .doctor import run_checks

    ok = run_checks(sock)
    raise typer.Exit(0 if ok else 1)


@app.command()
def demo(keep: bool = typer.Option(False, "--keep", help="keep the demo's state dir afterwards"),
         screenshot: Optional[Path] = typer.Option(None, "--screenshot", metavar="SVG",
                                                   help="save `colo top` as it stood while heavy-2 was kept off")):
    """Try colo on simulated GPUs: a private daemon, a handful of jobs, a summary.

    Example: colo demo --keep   ·   colo demo --screenshot docs/top.svg  (the README's picture)
    """
    from .demo import run_demo

    if screenshot is not None and not screenshot.parent.is_dir():
        fail(f"demo: no folder {screenshot.parent} for the screenshot", 2)
    raise typer.Exit(run_demo(keep=keep, screenshot=screenshot))


def _history_rows() -> list[dict]:
    return _call(Client(None).history, full=True)["jobs"]


cli_sim.load_history_rows = _history_rows  # `colo sim --from-history` replays what the daemon ran
cli_sim.register(app)
cli_sessions.register(app)  # colo shell, colo run, colo kernelspec


def main() -> None:
    app()


if __name__ == "__main__":
    main()
