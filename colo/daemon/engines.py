"""The runtimes jobs run in, and whether the Docker engine is there.

Owns: `runtimes` (name -> runtime: "process" always, "docker" while the engine answered once,
"slurm" for jobs Slurm started here, colo/daemon/external.py) and what was last said of a
missing engine. Only the launcher and recovery act through a runtime; others ask `away()`.
"""
from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

from ..config import Config, ConfigError
from ..jobs import Job
from ..node import devices
from ..node.cgroup import Cgroups
from ..runtimes.base import StartError
from ..runtimes.process import ProcessRuntime

log = logging.getLogger("colo")
DOCKER_RETRY = 5.0  # seconds between looks for an engine that was not there at start-up


def instance_id(state_dir: Path) -> str:
    """This daemon's name on shared engines (Docker labels, cgroup folders), kept in its state dir."""
    path = state_dir / "instance"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        ident = uuid.uuid4().hex[:16]
        path.write_text(ident + "\n")
        return ident


class Engines:
    def __init__(self, config: Config, instance: str, native_dir: Path, cgroups: Cgroups):
        self.config = config
        self.instance = instance
        try:  # a gated node (docs/gating.md): the group GPU jobs get, and the device files they may open
            self.gpu_gid = devices.group_id(config.gpu_group)
        except LookupError as e:
            raise ConfigError(str(e)) from None
        self.gpu_nodes = devices.GpuNodes.of(config.fakegpu_state)
        self.runtimes: dict = {"process": ProcessRuntime(shim=native_dir / "colo-shim", cgroups=cgroups,
                                                         log_cap=config.log_cap, reserve=config.log_reserve,
                                                         gpu_gid=self.gpu_gid, gpu_nodes=self.gpu_nodes)}
        self.docker_error: str | None = None
        self._docker_retry_at = 0.0
        self.init_docker()

    def add(self, name: str, runtime) -> None:
        self.runtimes[name] = runtime

    def get(self, name: str):
        return self.runtimes.get(name)

    def init_docker(self) -> None:
        try:
            from ..runtimes.docker import DockerRuntime

            rt = DockerRuntime.from_env(instance=self.instance)
            rt.client.ping()
            rt.log_cap, rt.log_reserve = self.config.log_cap, self.config.log_reserve
            rt.tty_rate = self.config.detach_read_rate  # container sessions' relays (ttyrelay.py)
            rt.gpu_gid, rt.gpu_nodes = self.gpu_gid, self.gpu_nodes
            self.runtimes["docker"] = rt
        except Exception as e:  # noqa: BLE001 - any failure: container jobs are refused with this reason
            first = self.docker_error is None
            self.docker_error = f"Docker engine not reachable ({e.__class__.__name__}: {str(e)[:120]})"
            if first:
                log.warning("%s; container jobs are refused until it answers", self.docker_error)

    def set_tty_rate(self, rate: int) -> None:
        """detach_read_rate changed (a reload): container sessions' relays, running ones too."""
        rt = self.runtimes.get("docker")
        if rt is not None:
            rt.set_tty_rate(rate)

    def docker_due(self) -> bool:
        """No engine, and time to look for one again (every DOCKER_RETRY seconds)."""
        return "docker" not in self.runtimes and time.monotonic() >= self._docker_retry_at

    def look_for_docker(self) -> bool:
        """An engine that was not there: looked for again (blocking, run in a thread). True when
        it was found just now."""
        self._docker_retry_at = time.monotonic() + DOCKER_RETRY
        self.init_docker()
        if "docker" not in self.runtimes:
            return False
        log.warning("Docker engine found: container jobs can run")
        self.docker_error = None
        return True

    def runtime_for(self, job: Job):
        rt = self.runtimes.get(job.spec.runtime)
        if rt is None:
            raise StartError(self.docker_error or f"no {job.spec.runtime} runtime")
        return rt

    def docker_away(self) -> str | None:
        """Why container jobs cannot start now (no engine at start-up, or it went away), or None."""
        rt = self.runtimes.get("docker")
        return self.docker_error if rt is None else rt.down

    def close(self) -> None:
        if "docker" in self.runtimes:
            self.runtimes["docker"].close()
