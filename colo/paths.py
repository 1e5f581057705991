"""Where colo's socket and state are by default. A module of its own, so that `colo submit`,
which needs only the socket's path, does not import the config machinery (dataclasses, TOML).

One answer to "where is the daemon": the system daemon at /run/colo/colo.sock, whoever asks. A
private daemon (a plain user's `colo daemon`, a test's) only where asked for, with COLO_SOCKET
or --socket: never a guessed path in a shared folder such as /tmp, which any user can take first.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

SYSTEM_SOCKET = "/run/colo/colo.sock"  # the packaged unit's RuntimeDirectory=colo


def socket_path() -> str:
    """The socket a client reaches (as text: the client needs no pathlib, colo/cli/submitspec.py)."""
    return os.environ.get("COLO_SOCKET") or SYSTEM_SOCKET


def private_socket() -> str:
    """Where a plain user's own daemon listens when not told: a folder only that user may write
    ($XDG_RUNTIME_DIR, else their home's ~/.local/state), never /tmp."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        try:
            st = os.stat(runtime)
        except OSError:
            st = None
        if st is not None and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return os.path.join(runtime, "colo", "colo.sock")
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "colo", "colo.sock")


def daemon_socket() -> str:
    """Where a daemon listens when not told: the system socket as root, else a private one."""
    env = os.environ.get("COLO_SOCKET")
    if env:
        return env
    return SYSTEM_SOCKET if os.geteuid() == 0 else private_socket()


def default_socket() -> Path:
    """The daemon's default socket (Config.socket)."""
    from pathlib import Path

    return Path(daemon_socket())


def default_state_dir() -> Path:
    from pathlib import Path

    env = os.environ.get("COLO_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/colo")
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "colo"
