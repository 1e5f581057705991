"""Issue 42: `colo config check [FILE]` reads a config as the daemon does (Config.load's validator)
and says every error, each with its line; the packaged unit runs it before each (re)start."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from colo.config import Config, ConfigError, check

REPO = Path(__file__).resolve().parent.parent

# (TOML lines, the line of the key at fault): each a value the daemon refuses to start with
BAD = [
    (['reserve = "lots"'], 1),
    (['stop_grace = "ten"'], 1),
    (["patrol_kill = 1"], 1),
    (["max_queued_per_user = 1.5"], 1),
    (["history_keep_days = -1"], 1),
    (['metrics_listen = "9400"'], 1),
    (["patrol_grace = 30", "patrol_window = 10"], 2),
    (["suspend_host_share = 2"], 1),
    (["idle_after = -5"], 1),
    (['idle_jobs = "sometimes"'], 1),
    (['idle_sessions = "maybe"'], 1),
    (['gpu_group = " wheel"'], 1),
    (['gpu_gate_at = ["../x"]'], 1),
    (["bogus_key = 1"], 1),
    (['detach_scrollback = "100"'], 1),
    (['detach_read_rate = "2GiB"'], 1),
    (["max_detached_per_user = -1"], 1),
]


@pytest.mark.parametrize("lines,at", BAD, ids=[b[0][-1].split(" ")[0] for b in BAD])
def test_check_says_what_the_daemon_refuses_with_its_line(tmp_path, lines, at):
    f = tmp_path / "colo.toml"
    f.write_text("# colo\n" + "\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as refused:
        Config.load(f)
    assert check(f) == [f"{f}:{at + 1}: {refused.value}"]


def test_check_says_every_error_at_once_in_the_files_order(tmp_path):
    f = tmp_path / "colo.toml"
    body = [line for lines, _ in BAD for line in lines]
    f.write_text("\n".join(body) + "\n")
    got = check(f)
    assert len(got) == len(BAD)  # one each (patrol_grace is fine: patrol_window is at fault)
    at = [int(e.split(":")[1]) for e in got]
    assert at == sorted(at) and at == [i + 1 for i, line in enumerate(body) if not line.startswith("patrol_grace")]
    assert check(REPO / "packaging" / "colo.toml") == []  # what the package installs
    broken = tmp_path / "broken.toml"
    broken.write_text("reserve = \n")
    with pytest.raises(ConfigError) as refused:
        Config.load(broken)
    assert check(broken) == [str(refused.value)] and "line 1" in str(refused.value)


def test_the_command_exits_1_on_errors_and_the_unit_runs_it_on_reload(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('idle_sessions = "maybe"\nstop_grace = "ten"\n')
    r = subprocess.run([sys.executable, "-m", "colo", "config", "check", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [f"colo: {bad}:1: idle_sessions: 'maybe' is not one of off, notify, end, suspend",
                                     f"colo: {bad}:2: stop_grace: 'ten' is not a number"]
    good = tmp_path / "good.toml"
    good.write_text("stop_grace = 5\n")
    r = subprocess.run([sys.executable, "-m", "colo", "config", "check", str(good)], capture_output=True, text=True)
    assert (r.returncode, r.stdout) == (0, "ok\n")
    # the daemon refuses the same file with one of the same errors
    r = subprocess.run([sys.executable, "-m", "colo", "daemon", "--config", str(bad), "--state-dir",
                        str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock")],
                       capture_output=True, text=True, timeout=60)
    said = {line.split(": ", 1)[1] for line in check(bad)}
    assert r.returncode == 78 and r.stderr.removeprefix("colo: ").strip() in said, r.stderr  # EX_CONFIG
    unit = (REPO / "packaging" / "colo.service").read_text()
    # the daemon checks the file at start (78: no restart); a failing ExecStartPre= would be restarted
    assert "\nExecStartPre=" not in unit and "RestartPreventExitStatus=78\n" in unit
    assert ("ExecReload=/opt/colo/bin/colo config check /etc/colo/colo.toml\n"
            "ExecReload=/bin/kill -HUP $MAINPID\n") in unit
    assert "ExecStart=/opt/colo/bin/colo daemon --config /etc/colo/colo.toml\n" in unit


def test_the_detach_keys_are_sizes_in_bounds_and_say_so_in_one_line(tmp_path):
    """Issue 43: detached sessions' scrollback, read rate and count per user."""
    c = Config.load(None, state_dir=tmp_path, detach_scrollback="8KiB", detach_read_rate="1MiB",
                    max_detached_per_user=0)
    assert (c.detach_scrollback, c.detach_read_rate, c.max_detached_per_user) == (8 << 10, 1 << 20, 0)
    assert (Config().detach_scrollback, Config().detach_read_rate, Config().max_detached_per_user) == (
        128 << 10, 4 << 20, 16)
    for key, value, said in (("detach_scrollback", "100", "detach_scrollback: 100B is not a size from 1KiB to 64MiB"),
                             ("detach_scrollback", 0, "detach_scrollback: 0B is not a size from 1KiB to 64MiB"),
                             ("detach_read_rate", "2GiB", "detach_read_rate: 2GiB is not bytes a second from 4KiB "
                                                          "to 1GiB"),
                             ("max_detached_per_user", 1.5, "max_detached_per_user: 1.5 is not a whole number")):
        with pytest.raises(ConfigError) as refused:
            Config.load(None, **{key: value})
        assert str(refused.value) == said and "\n" not in said
