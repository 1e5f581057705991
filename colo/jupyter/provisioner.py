"""jupyter_client's kernel provisioner `colo`: each kernel a colo job with its GPU budget.

A kernelspec names it (`metadata.kernel_provisioner.provisioner_name: colo`, config `gpu_mem`,
`gpus`, `socket`; `colo kernelspec install` writes one). Jupyter writes the connection file and
picks the ports as for a local kernel (LocalProvisioner.pre_launch, inherited); launch_kernel then
submits the kernel's command as a process job of the notebook's user (interactive: a person's
session), waits until the daemon starts it (placed by the same policy as any job, the reason it
waits logged), and the kernel, a process on this node like any local kernel, binds the ports of
the connection file. The interposer holds it to its budget, its cgroup contains it, `colo ls`,
`history` and `report` count it. Interrupts are SIGINT through the daemon (op `signal`, passed on
by the job's shim); kill is a cancel; the kernel's end is the job's end.

What the kernel's environment gets: the kernelspec's `env`, Jupyter's JPY_* variables and the names
in `env_keep` (PATH, PYTHONPATH, ...), not the whole environment of the Jupyter server (as for any
colo job: colo sets the GPU, budget and driver variables itself and refuses them from a job).
"""
from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning import LocalProvisioner
from traitlets import Integer, List, Unicode

from ..client import Client, ClientError

OPEN = ("queued", "starting", "running")
ENV_KEEP = ["PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "CONDA_DEFAULT_ENV", "LANG", "LC_ALL",
            "LC_CTYPE", "TZ", "IPYTHONDIR", "MPLCONFIGDIR"]


class ColoProvisioner(LocalProvisioner):
    """Starts and follows a kernel as a colo job. Ports and the connection file are Jupyter's own
    (LocalProvisioner's pre_launch and cleanup); the process is the daemon's."""

    gpu_mem = Unicode("", config=True, help="each kernel's GPU budget per GPU, e.g. 4GiB")
    gpus = Integer(1, config=True, help="GPUs per kernel (0: none)")
    socket = Unicode("", config=True, help="the colo daemon's socket (default: COLO_SOCKET, or colo's own)")
    name = Unicode("kernel", config=True, help="the jobs' name in colo ls")
    env_keep = List(Unicode(), default_value=ENV_KEEP, config=True,
                    help="variables of Jupyter's environment the kernel gets (besides the kernelspec's env and JPY_*)")

    job_id: int | None = None  # the running kernel's job
    _ended: int | None = None  # the exit code of the last one, once waited for

    @property
    def has_process(self) -> bool:
        return self.job_id is not None

    async def _ask(self, method: str, *args: Any, **kw: Any) -> Any:
        """A call to the daemon, off Jupyter's event loop."""
        return await asyncio.to_thread(getattr(Client(self.socket or None), method), *args, **kw)

    async def _job(self) -> dict:
        """The kernel's job: state, exit_code, reason."""
        got = await self._ask("ls_fields", ["state", "exit_code", "reason"], refs=[str(self.job_id)])
        if not got["rows"]:
            return {"state": "lost", "exit_code": None, "reason": "removed from colo"}
        return dict(zip(got["fields"], got["rows"][0]))

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        env = kwargs.get("env") or {}
        keep = set(self.env_keep) | set(self.kernel_spec.env if self.kernel_spec else ())
        cwd = os.path.abspath(kwargs.get("cwd") or os.getcwd())
        spec = {"argv": list(cmd), "gpus": self.gpus, "gpu_mem": self.gpu_mem or None, "workdir": cwd,
                "env": {k: v for k, v in env.items() if k in keep or k.startswith("JPY_")},
                "name": self.name, "interactive": True}
        try:
            job = await self._ask("submit", spec)
        except ClientError as e:
            raise RuntimeError(f"colo refused the kernel: {e}") from None
        self.job_id, self._ended, self.cwd = job["id"], None, cwd
        self.log.info("kernel %s is colo job %d", self.kernel_id, self.job_id)
        said = job["reason"]  # ("submitted by"): the scheduler's words are what is worth a line
        while (j := await self._job())["state"] != "running":  # a kernel that waits is said to wait
            if j["state"] not in OPEN:
                job_id, self.job_id = self.job_id, None
                raise RuntimeError(f"colo job {job_id} {j['state']} before the kernel started: {j['reason']}")
            if j["state"] == "queued" and j["reason"] != said:
                said = j["reason"]
                self.log.warning("kernel %s (colo job %d) waits: %s", self.kernel_id, self.job_id, said)
            await asyncio.sleep(0.2)
        return self.connection_info

    async def poll(self) -> int | None:
        if self.job_id is None:
            return self._ended if self._ended is not None else 0
        j = await self._job()
        if j["state"] in OPEN:
            return None
        return j["exit_code"] if j["exit_code"] is not None else 1  # (cancelled before it had one)

    async def wait(self) -> int | None:
        while (code := await self.poll()) is None:
            await asyncio.sleep(0.1)
        self.job_id, self._ended = None, code  # waited for: no kernel any more (has_process)
        return code

    async def send_signal(self, signum: int) -> None:
        """SIGINT (an interrupt), SIGTERM...: to the kernel's process, through the daemon; SIGKILL
        is a cancel (the daemon stops the whole job)."""
        if self.job_id is None or signum == 0:
            return
        if signum == signal.SIGKILL:
            await self._cancel()
            return
        try:
            await self._ask("signal", self.job_id, signum)
        except ClientError as e:  # it has ended meanwhile, or not started: nothing to signal
            self.log.warning("kernel %s (colo job %d): %s", self.kernel_id, self.job_id, e)

    async def kill(self, restart: bool = False) -> None:
        await self._cancel()

    async def terminate(self, restart: bool = False) -> None:
        await self.send_signal(signal.SIGTERM)

    async def _cancel(self) -> None:
        if self.job_id is None:
            return
        try:
            await self._ask("cancel", self.job_id)
        except ClientError as e:  # already ended
            self.log.debug("kernel %s (colo job %d): %s", self.kernel_id, self.job_id, e)

    async def cleanup(self, restart: bool = False) -> None:
        if not restart and self.job_id is not None and await self.poll() is None:
            await self._cancel()  # the kernel is given up on: so is its job
        await super().cleanup(restart=restart)

    async def get_provisioner_info(self) -> dict:
        info = await super().get_provisioner_info()
        info["colo_job"] = self.job_id
        return info

    async def load_provisioner_info(self, provisioner_info: dict) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.job_id = provisioner_info.get("colo_job")
