"""CLI: `colo sim` and `colo profile ls|show|record`. The main app calls register(app)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional

import typer

from ..config import default_state_dir
from ..units import format_duration, format_size

class _Lazy:
    """numpy-heavy modules load when a sim/profile command runs, not on every `colo` start."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        import importlib

        return getattr(importlib.import_module(self._name, __package__), attr)


sim = _Lazy("colo.sched.sim")
truths = _Lazy("colo.sched.truth")
prof = _Lazy("colo.profiles")

TRUTH_TEXT = {"h200": "jobs run off their profiles under a physics fitted to what an H200 measured",
              "noisy": "jobs really run off their profiles and pay a co-run cost colo's model lacks",
              "study": "jobs run off their profiles under an interference fitted to the placement study",
              "smooth": "jobs run off their profiles under a contention with no knee fitted to the published MPS pairs",
              "exact": "jobs do exactly what colo's model predicts (calibration only, not evidence)"}

# The lead wires this to the daemon: a function returning job rows (colo.jobs.Job.to_dict()).
load_history_rows: Callable[[], list[dict]] | None = None


def _fail(msg: str) -> None:
    typer.echo(f"colo: {msg}", err=True)
    raise typer.Exit(1)


def profile_dirs() -> list[Path]:
    """The user's own profiles first (written by record/learn), then the shipped ones."""
    own = Path(os.environ.get("COLO_USER_PROFILES") or Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local/share") / "colo/profiles")
    learned = default_state_dir() / "profiles"  # what the daemon learned from finished jobs
    return [own, learned, prof.shipped_dir()]


def nvml_sampler(index: int | None = None) -> Callable[[], dict]:
    """Whole-GPU readings from NVML (the command runs alone, so they are its own)."""
    import pynvml  # noqa: TID251 - `colo profile record` samples NVML directly by design

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise prof.ProfileError(f"NVML not available ({e}): recording needs an NVIDIA driver") from None
    if index is None:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        h = pynvml.nvmlDeviceGetHandleByUUID(vis) if vis.startswith("GPU-") else pynvml.nvmlDeviceGetHandleByIndex(int(vis or 0))
    else:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)

    def sample() -> dict:
        u = pynvml.nvmlDeviceGetUtilizationRates(h)
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
        try:
            pcie = 1024.0 * (pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
                             + pynvml.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES))
        except pynvml.NVMLError:
            pcie = None
        return {"sm": u.gpu / 100.0, "mem": int(m.used), "membw": u.memory / 100.0, "pcie": pcie}

    name = pynvml.nvmlDeviceGetName(h)
    sample.gpu_name = name.decode() if isinstance(name, bytes) else str(name)  # type: ignore[attr-defined]
    return sample


def learned_lines(lr: dict) -> list[str]:
    """What the daemon learned about a profile from your runs, in words (colo profile show)."""
    out = []
    if lr.get("max_mem"):
        out.append(f"learned: the most memory a run used {format_size(lr['max_mem'])}, suggested budget "
                   f"{format_size(lr['suggested_budget'])}")
    if lr.get("alone"):
        a = lr["alone"]
        out.append(f"learned: alone it ran {a['ratio']:.2f}x its stored run time ({a['runs']} run(s))")
    for c in lr.get("corun") or []:
        out.append(f"learned: beside {c['with']} ({c['mode']}) it ran {c['factor']:.2f}x what the model "
                   f"predicted ({c['runs']} run(s))")
    if "margin" in lr:
        out.append(f"learned: admission margin {lr['margin'] * 100:.0f} % (from {lr['errors']} prediction error(s))"
                   + (f", {lr['seen_margin'] * 100:.0f} % beside pairings runs have shown (from {lr['seen_errors']})"
                      if lr.get("seen_errors") else ""))
    return out


