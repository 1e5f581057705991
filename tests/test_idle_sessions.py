"""The idle policy on a real session (docs/gating.md "Idle holders"): `colo shell` as a real
user, driven through a real pty; the session holds GPU memory and does nothing with the GPU."""
from __future__ import annotations

import os

import pytest

from colo.node import native
from harness.daemon import DaemonProc, gpu_node, local_user
from harness.terminal import SHELL, Term, session_job


@pytest.fixture
def idle_node():
    if os.geteuid() != 0:
        pytest.skip("sessions of real users need a root daemon")
    root, state, _ = gpu_node("colo-idle-", count=1)
    d = DaemonProc(root, state, {"idle_after": 1.0, "idle_sessions": "end", "idle_grace": 2.0}).start()
    os.chmod(d.socket.parent, 0o755)
    yield d
    d.stop()


def test_an_idle_session_is_told_on_its_terminal_then_ended_after_the_grace(idle_node):
    d, alice = idle_node, local_user("colosess1")
    t = Term(d, alice, "shell", "--gpu-mem", "256MiB", *SHELL)
    try:
        t.prompt()
        job = session_job(d, alice)
        t.send(f"{native.native_dir() / native.BURN} --mem 64MiB --duty 0 --seconds 600")
        t.expect(r"colo: this session holds 64MiB of GPU memory and has not used the GPU for \d+s; "
                 r"it ends in 2s unless the GPU is used", timeout=60)
        assert t.wait(60) != 0
    finally:
        t.close()
    ended = d.wait_state(job["id"], "cancelled", timeout=60)
    assert ended["reason"].startswith("cancelled by colo (idle ") and "idle_sessions = end" in ended["reason"]
