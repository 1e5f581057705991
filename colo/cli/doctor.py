"""`colo doctor`: is each piece colo needs present and working? One line each, in two parts:
the daemon this command reaches (what jobs get: its GPUs, simulated or real, MPS, how container
jobs get GPUs, the limits), then this machine as this user sees it (the interposer, the driver,
the MPS tools), which is what matters for `colo run-budgeted` and for a daemon started here."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from ..config import Config, ConfigError
from ..client import Client, ClientError
from ..node import cgroup, devices, gate, interposer, native
from ..node.gpu import NoDriver, Nvml
from ..textsafe import safe
from ..units import format_size


ETC_CONFIG = Path("/etc/colo/colo.toml")

CLIENTS = ("max_connections_per_user", "max_streams_per_user")  # said with the descriptors, not the jobs' limits

def _gating(line: Callable[[bool | None, str, str], None]) -> None:
    """Is the node gated (docs/gating.md), read from the GPUs' device files here, against the group
    colo's config grants its jobs; and can jobs be held to their own GPUs."""
    try:
        cfg = Config.load(None if os.environ.get("COLO_CONFIG") or not ETC_CONFIG.is_file() else ETC_CONFIG)
    except (ConfigError, OSError):
        cfg = Config()
    st = devices.gate_status(devices.GpuNodes.of(cfg.fakegpu_state), cfg.gpu_group)
    line(None if st.ok and not st.gated else st.ok, "gating", st.detail)  # not gated, nor meant to be: a note
    if st.driver:
        line(None, "gating", st.driver)
    ok, how = cgroup.device_rules_here()
    line(True if ok else False if cfg.gpu_group is not None else None, "devices", how)
    if cfg.gpu_group is not None:
        _gate(cfg, line)


def _gate(cfg: Config, line: Callable[[bool | None, str, str], None]) -> None:
    """On a gated node: the gate against a job's own user (docs/gating.md "The gate") and the
    patrol's answer to a descriptor handed out of a job."""
    nodes = devices.GpuNodes.of(cfg.fakegpu_state)
    mount = cgroup.v2_mount()
    if not gate.rules(nodes):
        line(None, "gate", f"the GPUs' files in {nodes.folder} are not character devices: no device program applies")
    elif cfg.gpu_gate_at == []:
        line(False, "gate", "gpu_gate_at = []: the group alone gates, and a job's user can carry it away "
                            "(a setgid copy made in a job)")
    elif mount is None:
        line(False, "gate", "no cgroup2 here: the group alone gates, and a job's user can carry it away")
    elif os.geteuid() != 0:
        line(None, "gate", "whether colo's device program is attached is seen as root (colo doctor as root)")
    else:
        for at in cfg.gpu_gate_at or ["/"]:
            d = mount / at.strip("/")
            names = gate.attached(d)
            mine = [n for n in names or [] if n.startswith("colo_")]
            line(bool(mine), "gate", f"the GPUs' devices are refused beneath {d} but to colo's jobs and root "
                 f"({', '.join(mine)})" if mine else f"no device program of colo's on {d} (is the daemon "
                 "running?): a job's user can carry the GPU group out of colo (a setgid copy)")
    if cfg.kill_foreign:
        line(True, "patrol", "a process of no job holding GPU memory is killed, its uid logged "
                             "(patrol_kill_foreign, on by default on a gated node)")
    else:
        line(False, "patrol", "patrol_kill_foreign = false on a gated node: a device descriptor a job hands "
                              "out keeps a GPU outside colo")


def _who(uid: int) -> str:
    import pwd

    try:
        return "root" if uid == 0 else "you" if uid == os.geteuid() else pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _why_trusted(client: Client) -> str:
    """What the client proved before it sent anything (colo/client.py)."""
    t = client.trusted or {}
    kind = "the system daemon" if t.get("uid") == 0 else "a private daemon of yours"
    return (f"{kind}: pid {t.get('pid')} runs as {_who(t.get('uid', -1))} (the kernel's peer credentials), "
            f"its folder {t.get('folder')} belongs to {_who(t.get('folder_uid', -1))} and no other user may write it")


def _metrics(line: Callable[[bool | None, str, str], None], listen: str) -> None:
    """Does the endpoint answer (a taken port costs the metrics only: the daemon logs it and retries)."""
    import urllib.request

    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    everywhere = host in ("", "0.0.0.0", "::")
    url = f"http://{'127.0.0.1' if everywhere else host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            answers = r.status == 200
    except OSError:
        answers = False
    if not answers:
        line(False, "metrics", f"nothing answers on {safe(url)} (metrics_listen = {safe(listen)}): "
             "is the port taken? the daemon's log says")
    elif everywhere:
        line(None, "metrics", f"Prometheus metrics on EVERY address, port {safe(port)}, without authentication "
             "(metrics_listen): whoever reaches this node reads users' names and jobs")
    else:
        line(True, "metrics", f"Prometheus metrics on {safe(url)}")


