"""Where colo's socket and state are by default. A module of its own, so that `colo submit`,
which needs only the socket's path, does not import the config machinery (dataclasses, TOML)."""
from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path


def socket_path() -> str:
    """The default socket as text (the client needs no pathlib: colo/cli/submitspec.py)."""
    env = os.environ.get("COLO_SOCKET")
    if env:
        return env
    if os.geteuid() == 0:
        return "/run/colo/colo.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/colo-{os.geteuid()}"
    return os.path.join(runtime, "colo", "colo.sock")


def default_socket() -> Path:
    from pathlib import Path

    return Path(socket_path())


def default_state_dir() -> Path:
    from pathlib import Path

    env = os.environ.get("COLO_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/colo")
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "colo"
