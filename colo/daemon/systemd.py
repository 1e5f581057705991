"""What systemd reads of the daemon: that it is ready (sd_notify, for the unit's Type=notify), and
each log line's priority (journald reads a "<N>" prefix on stderr: SyslogLevelPrefix).

sd_notify is one datagram to the socket systemd names in $NOTIFY_SOCKET: written here, as the
protocol is a line of text (no libsystemd, no new dependency). Sent once the daemon's socket
accepts, so that `systemctl start colo` (or restart) returns when `colo ls` can be answered.
"""
from __future__ import annotations

import logging
import os
import socket

# Lines of these modules at INFO come only with -v (the scheduler logs each full pass); job
# starts and ends (jobtable), the daemon's start and the metrics' state come without it.
CHATTY = frozenset({"scheduler"})
_PRIORITY = ((logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))  # syslog's err, warning, info


def notify(state: str) -> bool:
    """Send `state` ("READY=1", "STOPPING=1", "STATUS=...") to systemd; False when not under it."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path or not path.startswith(("/", "@")):
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path  # "@": an abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError:
        return False


class _Journal(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prio = next((p for level, p in _PRIORITY if record.levelno >= level), 7)
        return f"<{prio}>{super().format(record)}"


def _quiet(record: logging.LogRecord) -> bool:
    return record.levelno > logging.INFO or record.module not in CHATTY


def setup_logging(verbose: bool) -> None:
    """stderr, INFO and up (job starts and ends included; the scheduler's passes with -v); under
    journald (JOURNAL_STREAM) with each line's priority, and no time stamp (the journal has one)."""
    handler = logging.StreamHandler()
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_Journal("colo %(levelname)s %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s colo %(levelname)s %(message)s"))
    if not verbose:
        handler.addFilter(_quiet)
    logging.basicConfig(level=logging.INFO, handlers=[handler])