def register(app: typer.Typer) -> None:
    @app.command("sim")
    def sim_cmd(
        workload: Optional[str] = typer.Argument(None, help="workload file, or a shipped mix: heavy, light, memory-heavy, memory-light, random"),
        policy: List[str] = typer.Option([], "--policy", "-p", help="policy to run (repeat); default: all baselines and colo; references (not baselines): mps-all, oracle-bound (reads the truth)"),
        gpus: int = typer.Option(1, "--gpus", min=1, help="GPUs in the simulated node"),
        as_json: bool = typer.Option(False, "--json", help="results as JSON"),
        plot: bool = typer.Option(False, "--plot", help="text plot of GPU occupancy per policy"),
        from_history: bool = typer.Option(False, "--from-history", help="replay the jobs the daemon ran"),
        truth: str = typer.Option("h200", "--truth", help="what jobs really do: h200 (the default: drawn around their profiles, moved by a physics fitted to an H200's measurements), and stress worlds: noisy (drawn around their profiles, with a co-run cost colo's model lacks), study (fitted to the placement study), smooth (contention with no knee, fitted to the published MPS pairs), exact (colo's own model: calibration only, not evidence)"),
        seeds: int = typer.Option(1, "--seeds", min=1, max=1000, help="runs with truth seeds SEED .. SEED+N-1"),
        seed: int = typer.Option(0, "--seed", min=0, help="first truth seed"),
        grow: bool = typer.Option(True, "--grow/--no-grow", help="colo's jobs as `colo submit --grow` runs them (the default here): one refused by its budget is requeued once with a larger one; --no-grow: budgets exactly as asked, so a budget a little short of what a job really uses fails it, as under the daemon"),
    ):
        """Replay a workload through colo's policy and the baselines; compare.

        Example: colo sim heavy --gpus 2 --plot
        """
        store = prof.ProfileStore(profile_dirs())
        if truth not in truths.TRUTHS:
            _fail(f"unknown truth {truth!r}: one of {', '.join(truths.TRUTHS)}")
        if truth == "exact" and seeds > 1:
            _fail("--truth exact has no randomness: --seeds needs another truth")
        try:
            if from_history:
                if load_history_rows is None:
                    _fail("--from-history is not wired to the daemon in this build")
                jobs, gpu_mem, name = sim.jobs_from_history(load_history_rows(), store), sim.DEFAULT_GPU_MEM, "history"
            elif workload is None:
                _fail("give a workload file or a shipped mix (" + ", ".join(sim.MIXES) + ")")
            else:
                w = sim.load_workload(workload, store)
                jobs, gpu_mem, name = w.jobs, w.gpu_mem, w.name
            if not jobs:
                _fail(f"workload {name} has no jobs")
            per_seed = [sim.compare(jobs, policy or sim.DEFAULT_POLICIES, gpus, gpu_mem,
                                    truth=truths.Truth(truth, s), grow=grow) for s in range(seed, seed + seeds)]
        except (sim.SimError, prof.ProfileError) as e:
            _fail(str(e))
        if as_json:
            typer.echo(json.dumps({"workload": name, "gpus": gpus, "gpu_mem": gpu_mem, "jobs": len(jobs),
                                   "truth": truth, "grow": grow,
                                   "results": [r.summary() for rs in per_seed for r in rs]}, indent=2))
            return
        typer.echo(f"workload {name}: {len(jobs)} jobs on {gpus} GPU(s) of {format_size(gpu_mem)}; "
                   f"truth {truth}: {TRUTH_TEXT[truth]}")
        for s, results in zip(range(seed, seed + seeds), per_seed):
            if seeds > 1:
                typer.echo(f"\nseed {s}")
            typer.echo(sim.table(results))
            if plot:
                for r in results:
                    typer.echo("")
                    typer.echo(sim.plot(r, gpus))
        if seeds > 1:
            typer.echo(f"\nover {seeds} seeds")
            typer.echo(sim.seeds_table(per_seed))

    profile_app = typer.Typer(help="Profiles: what workloads do to a GPU over time", no_args_is_help=True)

    LOCAL_NOTE = "no colo daemon answers: these are the profiles on this machine's disk, not what a daemon uses"

    def _daemon_call(fn_name: str, *a, local_ok: bool = False, **kw):
        """The daemon's answer; None when no daemon runs and a look at the local files will do."""
        from ..client import Client, ClientError, DaemonUnavailable

        try:
            return getattr(Client(os.environ.get("COLO_SOCKET") or None), fn_name)(*a, **kw)
        except DaemonUnavailable as e:
            if local_ok and e.code == "unavailable":
                return None
            _fail(str(e))
        except ClientError as e:
            from ..textsafe import safe

            _fail(safe(str(e)))

    UserOpt = typer.Option(None, "--user", help="another user's view (root and the admin group only)")

    @profile_app.command("ls")
    def ls_cmd(user: Optional[str] = UserOpt, as_json: bool = typer.Option(False, "--json", help="print JSON")):
        """List the profiles the daemon places your jobs with, and where each comes from.

        SOURCE is own (learned from your runs), shared (an admin's choice), configured or shipped.
        Example: colo profile ls
        """
        items = _daemon_call("profiles", user, local_ok=user is None)
        if items is None:
            typer.echo(f"colo: {LOCAL_NOTE}", err=True)
            items = [{**p.summary(), "source": "local"} for p in prof.ProfileStore(profile_dirs()).ls()]
        if as_json:
            typer.echo(json.dumps(items, indent=2))
            return
        typer.echo(f"{'NAME':28s} {'SOURCE':10s} {'RUNS':>4s} {'RUNTIME':>8s} {'MEAN SM':>7s} {'PEAK SM':>7s} "
                   f"{'PEAK MEM':>8s} {'CACHE':>5s}  GPU")
        for p in items:
            typer.echo(f"{p['name']:28s} {p['source']:10s} {p['runs']:4d} {format_duration(p['runtime']):>8s} "
                       f"{p['mean_sm'] * 100:6.0f}% {p['peak_sm'] * 100:6.0f}% {format_size(p['peak_mem']):>8s} "
                       f"{'yes' if p['cache_bound'] else 'no':>5s}  {p['gpu']}")

    @profile_app.command("show")
    def show_cmd(name: str, user: Optional[str] = UserOpt,
                 as_json: bool = typer.Option(False, "--json", help="print JSON")):
        """Show one profile as the daemon uses it for your jobs: summary and its series.

        Example: colo profile show resnet50
        """
        p = _daemon_call("profile", name, user, local_ok=user is None)
        if p is None:
            local = prof.ProfileStore(profile_dirs()).get(name)
            if local is None:
                _fail(f"no profile named {name!r} ({LOCAL_NOTE})")
            p = {**local.summary(), "source": "local", "note": local.note, "text": prof.dumps(local),
                 "sm": local.sm.tolist(), "mem": local.mem.tolist(), "membw": local.membw.tolist(),
                 "pcie": None if local.pcie is None else local.pcie.tolist()}
        if as_json:
            p.pop("text", None)
            typer.echo(json.dumps(p))
            return
        typer.echo(p["text"], nl=False)
        typer.echo(f"# source: {p['source']} (own: learned from your runs; shared, configured, shipped: the admin's)")
        for line in learned_lines(p.get("learned") or {}):
            typer.echo(f"# {line}")

    @profile_app.command("share")
    def share_cmd(name: str, user: str = typer.Option(..., "--user", help="whose own copy to share")):
        """Make one user's learned profile the one every user's jobs use (root and admins only).

        Example: sudo colo profile share resnet50 --user alice
        """
        r = _daemon_call("profile_share", name, user)
        typer.echo(f"profile {r['name']} of uid {r['from_uid']} is now shared")

    @profile_app.command("record", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def record_cmd(ctx: typer.Context, name: Optional[str] = typer.Option(None, "--name", help="profile name"),
                   hz: float = typer.Option(10.0, "--hz", min=0.1, max=100.0, help="samples a second")):
        """Run a command alone and record its profile: colo profile record [--name N] -- CMD ...

        The profile becomes your own copy in the daemon (your jobs with --profile NAME are placed
        with it; it replaces an own copy of that name) and is saved on this machine for colo sim.
        Example: colo profile record --name train -- python train.py
        """
        argv = list(ctx.args)
        if not argv:
            _fail("give the command after --, e.g. colo profile record --name train -- python train.py")
        if name is not None and not prof.valid_name(name):
            _fail(f"bad profile name {name!r}: use letters, digits, '.', '_', '-', '+'")
        try:
            sampler = nvml_sampler()
            p = prof.record(argv, sampler, hz=hz, name=name or prof.key_for(None, argv),
                            gpu=getattr(sampler, "gpu_name", ""))
            path = prof.ProfileStore(profile_dirs()).save(p)
        except prof.ProfileError as e:
            _fail(str(e))
        typer.echo(f"recorded {p.name}: {format_duration(p.runtime)}, peak SM {p.peak_sm * 100:.0f} %, "
                   f"peak memory {format_size(p.peak_mem)} -> {path}")
        r = _daemon_call("profile_put", prof.dumps(p), local_ok=True)
        if r is None:
            typer.echo("colo: no colo daemon answers: the profile is only on this machine's disk; run "
                       "`colo profile record` again while the daemon runs for your jobs to be placed with it", err=True)
        else:
            typer.echo(f"the daemon places your jobs with --profile {p.name} by it now (your own copy"
                       f"{', replacing the one before' if r['replaced'] else ''})")

    app.add_typer(profile_app, name="profile")


def main() -> None:  # for trying it without the main CLI: python -m colo.cli.sim
    app = typer.Typer(no_args_is_help=True)
    register(app)
    app(prog_name="colo")


if __name__ == "__main__":
    main()
    sys.exit(0)
