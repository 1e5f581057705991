"""The interposer against the simulated driver, from a C caller (tests/native_helpers/share_probe.c):
VMM memory shared through exported fds (one process, and two passing the fd with SCM_RIGHTS),
module and library globals by every load path, and array sizes by format family."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from colo.node import interposer
from harness.interpose import JOB_BUDGET as BUDGET

MiB = 1 << 20
HERE = Path(__file__).parent
NATIVE = HERE.parent / "native"


@pytest.fixture(scope="module")
def share_probe(native_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("share") / "share_probe"
    subprocess.run(
        ["cc", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", f"-I{NATIVE}/interpose", f"-I{NATIVE}/fakegpu",
         "-o", str(out), str(HERE / "native_helpers" / "share_probe.c"), str(native_dir / "fakegpu" / "libcuda.so.1")],
        check=True, timeout=120)
    return out


def run(probe, env, *args):
    r = subprocess.run([str(probe), *map(str, args)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return r.stdout.splitlines()


def fields(line):
    """'k1 v1 k2 v2 ...' as a dict of ints."""
    parts = line.split()
    return {parts[i]: int(parts[i + 1]) for i in range(0, len(parts) - 1, 2)}


def test_export_import_release_loop_in_one_process_is_counted_once_and_never_over(share_probe, job):
    env, ledger = job
    got = fields(run(share_probe, env, "same", 1000)[0])
    # every round fits (the import is the same memory, counted once), the device never held more
    # than the budget, nor more than the ledger counted, and everything came back
    assert got == {"rounds": 1000, "refused": 0, "over": 0, "uncounted": 0, "ledger": 0, "device": 0}
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 0 and led.refused == 0 and led.peak[0] == BUDGET // 2


def test_an_import_kept_after_the_original_is_released_stays_counted(share_probe, job):
    env, ledger = job
    # the attack: release the original, keep the import, again: two halves fit, no more
    got = fields(run(share_probe, env, "keep", 4)[0])
    assert got == {"rounds": 2, "refused": 2, "over": 0, "uncounted": 0, "ledger": BUDGET, "device": BUDGET}
    assert interposer.read_ledger(ledger).refused == 2


def test_memory_imported_by_another_process_of_the_job_is_counted_while_it_holds_it(share_probe, job):
    env, ledger = job
    got = fields(run(share_probe, env, "cross", 1000)[0])
    assert got == {"rounds": 1000, "refused": 0, "peer_refused": 0, "over": 0, "uncounted": 0, "peer_exit": 0}
    assert interposer.read_ledger(ledger).used[0] == 0
    # the peer keeps every import mapped: the creator's next half fits, the peer's import of it
    # does not, and the device never holds more than the budget
    got = fields(run(share_probe, env, "crosskeep", 3)[0])
    assert got["over"] == 0 and got["uncounted"] == 0 and got["peer_exit"] == 0
    assert got["peer_refused"] >= 1


def write_module(tmp_path, globals_):
    path = tmp_path / "mod.fakecubin"
    path.write_text(f"FAKEGPU-MODULE globals={globals_}\n")
    return path


def test_module_and_library_globals_are_counted_by_every_load_path(share_probe, job, tmp_path):
    env, ledger = job
    lines = run(share_probe, env, "module", write_module(tmp_path, 48 * MiB), 48 * MiB)
    # name, code, ledger count while loaded, device bytes while loaded, left after unload
    got = {line.split()[0]: list(map(int, line.split()[1:])) for line in lines}
    for name in ("load", "data", "dataex", "fatbin", "libdata", "libfile"):
        assert got[name] == [0, 48 * MiB, 48 * MiB, 0], (name, got)
    assert interposer.read_ledger(ledger).used[0] == 0


def test_a_module_load_past_the_budget_is_refused_and_unloaded(share_probe, job, tmp_path):
    env, ledger = job
    lines = run(share_probe, env, "module", write_module(tmp_path, BUDGET + MiB), BUDGET + MiB)
    for line in lines:
        name, rc, counted, held, left = line.split()
        assert (int(rc), int(counted), int(held), int(left)) == (2, 0, 0, 0), line
    led = interposer.read_ledger(ledger)
    assert led.used[0] == 0 and led.refused == 6


# format (hex), width, height -> bytes (NumChannels 4, which only the plain formats multiply by)
FORMATS = {
    "float": ("20", 1024, 1024, 1024 * 1024 * 4 * 4),
    "half": ("10", 1024, 1024, 1024 * 1024 * 2 * 4),
    "int8": ("08", 1024, 1024, 1024 * 1024 * 4),
    "unorm8x4": ("c2", 1024, 1024, 1024 * 1024 * 4),
    "snorm16x2": ("ca", 1024, 1024, 1024 * 1024 * 4),
    "bc1": ("91", 8192, 8192, 8192 * 8192 // 2),          # 8 bytes a 4x4 block: 32 MiB, not 2 GiB
    "bc4": ("98", 1000, 1002, 250 * 251 * 8),             # partial blocks round up
    "bc7": ("9e", 4096, 2048, 4096 * 2048),               # 16 bytes a block
    "bc6h": ("9b", 2048, 2048, 2048 * 2048),
    "nv12": ("b0", 1920, 1080, 1920 * 1080 * 3 // 2),     # 4:2:0, 8 bits
    "p016": ("a1", 1920, 1080, 1920 * 1080 * 3),          # 4:2:0, 16 bits
    "yuy2": ("a5", 1920, 1080, 1920 * 1080 * 2),          # 4:2:2 packed
    "y444_planar10": ("b3", 1920, 1080, 1920 * 1080 * 6),
    "ayuv": ("a8", 1920, 1080, 1920 * 1080 * 4),
    "y416": ("b1", 1024, 1024, 1024 * 1024 * 8),
}


@pytest.mark.parametrize("family", FORMATS)
def test_array_formats_are_counted_at_their_real_size(share_probe, job, family):
    env, _ = job
    fmt, w, h, size = FORMATS[family]
    rc, counted, held = map(int, run(share_probe, env, "array", fmt, w, h)[0].split()[1:])
    assert (rc, counted, held) == (0, size, size)


@pytest.fixture(scope="module")
def early_program(native_dir, tmp_path_factory):
    """A program whose linked library (DT_NEEDED) allocates and caches the driver's functions in
    its own constructor (tests/native_helpers/early_lib.c, early_main.c)."""
    out = tmp_path_factory.mktemp("early")
    cuda = str(native_dir / "fakegpu" / "libcuda.so.1")
    cc = ["cc", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", f"-I{NATIVE}/interpose"]
    subprocess.run([*cc, "-shared", "-fPIC", "-o", str(out / "libearly.so"), str(HERE / "native_helpers" / "early_lib.c"),
                    cuda, "-ldl", "-lpthread"], check=True, timeout=120)
    subprocess.run([*cc, "-o", str(out / "early_main"), str(HERE / "native_helpers" / "early_main.c"),
                    f"-L{out}", "-learly", f"-Wl,-rpath,{out}", cuda], check=True, timeout=120)
    return out / "early_main"


@pytest.mark.parametrize("threads", [None, 1, 8])
def test_a_library_using_the_driver_before_our_constructor_is_held_to_the_budget(early_program, job, threads):
    env, ledger = job
    env = {**env, "EARLY_BYTES": str(BUDGET // 2), "LATE_BYTES": str(BUDGET // 2 + MiB)}
    if threads:  # on other threads, started together: they race into the interposer's set-up
        env["EARLY_THREADS"] = str(threads)
    r = subprocess.run([str(early_program)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr)
    # the constructor's allocations counted; the pointers it cached are ours: both refused
    assert fields(r.stdout) == {"early": 0, "dlsym": 2, "gpa": 2, "free": BUDGET // 2}
    assert interposer.read_ledger(ledger).refused == 2


def test_frees_on_a_stream_are_reclaimed_when_an_event_after_them_is_reached(share_probe, job):
    env, ledger = job
    # randomised sizes; the event recorded after the free (or before it: then it says nothing of
    # it), synchronised or queried; then an allocation that fits only once the free is done
    got = fields(run(share_probe, env, "events", 1000)[0])
    assert got == {"rounds": 1000, "refused_fitting": 0, "over": 0, "uncounted": 0, "ledger": 0}
    assert interposer.read_ledger(ledger).refused == 0


def test_at_the_edge_frees_on_a_stream_that_finished_are_reclaimed(share_probe, job):
    env, _ = job
    got = fields(run(share_probe, {**env, "COLO_FAKEGPU_STREAMS_RUN": "1"}, "edge")[0])
    assert got == {"edge": 0, "refused_fitting": 0, "uncounted": 0}


def test_a_module_is_given_back_with_its_context(share_probe, job):
    env, _ = job
    got = fields(run(share_probe, env, "modctx", 40 * MiB)[0])
    assert got == {"loaded": 40 * MiB, "ledger": 0, "device": 0}
