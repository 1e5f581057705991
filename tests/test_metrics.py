"""Prometheus metrics: a real daemon with `metrics_listen`, scraped over HTTP and read with
Prometheus' own text parser (prometheus_client.parser), and linted by promtool where it is
installed (Debian's prometheus package: .ci/run installs it)."""
import os
import resource
import shutil
import socket
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from harness.daemon import DaemonProc, wait_for

MiB = 1024**2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict:
    """{(name, ((label, value), ...)): value} of every sample."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("Threads:"))


def test_metrics_show_budgets_jobs_queue_and_counters_that_only_go_up(tmp_path, fakegpu):
    port = _free_port()
    d = DaemonProc(tmp_path, fakegpu.state, config={"metrics_listen": f"127.0.0.1:{port}"}).start()
    try:
        uuid = fakegpu.uuids()[0]
        first = wait_for(lambda: _try_scrape(port), 30, "the metrics endpoint")
        assert first[("colo_gpu_budgeted_bytes", (("gpu", "0"), ("uuid", uuid)))] == 0
        assert first[("colo_queue_jobs", ())] == 0
        total = [v for (name, labels), v in first.items()
                 if name == "colo_gpu_memory_total_bytes" and ("uuid", uuid) in labels]
        assert total == [16 * 1024**3]

        job = d.client.submit({"argv": ["sleep", "30"], "gpus": 1, "gpu_mem": 512 * MiB, "gpu_ids": [0],
                               "name": "m"})["id"]
        d.wait_state(job, "running", timeout=30)
        user = d.client.show(job)["user"]
        got = wait_for(lambda: (m := _scrape(port))[("colo_gpu_budgeted_bytes", (("gpu", "0"), ("uuid", uuid)))]
                       == 512 * MiB and m, 15, "the running job's budget in the metrics")
        assert got[("colo_user_jobs", (("state", "running"), ("user", user)))] == 1
        assert got[("colo_user_budgeted_bytes", (("user", user),))] == 512 * MiB
        mode = d.client.show(job)["mode"]
        assert got[("colo_gpu_jobs", (("gpu", "0"), ("mode", mode), ("uuid", uuid)))] == 1
        _promtool_check(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())

        # counted in seconds while the job runs
        running = wait_for(lambda: (m := _scrape(port)).get(("colo_user_gpu_seconds_total", (("user", user),)), 0)
                           > 0 and m, 30, "the running job's GPU-seconds in the metrics")
        assert running[("colo_gpu_seconds_one_per_gpu_total", ())] > 0
        assert running[("colo_gpu_seconds_busy_total", ())] > 0
        d.client.cancel(job)
        d.wait_state(job, "cancelled", timeout=30)
        ended = wait_for(lambda: (m := _scrape(port))[("colo_gpu_budgeted_bytes", (("gpu", "0"), ("uuid", uuid)))]
                         == 0 and m, 30, "the budget given back")
        before = ended[("colo_user_gpu_seconds_total", (("user", user),))]

        # removing the job from the history takes nothing off the counters, nor does a restart
        assert d.client.clean(refs=[str(job)])["removed"] == 1
        assert _scrape(port)[("colo_user_gpu_seconds_total", (("user", user),))] >= before
        d.stop()
        d.start()
        after = wait_for(lambda: _try_scrape(port), 60, "the metrics endpoint after the restart")
        assert after[("colo_user_gpu_seconds_total", (("user", user),))] >= before
    finally:
        d.stop()


def _promtool_check(text: str) -> None:
    """`promtool check metrics`: no complaint (names, units, HELP and TYPE as Prometheus wants them).
    Without promtool the parser above is the check; CI (CI=true) must have it."""
    if shutil.which("promtool") is None:
        assert not os.environ.get("CI"), "promtool is missing: .ci/run installs Debian's prometheus package"
        return
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def _try_scrape(port: int):
    try:
        return _scrape(port)
    except OSError:
        return None


def test_a_taken_port_costs_the_metrics_only_and_is_tried_again(tmp_path, fakegpu):
    """Another exporter holds the port: the daemon serves on, says so once, and takes the port
    when it is free; 3,000 idle connections to the endpoint then hold no thread of the daemon's."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    d = DaemonProc(tmp_path, fakegpu.state, config={"metrics_listen": f"127.0.0.1:{port}"}).start()
    try:
        assert d.client.hello()  # the daemon runs
        job = d.client.submit({"argv": ["true"], "gpus": 0, "name": "t"})["id"]
        d.wait_state(job, "succeeded", timeout=60)
        wait_for(lambda: "cannot listen on" in d.log.read_text(), 30, "the bind failure in the log")
        said = [ln for ln in d.log.read_text().splitlines() if "metrics:" in ln]
        assert len(said) == 1 and "ERROR" in said[0] and "tries again" in said[0] and "Traceback" not in \
            d.log.read_text(), said
        taken.close()
        wait_for(lambda: _try_scrape(port), 60, "the metrics once the port is free")
        assert len([ln for ln in d.log.read_text().splitlines() if "cannot listen" in ln]) == 1  # once

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
        base = _threads(d.proc.pid)
        idle = []
        try:
            for _ in range(3000):
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                idle.append(s)
            threads = _threads(d.proc.pid)
            assert threads < base + 20, (base, threads)
            assert d.client.hello()  # the daemon answers meanwhile
            assert _scrape(port)[("colo_queue_jobs", ())] == 0  # and a scrape: idle ones make room for it
        finally:
            for s in idle:
                s.close()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        wait_for(lambda: _try_scrape(port), 60, "a scrape once the idle connections are gone")
    finally:
        taken.close()
        d.stop()


def test_a_malformed_metrics_address_is_one_line(tmp_path):
    cfg = tmp_path / "c.toml"
    for bad in ("9824", ":9824"):  # ":9824" was every address: now only when written so
        cfg.write_text(f'metrics_listen = "{bad}"\n')
        r = subprocess.run([sys.executable, "-m", "colo", "daemon", "--state-dir", str(tmp_path / "s"), "--socket",
                            str(tmp_path / "s.sock"), "--config", str(cfg)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0
        assert f"metrics_listen: '{bad}' is not ADDRESS:PORT" in r.stderr and "Traceback" not in r.stderr
