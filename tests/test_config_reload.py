"""Issue 42: SIGHUP (`systemctl reload colo`) reads the config again through the daemon's one
validator. A file it refuses changes nothing and the log says why; a good one applies the keys
that can change live at once (here a per-user limit: a waiting job starts) and names the others
as needing a restart. One real daemon."""
from __future__ import annotations

import signal

from harness.daemon import DaemonProc, wait_for


def test_sighup_applies_live_keys_names_the_rest_and_keeps_the_config_a_bad_file_breaks(tmp_path, fakegpu):
    d = DaemonProc(tmp_path, fakegpu.state, {"max_running_per_user": 1}).start()
    base = d.config_path.read_text()
    go = tmp_path / "go"
    hold = ["--process", "--gpu-mem", "1GiB", "--", "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.05; done"]
    try:
        first, second = d.submit(*hold), d.submit(*hold)
        d.wait_state(first, "running")
        wait_for(lambda: "max_running_per_user" in d.job(second)["reason"], 120, "the second job to wait for the limit")

        d.config_path.write_text(base.replace("max_running_per_user = 1", 'max_running_per_user = "lots"'))
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "config reload refused, the running config stays: max_running_per_user: 'lots' is not "
                         "a whole number" in d.log.read_text(), 120, "the daemon to refuse the file")
        assert d.proc.poll() is None
        node = d.client.hello(detail=True)["node"]
        assert node["limits"]["max_running_per_user"] == 1
        assert d.job(second)["state"] == "queued"

        d.config_path.write_text(base.replace("max_running_per_user = 1", "max_running_per_user = 2")
                                 + "saturation = 0.5\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: d.job(second)["state"] == "running", 120, "the second job to start under the new limit")
        assert ("config reloaded: applied max_running_per_user; these need a restart (systemctl restart colo) "
                "and keep their running values: saturation") in d.log.read_text()
        assert d.client.hello(detail=True)["node"]["limits"]["max_running_per_user"] == 2
        go.touch()
        for j in (first, second):
            d.wait_state(j, "succeeded")
    finally:
        go.touch()
        d.stop()
