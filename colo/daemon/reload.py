"""Reloading the config without a restart: SIGHUP (`systemctl reload colo`).

The file is read again through the daemon's one validator (`Config.load`, with the same flags as
at start). A file it refuses changes nothing: the running config stays and the log says why, one
line. Otherwise the keys in LIVE that changed are applied at once (the daemon's parts read them
from the one Config at each use; the scheduler's per-user limits are handed to it); every other
key that changed is named as needing a restart, and keeps its running value until then.
"""
from __future__ import annotations

import logging
import os
import pwd
from dataclasses import fields
from typing import TYPE_CHECKING, Callable

from ..config import Config, ConfigError

if TYPE_CHECKING:
    from .core import Daemon

log = logging.getLogger("colo")

# What a running daemon takes from a reload: limits, the idle and suspend policies, the patrol,
# retention, who is an admin, the detach keys (for sessions running too: detach.Terminals.configure). Not here (a restart applies them): paths and the socket, the GPUs'
# and MPS' set-up, the placement model (saturation, slowdown_bound...: plan()'s config is built
# once), metrics_listen (its server is bound at start), the gate, log_cap (the runtimes hold it).
LIVE = frozenset({
    "admin_group", "max_user_priority", "max_queued_per_user", "max_running_per_user", "max_gpu_mem_per_user",
    "max_connections_per_user", "max_streams_per_user", "job_tasks", "max_job_tasks", "stop_grace",
    "patrol_grace", "patrol_window", "patrol_kill", "history_keep_days", "idle_after", "idle_sessions",
    "idle_grace", "idle_jobs", "preempt", "suspend_host_share", "suspend_host_max", "suspend_lock_timeout",
    "detach_scrollback", "detach_read_rate", "max_detached_per_user",
})
LIMITS = {"max_queued_per_user", "max_running_per_user", "max_gpu_mem_per_user"}
DETACH = {"detach_scrollback", "detach_read_rate", "max_detached_per_user"}  # running sessions' holders and relays too


def _me() -> str:
    """Who reloads: a SIGHUP's sender is not known here, but only root or the daemon's own user can send it."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """The keys that differ: (those applied live, those that need a restart), each sorted."""
    differ = sorted(f.name for f in fields(Config) if getattr(old, f.name) != getattr(new, f.name))
    return [k for k in differ if k in LIVE], [k for k in differ if k not in LIVE]


def reload(daemon: "Daemon", load: Callable[[], Config]) -> tuple[list[str], list[str]] | None:
    """Read the config again and apply what can change live; None when the file is refused."""
    by = _me()
    try:
        new = load()
    except ConfigError as e:
        log.error("config reload refused, the running config stays: %s", e)
        daemon.store.log_admin(by, "reload", "config", f"SIGHUP; refused, the running config stays: {e}")
        return None
    live, later = changes(daemon.config, new)
    for k in live:
        setattr(daemon.config, k, getattr(new, k))
    if LIMITS & set(live):
        daemon.scheduler.set_limits(new.max_queued_per_user, new.max_running_per_user, new.max_gpu_mem_per_user)
    if DETACH & set(live):
        daemon.terminals.configure(new.detach_scrollback, new.detach_read_rate)  # (the limit: admission reads the config)
        daemon.engines.set_tty_rate(new.detach_read_rate)
    if live:
        daemon.wake()  # a limit or policy that changed may start or stop something now
    said = (f"applied {', '.join(live)}" if live else "nothing to apply") + (
        f"; these need a restart (systemctl restart colo) and keep their running values: {', '.join(later)}"
        if later else "")
    (log.warning if later else log.info)("config reloaded: %s", said)
    daemon.store.log_admin(by, "reload", "config", f"SIGHUP; {said}")
    return live, later
