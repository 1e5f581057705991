"""A container session against `docker run -it`, and an attach after a dropped client.

    python bench/session_bench.py [-n 5]

Start: from the command's start until the session's first line shows on its terminal, for
`docker run -it --rm IMAGE CMD` and `colo run --image IMAGE --gpus 0 -- CMD` (a private daemon
on a simulated GPU, the colo client a fresh Python process as a person's is), alternating, the
same local image and command. Attach: a detached container session writes a line and waits; a
`colo attach` is killed (a dropped client), and a new one is timed from its start until that
line is on its terminal. Run as root (the daemon); the engine must answer.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchlib import Report  # noqa: E402

RUN = uuid.uuid4().hex[:8]
COLO = str(Path(sys.executable).parent / "colo")


def timed(argv: list[str], env: dict, marker: str, to_end: bool = True) -> float:
    """Seconds from spawning argv on a terminal of its own until `marker` shows on it (then,
    untimed, until it ends unless not `to_end`)."""
    import pexpect

    t0 = time.perf_counter()
    p = pexpect.spawn(argv[0], argv[1:], env=env, timeout=120, dimensions=(24, 80))
    try:
        p.expect_exact(marker)
        took = time.perf_counter() - t0
        if to_end:
            p.expect(pexpect.EOF)
        return took
    finally:
        p.close(force=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="runs of each (default 5)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    rep = Report("session_bench")

    import docker

    from colo.node import fakegpu
    from colo.runtimes.image import build_local_image

    import checkout
    checkout.use_harness()
    from harness.daemon import DaemonProc, wait_for

    client = docker.from_env()
    image = build_local_image(client, "colo-test/base:1")
    tmp = Path(tempfile.mkdtemp(prefix="colo-bench-"))
    fakegpu.create(tmp / "fakegpu.state", count=1, mem=16 * 2**30)
    (tmp / "daemon").mkdir()
    daemon = DaemonProc(tmp / "daemon", tmp / "fakegpu.state", {"stop_grace": 1.0}).start()
    env = {**os.environ, "COLO_SOCKET": str(daemon.socket), "TERM": "xterm"}
    cmd = ["sh", "-c", "echo session-$((40+2)); exit 0"]
    docker_run = ["docker", "run", "-it", "--rm", "--user", "1000:1000", "--label", f"colo.bench={RUN}", image, *cmd]
    colo_run = [COLO, "run", "--image", image, "--gpus", "0", "--", *cmd]
    try:
        timed(docker_run, env, "session-42")  # warm-up: the engine's image cache, the client's imports
        timed(colo_run, env, "session-42")
        dk, co = [], []
        for _ in range(args.n):
            dk.append(timed(docker_run, env, "session-42"))
            co.append(timed(colo_run, env, "session-42"))
        import pexpect

        p = pexpect.spawn(COLO, ["run", "--detach", "--image", image, "--gpus", "0", "--", "sh", "-c",
                                 "echo last-screen-$((6*7)); exec sleep 600"], env=env, timeout=120)
        p.expect(r"job (\d+): a detached session")
        job = int(p.match.group(1))
        p.close()
        wait_for(lambda: daemon.client.show(job)["state"] == "running", 120, "the detached session to run")
        att = []
        for _ in range(args.n):
            dropped = pexpect.spawn(COLO, ["attach", str(job)], env=env, timeout=120)
            dropped.expect_exact("last-screen-42")
            dropped.kill(9)  # the connection drops: the session runs on
            dropped.close(force=True)
            att.append(timed([COLO, "attach", str(job)], env, "last-screen-42", to_end=False))
        daemon.client.cancel(job)
        states = {j["state"] for j in daemon.client.ls(all=True) if j["id"] != job}
        rep.check(states == {"succeeded"}, f"every session should have succeeded: {states}")
    finally:
        daemon.stop()
        for c in client.api.containers(all=True, filters={"label": f"colo.bench={RUN}"}):
            client.api.remove_container(c["Id"], force=True)
        shutil.rmtree(tmp, ignore_errors=True)
    rep.note(f"n={args.n} each, engine {client.version()['Version']}; load {os.getloadavg()[0]:.1f}")
    rep.figure("container_session_start", "colo run --image: start -> first line on its terminal",
               statistics.median(co), "s", statistics.median(dk), "`docker run -it --rm`", f"median of {args.n}")
    rep.figure("attach_last_screen", "colo attach after a dropped client: start -> last screen shown",
               statistics.median(att), "s", None, "", f"median of {args.n}")
    return rep.finish(args.json_out)


if __name__ == "__main__":
    sys.exit(main())
