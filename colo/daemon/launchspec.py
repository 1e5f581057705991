"""What a job is started with: its GPU pinned by UUID, the interposer and ledger, the MPS pipe
(or one that leads nowhere), the simulated driver when in use, and the submitter's own mounts."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from ..config import Config
from ..jobs import Job, Mount
from ..node import interposer, mps, native
from ..runtimes.base import Launch, StartError
from ..sched import policy
from . import pin
from .gpus import Gpus
from .validate import Caller, Forbidden, Invalid

IN_JOB = "/opt/colo"  # where colo's own files appear inside a container


def build_launch(config: Config, gpus: Gpus, native_dir: Path, mps_users: Callable[[], dict[str, set[int]]],
                 job: Job, dec: policy.Decision) -> Launch:
    """mps_users: GPU uuid -> uids of its MPS jobs, asked when an MPS job's start opens the
    GPU's control daemon to its user (JobTable.mps_users)."""
    # Root's, 0711: the job reaches its ledger by name but can neither list, replace nor add
    # anything here, so what the daemon reads back (exit code, ledger) is what colo put there.
    # Made afresh: an earlier attempt (or an older colo, which gave this folder to the user) may
    # have left things in it.
    run_dir = config.run_dir(job.id)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    os.chown(run_dir, os.geteuid(), os.getegid())
    os.chmod(run_dir, 0o711)
    in_container = job.spec.image is not None
    env = dict(job.spec.env)
    env["COLO_JOB_ID"] = str(job.id)
    if job.spec.array_job is not None:  # as Slurm's SLURM_ARRAY_TASK_ID, _JOB_ID and _TASK_COUNT
        env["COLO_ARRAY_INDEX"] = str(job.spec.array_index)
        env["COLO_ARRAY_JOB_ID"] = str(job.spec.array_job)
        env["COLO_ARRAY_TASK_COUNT"] = str(job.spec.array_size)
    mounts: list[Mount] = []  # colo's own; the user's are added last (below)
    share_shm = False
    if in_container:
        # Said by colo, never left to the image: CUDA images set NVIDIA_VISIBLE_DEVICES=all, and an
        # engine whose default runtime is NVIDIA's would hand a --gpus 0 job every GPU (no budget,
        # no ledger). "void": the runtime's hook adds nothing. (Docker's device request says the same
        # GPUs for a GPU job.)
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(dec.gpus) if job.spec.gpus else "void"

    if job.spec.gpus:
        ledger = run_dir / "ledger"
        interposer.create_ledger(ledger, job.spec.gpu_mem, devices=len(dec.gpus), uid=job.uid, gid=job.gid)
        # what the interposer takes, not the job's env (which it may change): root's, read-only
        interposer.write_budget(run_dir, job.spec.gpu_mem, job.uid, job.id)
        ndir = native_dir
        if in_container:
            mounts.append(Mount(str(ndir), f"{IN_JOB}/native", True))
            mounts.append(Mount(str(run_dir), f"{IN_JOB}/run", False))
            lib, led = f"{IN_JOB}/native/{native.INTERPOSER}", f"{IN_JOB}/run/ledger"
        else:
            lib, led = str(ndir / native.INTERPOSER), str(ledger)
        env.update(interposer.job_env(job.spec.gpu_mem, led, lib))
        env["CUDA_VISIBLE_DEVICES"] = ",".join(dec.gpus)
        if config.fakegpu_state is not None:
            state = config.fakegpu_state
            if in_container:
                mounts.append(Mount(str(state.parent), f"{IN_JOB}/fakegpu", False))
                env["COLO_FAKEGPU_STATE"] = f"{IN_JOB}/fakegpu/{state.name}"
                env["LD_LIBRARY_PATH"] = f"{IN_JOB}/native/{native.FAKEGPU_DIR}"
            else:
                env.update(gpus.fake_env())
        if dec.mode == "mps":
            gpu = next(g for g in gpus.devices if g.uuid == dec.gpus[0])
            # the job (STARTING) and the GPU's other MPS jobs: their uids may reach the daemon
            gpus.mps.allow(gpu.uuid, gpu.index, lambda: mps_users().get(gpu.uuid, ()))
            daemon = gpus.mps.ensure(gpu.uuid, gpu.index)
            client = daemon.client_env(job.spec.gpu_mem, dec.thread_pct)
            if in_container:
                mounts.append(Mount(str(daemon.pipe_dir), f"{IN_JOB}/mps", False))
                client["CUDA_MPS_PIPE_DIRECTORY"] = f"{IN_JOB}/mps"
                share_shm = True
            env.update(client)
        else:
            null = mps.null_pipe_dir(config.state_dir / "mps")
            env["CUDA_MPS_PIPE_DIRECTORY"] = f"{IN_JOB}/nomps" if in_container else str(null)
            if in_container:
                mounts.append(Mount(str(null), f"{IN_JOB}/nomps", True))

    log_path = config.log_path(job.id)  # in the root-only logs/ folder; the runtime writes it as root
    log_path.touch(mode=0o600, exist_ok=True)
    # Last, so that nothing after it can fail and leave them mounted: the user's sources opened
    # again as the user and pinned, Docker mounts what was checked (pin.py). Launch.release
    # unmounts the staging once the container has started.
    try:
        user_mounts, release = pin.stage(job.spec.mounts, Caller(0, job.uid, job.gid), native_dir / pin.HELPER,
                                         [config.state_dir, config.socket.parent],
                                         config.state_dir / "mounts", job.id)
    except (Invalid, Forbidden, OSError) as e:
        raise StartError(str(e)) from None
    mounts = user_mounts + mounts
    return Launch(job_id=job.id, argv=job.spec.argv, uid=job.uid, gid=job.gid, log_path=log_path,
                  run_dir=run_dir, image=job.spec.image, env=env, mounts=mounts, workdir=job.spec.workdir,
                  gpus=list(dec.gpus), labels={"colo.job": str(job.id), "colo.user": job.user},
                  share_host_shm=share_shm, release=release, cpus=job.spec.cpus, mem=job.spec.mem,
                  tasks=job.spec.tasks or config.job_tasks or None,
                  output=job.spec.output and job.spec.out_path(job.spec.output, job.id, job.user),
                  error=job.spec.error and job.spec.out_path(job.spec.error, job.id, job.user))
