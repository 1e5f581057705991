"""Prometheus metrics: a real daemon with `metrics_listen`, scraped over HTTP and read with
Prometheus' own text parser (prometheus_client.parser)."""
import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from daemon_util import DaemonProc, wait_for

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


def test_metrics_show_budgets_jobs_queue_and_gpu_hours(tmp_path, fakegpu):
    port = _free_port()
    d = DaemonProc(tmp_path, fakegpu.state, config={"metrics_listen": f"127.0.0.1:{port}"}).start()
    try:
        uuid = fakegpu.uuids()[0]
        first = _scrape(port)
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

        d.client.cancel(job)
        d.wait_state(job, "cancelled", timeout=30)
        ended = wait_for(lambda: (m := _scrape(port)).get(("colo_user_gpu_hours_total", (("user", user),)), 0) > 0
                         and m, 30, "the ended job's GPU-hours in the metrics")
        assert ended[("colo_gpu_budgeted_bytes", (("gpu", "0"), ("uuid", uuid)))] == 0
        assert ended[("colo_gpu_hours_one_per_gpu_total", ())] > 0
    finally:
        d.stop()


def test_a_malformed_metrics_address_is_one_line(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('metrics_listen = "9400"\n')
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "colo", "daemon", "--state-dir", str(tmp_path / "s"), "--socket",
                        str(tmp_path / "s.sock"), "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "metrics_listen: '9400' is not ADDRESS:PORT" in r.stderr and "Traceback" not in r.stderr
