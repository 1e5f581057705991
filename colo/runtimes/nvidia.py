"""How GPUs reach a container on this engine: CDI devices, or NVIDIA's runtime.

The NVIDIA Container Toolkit offers two ways, and colo uses the one the engine has:
- CDI (the toolkit's default now): `nvidia-ctk cdi generate` (or its nvidia-cdi-refresh service, 1.18+)
  writes a spec under /etc/cdi or /var/run/cdi naming devices `nvidia.com/gpu=0`,
  `nvidia.com/gpu=GPU-<uuid>`, `nvidia.com/gpu=all`. Docker 25+ with CDI on (`"features": {"cdi":
  true}` before 28, on by default since) lists its spec folders in its info (`CDISpecDirs`, Engine
  API 1.44; empty: CDI off) and, from API 1.50, the devices it found (`DiscoveredDevices`). A
  container gets one by a device request with driver "cdi" (what `docker run --device
  nvidia.com/gpu=...` sends).
- the `nvidia` runtime (`nvidia-ctk runtime configure --runtime=docker`): a device request with the
  capability "gpu" (what `docker run --gpus` sends) goes through the toolkit's hook.
colo names each GPU by UUID either way, so a job gets exactly the GPUs its budget was placed on.
The engine is asked at each GPU container's start (about 15 ms beside a start's second), so a
toolkit set up while colo runs is used without restarting colo.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import docker.errors
import docker.types

from .base import StartError

CDI_KIND = "nvidia.com/gpu"
GENERATE = "`sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`"
CDI_FIX = f"{GENERATE} (NVIDIA Container Toolkit)"
NOTHING_FIX = (f"install the NVIDIA Container Toolkit and either make CDI specs ({GENERATE}; Docker 25+, with "
               "`\"features\": {\"cdi\": true}` in /etc/docker/daemon.json before Docker 28) or configure its "
               "runtime (`sudo nvidia-ctk runtime configure --runtime=docker`), and restart Docker")


@dataclass(frozen=True)
class GpuAccess:
    """What the engine offers GPU containers. `via`: "cdi", "nvidia" (the runtime) or None (nothing:
    a container would get no GPU); `detail`: one line saying what is used, or what is missing and
    the command that adds it; `cdi_names`: the CDI devices the engine found (None: it does not say)."""

    via: str | None
    detail: str
    cdi_names: frozenset[str] | None = None

    def device_requests(self, uuids: list[str]) -> list[docker.types.DeviceRequest]:
        """The device requests that hand a container exactly these GPUs; StartError when it cannot."""
        if self.via == "nvidia":
            return [docker.types.DeviceRequest(device_ids=list(uuids), capabilities=[["gpu"]])]
        if self.via != "cdi":
            raise StartError(f"the Docker engine cannot give a container a GPU: {self.detail}")
        names = [f"{CDI_KIND}={u}" for u in uuids]
        missing = [n for n in names if self.cdi_names is not None and n not in self.cdi_names]
        if missing:
            raise StartError(f"the engine's CDI devices do not include {', '.join(missing)} (it lists "
                             f"{_few(self.cdi_names)}): regenerate the spec with {CDI_FIX}")
        return [docker.types.DeviceRequest(driver="cdi", device_ids=names)]


def from_info(info: dict) -> GpuAccess:
    """Choose from the engine's `GET /info`: CDI when it offers NVIDIA devices, else the runtime."""
    cdi_dirs = [d for d in info.get("CDISpecDirs") or [] if d]
    runtime = "nvidia" in (info.get("Runtimes") or {})
    names: frozenset[str] | None = None
    if "DiscoveredDevices" in info:  # API 1.50+: what the engine itself resolved
        names = frozenset(d.get("ID", "") for d in info.get("DiscoveredDevices") or []
                          if d.get("Source") == "cdi" and d.get("ID", "").startswith(CDI_KIND + "="))
    elif cdi_dirs:
        names = _spec_names(cdi_dirs)
    if cdi_dirs and (names is None or names):
        seen = f"{len(names)} {CDI_KIND} devices" if names is not None else "devices not listed by this engine"
        return GpuAccess("cdi", f"CDI ({seen}; specs in {', '.join(cdi_dirs)})", names)
    if runtime:
        why = (f" (CDI is on, but {', '.join(cdi_dirs)} hold no {CDI_KIND} device)" if cdi_dirs else "")
        return GpuAccess("nvidia", f"the nvidia runtime{why}")
    if cdi_dirs:
        return GpuAccess(None, f"CDI is on, but {', '.join(cdi_dirs)} hold no {CDI_KIND} device and no "
                               f"`nvidia` runtime is configured: run {CDI_FIX}")
    return GpuAccess(None, "neither CDI devices nor the `nvidia` runtime are offered by the Docker engine: "
                           + NOTHING_FIX)


def detect(client) -> GpuAccess:
    """What the engine behind `client` offers GPU containers now (the doctor's line, too)."""
    try:
        return from_info(client.info())
    except docker.errors.DockerException as e:
        return GpuAccess(None, f"the Docker engine does not answer ({e.__class__.__name__})")


def _spec_names(dirs: list[str]) -> frozenset[str] | None:
    """`nvidia.com/gpu=NAME` devices in the CDI specs of these folders, for engines older than API
    1.50 (colo runs beside the engine, as root: it can read them). None: not readable here."""
    names: set[str] = set()
    read_any = False
    for d in dirs:
        try:
            files = sorted(p for p in Path(d).iterdir() if p.suffix in (".json", ".yaml", ".yml"))
        except OSError:
            continue
        read_any = True
        for p in files:
            try:
                names |= _names_in(p.read_text(errors="replace"), p.suffix == ".json")
            except OSError:
                continue
    return frozenset(names) if read_any else None


def _names_in(text: str, is_json: bool) -> set[str]:
    """Device names of a spec of kind nvidia.com/gpu. JSON is parsed; YAML (no YAML parser among
    colo's dependencies) is read for its top-level kind and each device's `- name:` line (the
    devices list sits at the top level: nested lists are indented deeper)."""
    if is_json:
        try:
            spec = json.loads(text)
        except ValueError:
            return set()
        if spec.get("kind") != CDI_KIND:
            return set()
        return {f"{CDI_KIND}={d['name']}" for d in spec.get("devices") or [] if isinstance(d, dict) and d.get("name")}
    if not re.search(rf"^kind:\s*['\"]?{re.escape(CDI_KIND)}['\"]?\s*$", text, re.M):
        return set()
    return {f"{CDI_KIND}={m}" for m in re.findall(r"^ {0,2}-\s*name:\s*['\"]?([^'\"\s]+)['\"]?\s*$", text, re.M)}


def _few(names: frozenset[str] | None) -> str:
    items = sorted(names or ())
    return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "") if items else "none"
