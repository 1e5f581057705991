"""Notebook kernels as colo jobs (issue 32): a real ipykernel started through jupyter_client's
KernelManager with the kernelspec `colo kernelspec install` writes, whose provisioner (`colo`,
found through its entry point) makes each kernel a job of a real daemon on a simulated GPU.

The kernels run as root here: this interpreter (the kernels' Python) is under /root, which other
uids cannot execute. Sessions of real users are tested through a pty in test_sessions.py."""
from __future__ import annotations

import json
import sys

import pytest

from colo.node import native
from harness.daemon import wait_for

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

BUDGET = "256MiB"
# A CUDA caller through ctypes against the simulated driver (the interposer counts it): 1 MiB in the
# budget, then 1 GiB past it.
ALLOC = """
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
ctx, p = ctypes.c_void_p(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
print("small", cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 20)))
print("big", cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(1 << 30)))
"""


pytestmark = pytest.mark.node("colo-jupyter-", count=1, then=lambda n: n.daemon(home=None, reachable=False),
                              per="module")


@pytest.fixture
def kernels(node, tmp_path, monkeypatch):
    """Where `colo kernelspec install --prefix` put the kernelspec colo-test; Jupyter looks there."""
    prefix = tmp_path / "prefix"
    r = node.cli("kernelspec", "install", "--gpu-mem", BUDGET, "--name", "colo-test", "--python", sys.executable,
                 "--prefix", str(prefix), "--socket", str(node.socket))
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    return prefix / "share" / "jupyter" / "kernels" / "colo-test"


def _run(kc, code: str, timeout: float = 60) -> tuple[dict, str]:
    """(the execute reply's content, what the cell printed)."""
    out: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return reply["content"], "".join(out)


def test_kernelspec_names_the_provisioner_and_the_budget(kernels):
    spec = json.loads((kernels / "kernel.json").read_text())
    assert spec["metadata"]["kernel_provisioner"] == {
        "provisioner_name": "colo", "config": {"gpus": 1, "gpu_mem": BUDGET, "socket": spec["metadata"][
            "kernel_provisioner"]["config"]["socket"]}}
    assert spec["argv"][1:] == ["-m", "ipykernel_launcher", "-f", "{connection_file}"]
    assert spec["interrupt_mode"] == "signal" and "256MiB" in spec["display_name"]


def test_kernelspec_install_refuses_bad_input_in_a_line(node, tmp_path):
    for args, words in ((["--gpu-mem", "lots"], "malformed size"), (["--name", "a/b"], "malformed kernelspec name"),
                        (["--python", str(tmp_path / "none")], "no "), (["--gpus", "1"], "--gpu-mem is required")):
        r = node.cli("kernelspec", "install", "--prefix", str(tmp_path / "p"), *args)
        assert r.returncode != 0 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "p").exists()


def test_a_kernel_is_a_colo_job_under_its_budget(node, kernels):
    """Code runs; an allocation past the budget fails in that kernel only; an interrupt stops a
    long sleep with KeyboardInterrupt; a restart is a new job; a shutdown ends the job."""
    from jupyter_client import KernelManager

    neighbour = node.submit("--process", "--gpu-mem", "64MiB", "--name", "neighbour", "--",
                            str(native.native_dir() / native.BURN), "--mem", "32MiB", "--seconds", "300", "--quiet")
    node.wait_state(neighbour, "running")
    km = KernelManager(kernel_name="colo-test")
    km.start_kernel(cwd=str(kernels))
    kc = km.client()
    try:
        kc.start_channels()
        kc.wait_for_ready(timeout=120)
        first = km.provisioner.job_id
        job = node.job(first)
        assert job["state"] == "running" and job["name"] == "kernel" and job["budget"] == 256 << 20
        assert job["spec"]["interactive"] is True and job["spec"]["tty"] is False
        assert job["spec"]["workdir"] == str(kernels)

        reply, out = _run(kc, "import os; print(6 * 7, os.environ['COLO_JOB_ID'])")
        assert reply["status"] == "ok" and out.split() == ["42", str(first)]

        reply, out = _run(kc, ALLOC)
        # 2: out of memory (the interposer says why on the cell's stderr)
        assert reply["status"] == "ok" and "small 0\n" in out and "big 2\n" in out, out
        reply, out = _run(kc, "print('still here')")
        assert out.strip() == "still here"
        assert wait_for(lambda: (node.job(first).get("refused") or 0) >= 1, 30, "the refusal in the kernel's ledger")
        other = node.job(neighbour)
        assert other["state"] == "running" and not other.get("refused")

        msg_id = kc.execute("import time; time.sleep(120)")
        wait_for(lambda: _busy(kc, msg_id), 60, "the kernel to run the cell")
        km.interrupt_kernel()  # SIGINT, through the daemon (op signal) and the job's shim
        reply = kc.get_shell_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"

        km.restart_kernel()
        kc.wait_for_ready(timeout=120)
        second = km.provisioner.job_id
        assert second != first
        assert node.wait_state(first, "succeeded")["exit_code"] == 0  # it was asked to shut down, and did
        reply, out = _run(kc, "print('again', os.environ['COLO_JOB_ID'] if 'os' in dir() else 'fresh')")
        assert out.split() == ["again", "fresh"]  # a new kernel: nothing of the old one's state
        assert node.job(second)["state"] == "running"
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
    ended = node.wait_state(second, "succeeded", "cancelled", "failed")
    assert ended["state"] == "succeeded"  # shut down when asked: its job ended with it
    assert second not in [j["id"] for j in node.client.ls(all=False)]
    node.client.cancel(neighbour)


def _busy(kc, msg_id: str) -> bool:
    """Whether iopub said the kernel is busy with `msg_id` (reading what is there)."""
    while kc.iopub_channel.msg_ready():
        m = kc.get_iopub_msg(timeout=1)
        if (m["msg_type"] == "status" and m["content"]["execution_state"] == "busy"
                and m["parent_header"].get("msg_id") == msg_id):
            return True
    return False


def test_a_kernel_that_cannot_be_placed_fails_to_start_with_colos_words(node, kernels, tmp_path):
    """A kernelspec asking for more than the GPU has: the submit is refused, and Jupyter says why."""
    from jupyter_client import KernelManager

    spec = json.loads((kernels / "kernel.json").read_text())
    spec["metadata"]["kernel_provisioner"]["config"]["gpu_mem"] = "64GiB"
    big = kernels.parent / "colo-big"
    big.mkdir()
    (big / "kernel.json").write_text(json.dumps(spec))
    km = KernelManager(kernel_name="colo-big")
    with pytest.raises(RuntimeError, match="can never run here"):
        km.start_kernel(cwd=str(tmp_path))
    assert not [j for j in node.client.ls(all=False) if j["name"] == "kernel"]
