"""Issue 42: what colo reads as a GPU failing, from the simulated driver as from NVML: critical Xid
events through an event set (a program's own Xids, such as 13 or 43, do not count), uncorrectable
ECC errors with their page retirement pending, and a GPU fallen off the bus. colo/node/gpu.py reads
them in a child process (NVML is one session per process), one reading per line asked for."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

READER = """
import json, sys
from pathlib import Path
from colo.node.gpu import Nvml
nvml = Nvml(Path(sys.argv[1]))
for _ in sys.stdin:
    print(json.dumps({d.index: [d.error, d.fault] for d in nvml.devices()}), flush=True)
"""


@pytest.fixture
def read(fakegpu):
    child = subprocess.Popen([sys.executable, "-c", READER, str(fakegpu.state)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)

    def reading() -> dict[int, list]:
        child.stdin.write("\n")
        child.stdin.flush()
        return {int(k): v for k, v in json.loads(child.stdout.readline()).items()}
    yield reading
    child.stdin.close()
    child.wait(60)


def test_xid_ecc_and_lost_as_colo_reads_them(fakegpu, read):
    assert read() == {0: [None, None], 1: [None, None]}
    fakegpu.xid(0, 13)  # a program's illegal address: the GPU is fine
    fakegpu.xid(1, 43)
    assert read() == {0: [None, None], 1: [None, None]}
    fakegpu.xid(0, 79)
    assert read() == {0: [None, "Xid 79"], 1: [None, None]}
    fakegpu.xid(0, 48)
    fakegpu.ecc(1, 2)
    assert read() == {0: [None, "Xid 48 (2 critical Xid events)"],
                      1: [None, "2 uncorrectable ECC errors, page retirement pending (reset the GPU)"]}
    fakegpu.fail_nvml(1, "lost")
    assert read()[1][0] == "NVML error: GPU is lost"


def test_an_xid_before_colo_looked_is_not_delivered(fakegpu, read):
    """As NVML's: an event set gets the events raised after the device was registered."""
    fakegpu.xid(0, 79)
    assert read()[0] == [None, None]
    fakegpu.xid(0, 62)
    assert read()[0] == [None, "Xid 62"]


def test_the_fault_commands_refuse_what_they_cannot_do(fakegpu):
    from colo.node.fakegpu import FakeGpuError
    for bad in ((5, 79), (0, 0)):
        with pytest.raises(FakeGpuError):
            fakegpu.xid(*bad)