def run_checks(sock: Path | None) -> bool:
    ok = True

    def line(good: bool | None, what: str, detail: str) -> None:
        """good: True ok, False FAIL (the exit code says so), None a note (--)."""
        nonlocal ok
        ok &= good is not False
        print(f"{'ok  ' if good else '--  ' if good is None else 'FAIL'}  {what:<12} {detail}")

    client = Client(sock, timeout=5)
    try:
        h = client.hello(detail=True)
    except ClientError as e:
        h = None
        line(False, "daemon", safe(str(e)))
    if h is not None:
        print("the daemon:")
        line(True, "daemon", f"colo {h['version']} answers on {client.path} (you are {safe(h['user'])})")
        line(True, "trust", _why_trusted(client))
        node = h.get("node") or {}
        kind = "simulated GPUs (colo's fake driver)" if node.get("simulated") else "NVIDIA GPUs"
        if h.get("gpu_error"):
            line(False, "gpus", safe(h["gpu_error"]))
        else:
            gpus = ", ".join(f"GPU{g['index']} {safe(g['name'])} {format_size(g['total'])} ({g['compute_mode']})"
                             + (f" NOT ANSWERING: {safe(g['error'])}" if g.get("error") else "")
                             + (f" {safe(g['drained'])}, colo undrain {g['index']}" if g.get("drained") else "")
                             for g in node.get("gpus", []))
            line(bool(node.get("gpus")) or None, "gpus", f"{kind}: {gpus or 'none'}")
        mps = node.get("mps") or {}
        if mps.get("available") and mps.get("used"):
            line(True, "mps", "jobs may share a GPU as MPS clients" + (
                "; jobs of different users share one server (multi_user_mps)" if mps.get("multi_user") else
                "; each user's jobs get a server of their own"))
        else:
            line(None, "mps", safe(mps.get("why_not") or "turned off (use_mps = false)") + ": jobs run time-sliced")
        if h.get("docker_error"):
            line(None, "docker", f"the daemon has no Docker engine ({safe(h['docker_error'])}): only --process jobs")
        else:
            c = node.get("containers") or {}
            via = {"cdi": "and get GPUs as CDI devices (nvidia.com/gpu)", "runtime": "and get GPUs through the "
                   "nvidia runtime", "simulated": "(on simulated GPUs: nothing needed of the engine)"}.get(c.get("via"))
            line(True if c.get("via") else None, "docker",
                 f"container jobs can run {via}" if via
                 else f"container jobs can run but get no GPU: {safe(c.get('detail') or '')}")
        lim = node.get("limits") or {}
        if lim:
            per_user = ", ".join(f"{k.removeprefix('max_').removesuffix('_per_user')} {v}"
                                 for k, v in lim.items() if k.endswith("_per_user") and v and k not in CLIENTS) or "none"
            line(True, "limits", f"per user: {per_user}; reserve {format_size(lim['reserve'])} a GPU; "
                 f"slowdown bound {lim['slowdown_bound']}x; patrol kills "
                 + (f"after {lim['patrol_grace']:g} s over budget" if lim["patrol_kill"] else "off"))
            if "open_files" in lim:  # (what one user can hold of them: max_connections_per_user)
                n = lim["open_files"]
                each = ", ".join(f"{lim[k] or 'any number of'} {k.split('_')[1]}" for k in CLIENTS if k in lim)
                line(n < 0 or n >= 4096 or None, "descriptors",
                     f"the daemon may open {'any number of' if n < 0 else n} files (RLIMIT_NOFILE); a user's "
                     f"clients may hold {each}"
                     + ("" if n < 0 or n >= 4096 else "; raise LimitNOFILE in its unit: each client holds one"))
            if "tasks_bounded" in lim:
                n, most = lim.get("job_tasks"), lim.get("max_job_tasks")
                line(True if lim["tasks_bounded"] else None, "tasks",
                     (f"each job at most {n or 'any number of'} processes and threads unless --tasks (up to "
                      f"{most or 'any number'}; pids.max)") if lim["tasks_bounded"]
                     else "jobs' tasks are not bounded here: no pids cgroup controller for colo")
        if node.get("metrics"):
            _metrics(line, str(node["metrics"]))
    print("this machine:")
    try:
        lib = interposer.library_path()
        problem = interposer.library_problem()
        line(problem is None, "interposer", f"{lib} preloads cleanly" if problem is None else problem)
    except native.NativeMissing as e:
        line(False, "interposer", str(e))
    try:
        nv = Nvml()
        devs = nv.devices()
        cuda = nv.cuda_version()
        line(True, "driver", f"NVIDIA driver {nv.driver_version()}, CUDA {cuda // 1000}.{cuda % 1000 // 10}"
             if cuda else f"NVIDIA driver {nv.driver_version()}")
        line(True, "gpus", ", ".join(f"GPU{d.index} {d.name} ({d.compute_mode})" for d in devs) or "none")
    except NoDriver as e:
        line(None, "driver", str(e))
    _gating(line)
    mps = shutil.which("nvidia-cuda-mps-control")
    line(True if mps else None, "mps", mps or "nvidia-cuda-mps-control not found: a daemon here runs jobs time-sliced")
    if h is None:
        try:
            import docker

            docker.from_env(timeout=5).ping()
            line(True, "docker", "engine reachable from here (no daemon to ask)")
        except Exception as e:  # noqa: BLE001
            line(None, "docker", f"not reachable from here ({e.__class__.__name__}) and no daemon to ask")
    return ok
