"""`colo shell`, `colo run` (a job attached to this terminal, colo/cli/attach.py) and `colo
kernelspec install` (notebooks' kernels as colo jobs, colo/jupyter/). Registered on the typer app
by register(); what they import is imported when they run."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..client import Client, ClientError
from ..textsafe import safe
from .out import Fail
from .submitspec import build_spec


def _fail(msg: str, code: int = 1) -> None:
    typer.echo(f"colo: {safe(msg)}", err=True)
    raise typer.Exit(code)


def _keys(given: Optional[str]) -> bytes:
    from . import attach

    try:
        return attach.detach_keys(given or os.environ.get("COLO_DETACH_KEYS") or attach.DETACH_KEYS)
    except ValueError as e:
        _fail(str(e))


def _attached(command: list[str], sock: Optional[Path], gpu_mem: Optional[str], gpus: Optional[int],
              image: Optional[str] = None, detach: bool = False, **opts) -> int:
    """Queue `command` as a session (a host process, or in a container of `image`) and be its
    terminal until it ends (its exit code); with `detach`, leave it to the daemon (0)."""
    from . import attach

    env = list(opts.pop("env"))
    if os.environ.get("TERM"):  # the job's terminal is this one's kind (set before --env: it may say otherwise)
        env.insert(0, f"TERM={os.environ['TERM']}")
    try:
        spec = build_spec(command, image=image, process=not image, gpu_mem=gpu_mem, gpus=(1 if gpu_mem else 0) if gpus is None else gpus,
                          env=env, **opts)
        if detach:
            job = Client(sock).call("session", spec={**spec, "detach": True})
            typer.echo(f"job {job['id']}: a detached session (colo attach {job['id']} takes its terminal)")
            return 0
        return attach.run(Client(sock), spec)
    except (Fail, ClientError) as e:
        _fail(str(e))


def _login_shell() -> str:
    import pwd

    try:
        return os.environ.get("SHELL") or pwd.getpwuid(os.getuid()).pw_shell or "/bin/sh"
    except KeyError:
        return "/bin/sh"


def register(app: typer.Typer) -> None:
    # the options a session shares with `colo submit`
    image_opt = typer.Option(None, "--image", help="run it in a container of this local image (as colo submit "
                             "--image; a shell's default command is then /bin/sh)")
    gpu_mem_opt = typer.Option(None, "--gpu-mem", help="GPU memory budget per GPU, e.g. 8GiB (without it: no GPU)")
    gpus_opt = typer.Option(None, "--gpus", help="number of GPUs (default: 1 with --gpu-mem, else 0)")
    name_opt = typer.Option(None, "--name", help="a name to refer to the job by")
    env_opt = typer.Option([], "--env", help="K=V, repeatable (TERM is this terminal's)")
    workdir_opt = typer.Option(None, "--workdir", help="folder it starts in (default: the current one)")
    time_opt = typer.Option(None, "--time", help="wall-time limit as Slurm reads it (minutes, HH:MM:SS, 2h)")
    cpus_opt = typer.Option(None, "--cpus", help="CPU limit in cores")
    mem_opt = typer.Option(None, "--mem", help="host memory limit, e.g. 8GiB")
    gpu_id_opt = typer.Option([], "--gpu-id", help="only these GPUs may take it (indices, e.g. 0,2)")
    gpu_type_opt = typer.Option(None, "--gpu-type", help="only GPUs whose name holds this text")
    priority_opt = typer.Option(0, "--priority", help="higher starts first")
    after_opt = typer.Option([], "--after", help="start only after this job succeeded (repeatable; an id, "
                             "ARRAY_INDEX or a name, as submit --after)")
    mount_opt = typer.Option([], "--mount", help="SRC:DST[:ro] into a container session (--image), as colo submit "
                             "--mount; repeatable")
    detach_opt = typer.Option(False, "--detach", help="start it with no client: its terminal kept by the daemon "
                              "(output in a scrollback) until colo attach JOB")
    sock_opt = typer.Option(None, "--socket", envvar="COLO_SOCKET", help="daemon socket")

    @app.command(context_settings={"allow_interspersed_args": False})
    def shell(command: List[str] = typer.Argument(None, help="what to run instead of your shell, after --"),
              gpu_mem: Optional[str] = gpu_mem_opt, gpus: Optional[int] = gpus_opt, name: Optional[str] = name_opt,
              env: List[str] = env_opt, workdir: Optional[str] = workdir_opt, time_limit: Optional[str] = time_opt,
              cpus: Optional[float] = cpus_opt, mem: Optional[str] = mem_opt, gpu_id: List[str] = gpu_id_opt,
              gpu_type: Optional[str] = gpu_type_opt, priority: int = priority_opt, after: List[str] = after_opt,
              image: Optional[str] = image_opt, mount: List[str] = mount_opt, detach: bool = detach_opt,
              sock: Optional[Path] = sock_opt):
        """Your shell on this node as a colo job: queued and placed like any job (its reason shown while
        it waits), held to its GPU budget, contained and counted; it ends when you leave the shell.

        Example: colo shell --gpu-mem 8GiB   ·   colo shell --gpus 0 -- bash -l   ·   colo shell --image pytorch:24.05 --gpu-mem 8GiB -- bash
        """
        if not sys.stdin.isatty() and not detach:
            _fail("colo shell needs a terminal; for a command without one, colo run -- CMD")
        default = "/bin/sh" if image else _login_shell()  # (the host's login shell may not be in the image)
        raise typer.Exit(_attached(list(command or [default]), sock, gpu_mem, gpus, image, detach, name=name or "shell",
                                   env=env, workdir=workdir, time=time_limit, cpus=cpus, mem=mem, gpu_id=gpu_id,
                                   gpu_type=gpu_type, priority=priority, after=after, mount=mount))

    @app.command("run", context_settings={"allow_interspersed_args": False})
    def run_attached(command: List[str] = typer.Argument(..., help="the command, after --"),
                     gpu_mem: Optional[str] = gpu_mem_opt, gpus: Optional[int] = gpus_opt,
                     name: Optional[str] = name_opt, env: List[str] = env_opt, workdir: Optional[str] = workdir_opt,
                     time_limit: Optional[str] = time_opt, cpus: Optional[float] = cpus_opt,
                     mem: Optional[str] = mem_opt, gpu_id: List[str] = gpu_id_opt,
                     gpu_type: Optional[str] = gpu_type_opt, priority: int = priority_opt,
                     after: List[str] = after_opt, image: Optional[str] = image_opt,
                     mount: List[str] = mount_opt, detach: bool = detach_opt, sock: Optional[Path] = sock_opt):
        """Run a command as a colo job attached to this terminal, as srun --pty does: it waits in the
        queue, then runs on a terminal of its own (Ctrl-C, Ctrl-Z and window size reach it); exits
        with its exit code.

        Example: colo run --gpu-mem 4GiB -- python train.py   ·   colo run -- nvidia-smi
        """
        raise typer.Exit(_attached(list(command), sock, gpu_mem, gpus, image, detach, name=name, env=env, workdir=workdir,
                                   time=time_limit, cpus=cpus, mem=mem, gpu_id=gpu_id, gpu_type=gpu_type,
                                   priority=priority, after=after, mount=mount))

    @app.command("attach")
    def attach_cmd(job: int = typer.Argument(..., help="the detached session's job id"),
                   keys: Optional[str] = typer.Option(None, "--detach-keys", help="the keys that leave it running, "
                                                      "as docker writes them (default ctrl-\\,d, or COLO_DETACH_KEYS)"),
                   sock: Optional[Path] = sock_opt):
        """Take over the terminal of a session started with --detach (yours only), its last output
        shown first; the detach keys (Ctrl-\\ then d) leave it running again. Exits with its code when
        it ends while attached.

        Example: colo shell --detach --gpu-mem 8GiB   ·   colo attach 12
        """
        from . import attach

        try:
            raise typer.Exit(attach.run(Client(sock), job=job, keys=_keys(keys)))
        except ClientError as e:
            _fail(str(e))

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
            _fail(str(e))
        typer.echo(f"installed kernelspec {name} in {where}")
