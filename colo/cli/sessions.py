"""`colo shell`, `colo run` (a job attached to this terminal, colo/cli/attach.py), `colo attach`
(a detached session's terminal taken over), and `colo kernelspec install` (notebooks' kernels as
colo jobs, colo/jupyter/). The first three run from colo/cli/options.py's table without typer (a
session's start is a person waiting); kernelspec is registered on the typer app by register()."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from ..client import Client
from .out import Fail, echo
from .submitspec import build_spec


def _keys(given: Optional[str]) -> bytes:
    from . import attach

    try:
        return attach.detach_keys(given or os.environ.get("COLO_DETACH_KEYS") or attach.DETACH_KEYS)
    except ValueError as e:
        raise Fail(str(e)) from None


def _attached(command: list[str], sock: Optional[str], gpu_mem: Optional[str], gpus: Optional[int],
              image: Optional[str] = None, detach: bool = False, pipe: bool = False, **opts) -> int:
    """Queue `command` as a session (a host process, or in a container of `image`) and be its
    terminal until it ends (its exit code); with `detach`, leave it to the daemon (0); with `pipe`,
    run it without a terminal, its stdin, stdout and stderr this client's (as `docker run -i`)."""
    from . import attach

    env = list(opts.pop("env"))
    if os.environ.get("TERM"):  # the job's terminal is this one's kind (set before --env: it may say otherwise)
        env.insert(0, f"TERM={os.environ['TERM']}")
    spec = build_spec(command, image=image, process=not image, gpu_mem=gpu_mem,
                      gpus=(1 if gpu_mem else 0) if gpus is None else gpus, env=env, **opts)
    if pipe and not detach:
        spec = {**spec, "pipe": True}
    if detach:
        job = Client(sock and Path(sock)).call("session", spec={**spec, "detach": True})
        echo(f"job {job['id']}: a detached session (colo attach {job['id']} takes its terminal)")
        return 0
    return attach.run(Client(sock and Path(sock)), spec)


def _login_shell() -> str:
    import pwd

    try:
        return os.environ.get("SHELL") or pwd.getpwuid(os.getuid()).pw_shell or "/bin/sh"
    except KeyError:
        return "/bin/sh"


def shell(command: list[str], sock: Optional[str] = None, gpu_mem: Optional[str] = None, gpus: Optional[int] = None,
          image: Optional[str] = None, detach: bool = False, name: Optional[str] = None, **opts) -> int:
    """`colo shell` (colo/cli/options.py)."""
    if not sys.stdin.isatty() and not detach:
        raise Fail("colo shell needs a terminal; for a command without one, colo run -- CMD")
    default = "/bin/sh" if image else _login_shell()  # (the host's login shell may not be in the image)
    return _attached(list(command or [default]), sock, gpu_mem, gpus, image, detach, name=name or "shell", **opts)


def run(command: list[str], sock: Optional[str] = None, gpu_mem: Optional[str] = None, gpus: Optional[int] = None,
        image: Optional[str] = None, detach: bool = False, **opts) -> int:
    """`colo run` (colo/cli/options.py)."""
    if not command:
        raise Fail("missing command: give it after `--`, e.g. colo run --gpu-mem 4GiB -- python train.py")
    # fed from a pipe or written to one: no terminal, stdout and stderr apart (docker run -i, ssh without -t)
    pipe = not (os.isatty(0) and os.isatty(1))
    return _attached(list(command), sock, gpu_mem, gpus, image, detach, pipe, **opts)


def attach(job: str, keys: Optional[str] = None, sock: Optional[str] = None) -> int:
    """`colo attach` (colo/cli/options.py)."""
    from . import attach as session

    if not job.isdigit():
        raise Fail(f"malformed job {job!r}: the detached session's job id, as colo shell --detach printed it")
    return session.run(Client(sock and Path(sock)), job=int(job), keys=_keys(keys))


def register(app) -> None:
    import typer

    from ..textsafe import safe

    gpus_opt = typer.Option(None, "--gpus", help="number of GPUs (default: 1 with --gpu-mem, else 0)")

    kernelspec = typer.Typer(help="Jupyter kernels that run as colo jobs, each with its GPU budget.",
                             no_args_is_help=True)
    app.add_typer(kernelspec, name="kernelspec")

    @kernelspec.command("install")
    def kernelspec_install(
        gpu_mem: Optional[str] = typer.Option(None, "--gpu-mem", help="each kernel's GPU budget, e.g. 4GiB "
                                              "(without it: kernels get no GPU)"),
        gpus: Optional[int] = gpus_opt,
        name: str = typer.Option("colo", "--name", help="the kernelspec's name (a folder under kernels/)"),
        display_name: Optional[str] = typer.Option(None, "--display-name", help="as notebooks list it"),
        python: Optional[str] = typer.Option(None, "--python", help="the Python that runs kernels (it needs "
                                             "ipykernel; default: python3 on PATH)"),
        prefix: Optional[Path] = typer.Option(None, "--prefix", help="install under PREFIX/share/jupyter "
                                              "(e.g. a virtual environment's) instead of your own data folder"),
        sock: Optional[Path] = typer.Option(None, "--socket", help="the daemon's socket, when not the default"),
    ):
        """Write a kernelspec whose kernels start as colo jobs (jupyter_client's provisioner `colo`),
        each held to its budget, queued and counted like any job.

        Example: colo kernelspec install --gpu-mem 4GiB   ·   colo kernelspec install --name big --gpu-mem 16GiB
        """
        from ..jupyter import kernelspec as ks

        try:
            where = ks.install(name=name, gpu_mem=gpu_mem, gpus=gpus, display_name=display_name, python=python,
                               prefix=prefix, socket=str(sock) if sock else None)
        except ks.KernelspecError as e:
            typer.echo(f"colo: {safe(str(e))}", err=True)
            raise typer.Exit(1) from None
        typer.echo(f"installed kernelspec {name} in {where}")
