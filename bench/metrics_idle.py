"""What idle connections to the metrics endpoint cost the daemon (issue 52 item 2): a real daemon
with metrics_listen, N idle TCP connections held open, the daemon's threads, descriptors and
RSS before, while held, and after; and whether a scrape and a `colo` request are answered while
they are held.

Run: python bench/metrics_idle.py [--connections 3000]
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import tempfile
import time
import urllib.request
from pathlib import Path

import checkout  # noqa: E402
checkout.use_harness()
from harness.daemon import DaemonProc, wait_for  # noqa: E402


def _status(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        rows = dict(ln.split(":", 1) for ln in f)
    return {"threads": int(rows["Threads"]), "rss_mib": int(rows["VmRSS"].split()[0]) // 1024,
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=3000)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, a.connections + 1024), hard))
    d = DaemonProc(Path(tempfile.mkdtemp(prefix="metrics-idle-")), config={"metrics_listen": f"127.0.0.1:{port}"})
    d.start()
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        wait_for(lambda: urllib.request.urlopen(url, timeout=10).status == 200, 60, "the endpoint")
        before = _status(d.proc.pid)
        held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(a.connections)]
        time.sleep(1)  # a report of a steady state, not a test: let the accepts settle
        during = _status(d.proc.pid)
        t = time.monotonic()
        d.client.hello()
        hello_ms = (time.monotonic() - t) * 1000
        try:
            scrape = urllib.request.urlopen(url, timeout=15).status
        except OSError as e:
            scrape = f"refused ({e.__class__.__name__}: more than MAX_CONNECTIONS open)"
        for s in held:
            s.close()
        time.sleep(1)
        after = _status(d.proc.pid)
        print(f"{a.connections} idle metrics connections")
        for name, st in (("before", before), ("held", during), ("after", after)):
            print(f"  {name:<7} threads {st['threads']:>4}  fds {st['fds']:>5}  rss {st['rss_mib']:>4} MiB")
        print(f"  while held: colo hello {hello_ms:.1f} ms, scrape {scrape}")
    finally:
        d.stop()


if __name__ == "__main__":
    main()
