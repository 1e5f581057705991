"""The daemon as systemd runs it (packaging/colo.service): readiness sent when the socket accepts
(Type=notify), each journal line with its priority, and a config error that does not restart."""
from __future__ import annotations

import socket
import subprocess
import sys

from harness.daemon import DaemonProc


def test_ready_is_sent_once_the_socket_answers_and_lines_carry_their_priority(tmp_path, fakegpu):
    notify = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(notify))
        s.settimeout(120)
        d = DaemonProc(tmp_path, fakegpu.state, env={"NOTIFY_SOCKET": str(notify), "JOURNAL_STREAM": "8:1"})
        try:
            d.start()
            assert s.recv(4096) == b"READY=1"
            # ready means ready: the socket answered before (DaemonProc.start waits on it), and does now
            assert d.client.hello()["version"]
            job = d.client.submit({"argv": ["true"], "gpus": 0, "name": "t", "workdir": "/tmp"})["id"]
            d.wait_state(job, "succeeded", timeout=60)
        finally:
            d.stop()
    lines = d.log.read_text().splitlines()
    assert any(ln.startswith("<6>colo INFO job ") and "-> running" in ln for ln in lines), lines
    assert all(ln.startswith(("<3>", "<4>", "<6>", "<7>")) for ln in lines if ln.startswith("<")), lines
    warnings = [ln for ln in lines if " WARNING " in ln]
    assert all(ln.startswith("<4>") for ln in warnings), warnings


def test_a_config_error_exits_78_for_restart_prevent_exit_status(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("no_such_key = 1\n")
    r = subprocess.run([sys.executable, "-m", "colo", "daemon", "--state-dir", str(tmp_path / "s"), "--socket",
                        str(tmp_path / "s.sock"), "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and "no_such_key" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
