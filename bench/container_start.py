"""Submit-to-running latency of a small container job: DockerRuntime.start vs `docker run -d`.

    python bench/container_start.py [-n 10]

Both sides start the same locally imported image running `sleep 30` and are timed until the
engine reports the container started (what `docker run -d` returns on). Runs alternate between
the two so drift in the machine's load hits both alike. `measure` is reused by the daemon bench.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

from benchlib import Report, daemon_log_problems  # noqa: E402

RUN = uuid.uuid4().hex[:8]
LABEL = f"colo.bench={RUN}"


def measure(
    fn: Callable[[], object], n: int, cleanup: Callable[[object], None] | None = None
) -> list[float]:
    """Wall time of n calls of fn, in seconds; cleanup(result) runs after each call, untimed."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = fn()
        out.append(time.perf_counter() - t0)
        if cleanup is not None:
            cleanup(r)
    return out


def p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=10, help="runs of each (default 10)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    rep = Report("container_start")

    import docker

    from colo.runtimes.base import Launch
    from colo.runtimes.docker import DockerRuntime
    from colo.runtimes.image import build_local_image

    client = docker.from_env(max_pool_size=32)
    image = build_local_image(client, "colo-test/base:1")
    rt = DockerRuntime(client)
    tmp = Path(tempfile.mkdtemp(prefix="colo-bench-"))
    seq = iter(range(10**9))

    def colo_start() -> str:
        i = next(seq)
        return rt.start(
            Launch(
                job_id=900_000_000 + i,
                argv=["sleep", "30"],
                uid=1000,
                gid=1000,
                log_path=tmp / f"{i}.log",
                run_dir=tmp,
                image=image,
                labels={"colo.bench": RUN},
            )
        )

    def cli_start() -> str:
        r = subprocess.run(
            ["docker", "run", "-d", "--user", "1000:1000", "--label", LABEL, image, "sleep", "30"],
            capture_output=True,
            text=True,
            check=True,
        )
        return r.stdout.strip()

    def remove(handle: str) -> None:
        rt.cleanup(handle)

    # the whole daemon: submit over the socket -> validated, stored, planned, launched, "running"
    import checkout
    checkout.use_harness()
    from harness.daemon import DaemonProc, wait_for

    from colo.node import fakegpu

    fakegpu.create(tmp / "fakegpu.state", count=1, mem=16 * 2**30)
    (tmp / "daemon").mkdir()
    daemon = DaemonProc(tmp / "daemon", tmp / "fakegpu.state", {"stop_grace": 1.0}).start()
    quits_on_term = ["sh", "-c", "trap 'exit 0' TERM; sleep 30 & wait"]

    def daemon_start() -> int:
        j = daemon.client.submit({"argv": quits_on_term, "image": image, "gpus": 0})["id"]
        wait_for(lambda: daemon.client.show(j)["state"] == "running", 30, "job to run", interval=0.002)
        return j

    def daemon_remove(j: int) -> None:
        daemon.client.cancel(j)
        wait_for(lambda: daemon.client.show(j)["state"] == "cancelled", 30, "job to stop")

    def check_running(handle: str) -> None:
        st = client.api.inspect_container(handle)["State"]
        rep.check(st["Running"], f"container {handle[:12]} is not running: {st.get('Status')} {st.get('Error')}")
        remove(handle)

    try:
        measure(
            colo_start, 1, remove
        )  # warm-up: first connection, image metadata in the engine's cache
        measure(cli_start, 1, remove)
        measure(daemon_start, 1, daemon_remove)
        colo, cli, full = [], [], []
        for _ in range(args.n):
            colo += measure(colo_start, 1, check_running)
            cli += measure(cli_start, 1, check_running)
            full += measure(daemon_start, 1, daemon_remove)
        jobs = daemon.client.ls()
        st = {}
        for j in jobs:
            st[j["state"]] = st.get(j["state"], 0) + 1
        rep.check(st == {"cancelled": args.n + 1}, f"every daemon job should have run and been cancelled: {st}")
    finally:
        daemon.stop()
        rt.close()
        for c in client.api.containers(all=True, filters={"label": LABEL}):
            client.api.remove_container(c["Id"], force=True)
        shutil.rmtree(tmp, ignore_errors=True)

    rep.check(not (p := daemon_log_problems(daemon.log)), f"daemon log: {p[:3]}")
    engine = client.version()["Version"]
    rep.note(f"n={args.n} each, engine {engine}; p90: DockerRuntime.start {p90(colo) * 1000:.1f} ms, "
             f"docker run -d {p90(cli) * 1000:.1f} ms, submit -> running {p90(full) * 1000:.1f} ms")
    rep.figure("runtime_start", "DockerRuntime.start (container started)", statistics.median(colo), "s",
               statistics.median(cli), "`docker run -d` (CLI)", f"median of {args.n}")
    rep.figure("submit_running", "container job, submit -> running through the daemon", statistics.median(full),
               "s", statistics.median(cli), "`docker run -d` (CLI)", f"median of {args.n}")
    return rep.finish(args.json_out)


if __name__ == "__main__":
    sys.exit(main())
