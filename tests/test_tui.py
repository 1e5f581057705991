"""`colo top` against a real daemon on simulated GPUs: Pilot tests of the keys, SVG snapshots of
fixed scenes, and the plain `--once` frame.

Jobs are held running by a gate file and burn simulated GPU memory and SM time through the real
interposer (colo-burn), so budgets, use, MPS and foreign processes are real values the daemon
reports. The snapshots pin what changes from run to run (times, pids, user names, paths) in
`StableClient`, a real client whose answers are normalised before the app sees them.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colo.node import native
from colo.client import Client, ClientError
from colo.tui import model
from colo.tui.app import ColoTop, make_app
from colo.tui.screens import ConfirmScreen, DetailScreen, HelpScreen
from colo.tui.widgets import GpuCard, GpuPanel, KeyedTable
from harness.daemon import DaemonProc, wait_for

GiB = 1024**3
FIXED = 1_750_000_000.0  # the clock of every snapshot


@pytest.fixture(autouse=True)
def utc():
    """Clock texts in the snapshots must not depend on the machine's time zone."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if old is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = old
    time.tzset()


def burn_job(gate: Path, mem: str, duty: int) -> list[str]:
    """A job that holds `mem` of simulated GPU memory at `duty` % SM until the gate file appears."""
    burn = native.path("colo-burn")
    return ["--", "sh", "-c", f"{burn} --mem {mem} --duty {duty} --seconds 3600 --quiet & b=$!; echo started; "
            f"while [ ! -e {gate} ]; do sleep 0.05; done; kill $b; wait $b; echo done"]


def gate_job(gate: Path) -> list[str]:
    return ["--", "sh", "-c", f"echo started; while [ ! -e {gate} ]; do sleep 0.05; done"]


class Scene:
    """A daemon with jobs in known states: three running (two sharing GPU 0), one waiting for
    memory, one succeeded, one failed, and a foreign process on GPU 1."""

    def __init__(self, d: DaemonProc, fake_env: dict, gate: Path):
        self.d, self.gate = d, gate
        self.train = d.submit("--process", "--gpu-mem", "6GiB", "--name", "train", *burn_job(gate, "3GiB", 40))
        d.wait_state(self.train, "running")
        self.infer = d.submit("--process", "--gpu-mem", "4GiB", "--name", "infer", *burn_job(gate, "1GiB", 25))
        d.wait_state(self.infer, "running")
        self.big = d.submit("--process", "--gpu-mem", "12GiB", "--name", "big", *burn_job(gate, "8GiB", 70))
        d.wait_state(self.big, "running")
        self.waiter = d.submit("--process", "--gpu-mem", "14GiB", "--name", "waiter", *gate_job(gate))
        self.prep = d.submit("--process", "--gpus", "0", "--name", "prep", "--", "sh", "-c", "echo prepared")
        d.wait_state(self.prep, "succeeded")
        self.broken = d.submit("--process", "--gpus", "0", "--name", "broken", "--", "sh", "-c", "echo oops; exit 3")
        d.wait_state(self.broken, "failed")
        self.foreign = subprocess.Popen([native.path("colo-burn"), "--device", "1", "--mem", "1GiB", "--duty", "10",
                                         "--seconds", "3600", "--quiet"], env=fake_env)
        # settled: every burn holds its memory, the waiter has a reason, the foreign process shows
        wait_for(self._settled, 30, "the scene to settle")

    def _settled(self) -> bool:
        top = self.d.client.top()
        jobs = {j["id"]: j for j in top["jobs"]}
        used = all(jobs[j].get("used") == m for j, m in ((self.train, 3 * GiB), (self.infer, GiB), (self.big, 8 * GiB)))
        utils = all(g["sm_util"] for g in top["gpus"]) and all(jobs[j].get("sm_util") for j in (self.train, self.infer, self.big))
        return (used and utils and jobs[self.waiter]["state"] == "queued" and bool(jobs[self.waiter]["reason"])
                and any(f["pid"] == self.foreign.pid for f in top["foreign"]))

    def close(self) -> None:
        self.gate.touch()
        self.foreign.terminate()
        self.foreign.wait(30)
        for j in (self.train, self.infer, self.big, self.waiter):
            self.d.wait_state(j, "succeeded", "failed", "cancelled")


class StableClient(Client):
    """The real client, with the values that differ between runs pinned for snapshots: times
    (relative to FIXED), pids, user names, and paths (`subs`: volatile text -> stable text)."""

    def __init__(self, socket_path, subs: dict[str, str]):
        super().__init__(socket_path, timeout=30)
        self.subs = {str(socket_path): "/run/colo/colo.sock", **subs}

    def _pin(self, v):
        if isinstance(v, str):
            for old, new in self.subs.items():
                v = v.replace(old, new)
            return v
        if isinstance(v, list):
            return [self._pin(x) for x in v]
        if isinstance(v, dict):
            return {k: self._pin(x) for k, x in v.items()}
        return v

    def call(self, op: str, **args):
        try:
            return self._pin(super().call(op, **args))
        except ClientError as e:
            raise type(e)(self._pin(str(e)), e.code) from None

    def top(self) -> dict:
        snap = super().top()
        me = snap["you"]
        snap["at"] = FIXED
        snap["you"] = "alice"
        for j in snap["jobs"]:
            base = FIXED - 900 + 10 * j["id"]
            j["submitted_at"] = base
            if j.get("started_at"):
                j["started_at"] = base + 5
            if j.get("ended_at"):
                j["ended_at"] = base + 65
            if j["user"] == me:
                j["user"] = "alice"
        for i, f in enumerate(sorted(snap["foreign"], key=lambda f: f["pid"])):
            f["pid"] = 4200 + i
            f["user"] = "carol"
        for g in snap["gpus"]:
            for i, p in enumerate(g["processes"]):
                p["pid"] = 5000 + i
        return snap


async def settle(pilot, app: ColoTop, polls: int = 1, timeout: float = 20) -> None:
    await until(pilot, lambda: app.polls >= polls, timeout, f"{polls} poll(s)")


async def until(pilot, cond, timeout: float = 20, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)
    await pilot.pause()


def table(app: ColoTop, which: str = "#jobs") -> KeyedTable:
    return app.query_one(which, KeyedTable)


def keys_in_order(t: KeyedTable) -> list[str]:
    return t.keys()


# the scene is built once for the tests that only look ----------------------------------------------

@pytest.fixture(scope="module")
def busy(tmp_path_factory, native_dir):
    from colo.node import fakegpu as fg

    root = tmp_path_factory.mktemp("busy")
    state = root / "fakegpu.state"
    fg.create(state, count=2, mem=16 * GiB, uuids=[f"GPU-00000000-0000-0000-0000-00000000000{i}" for i in range(2)])
    d = DaemonProc(root, state).start()
    scene = None
    try:
        scene = Scene(d, fg.FakeNode(state).env, root / "go")
        yield scene
    finally:
        if scene is not None:
            scene.close()
        else:
            (root / "go").touch()
        d.stop()


def stable_client(d: DaemonProc) -> StableClient:
    return StableClient(d.socket, {str(d.root): "/tmp/scene", str(native.native_dir()): "/opt/colo"})


def busy_app(scene: Scene, **kw) -> ColoTop:
    return make_app(stable_client(scene.d), clock=lambda: FIXED, refresh=3600, **kw)


# snapshots ------------------------------------------------------------------------------------

def test_snapshot_busy_80x24(busy, snap_compare):
    assert snap_compare(busy_app(busy), terminal_size=(80, 24), run_before=lambda p: settle(p, p.app))


def test_snapshot_busy_large(busy, snap_compare):
    assert snap_compare(busy_app(busy), terminal_size=(160, 44), run_before=lambda p: settle(p, p.app))


def test_snapshot_gpu_view(busy, snap_compare):
    async def before(pilot):
        await settle(pilot, pilot.app)
        await pilot.press("g")

    assert snap_compare(busy_app(busy), terminal_size=(100, 30), run_before=before)


def test_snapshot_detail(busy, snap_compare):
    async def before(pilot):
        app = pilot.app
        await settle(pilot, app)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, DetailScreen) and not app.screen.workers, what="details")

    assert snap_compare(busy_app(busy), terminal_size=(100, 30), run_before=before)


def test_snapshot_help(busy, snap_compare):
    async def before(pilot):
        await settle(pilot, pilot.app)
        await pilot.press("question_mark")

    assert snap_compare(busy_app(busy), terminal_size=(90, 30), run_before=before)


# keys -----------------------------------------------------------------------------------------

def run(coro):
    return asyncio.run(coro)


def test_table_shows_jobs_gpus_foreign_and_queue(busy):
    async def go():
        app = busy_app(busy)
        async with app.run_test(size=(120, 40)) as pilot:
            await settle(pilot, app)
            jobs = table(app)
            rows = jobs.rows_by_key
            assert {f"j{busy.train}", f"j{busy.infer}", f"j{busy.big}", f"j{busy.prep}", f"j{busy.broken}"} <= set(rows)
            assert f"j{busy.waiter}" not in rows  # waiting jobs are in the queue table
            train = dict(zip([c for c, _ in model.JOB_COLUMNS], [c for c, _ in rows[f"j{busy.train}"].cells]))
            assert (train["name"], train["budget"], train["used"], train["state"]) == ("train", "6.0GiB", "3.0GiB",
                                                                                       "running")
            foreign = [r for r in rows.values() if r.job is None]
            assert len(foreign) == 1 and foreign[0].cells[-1][0] == "foreign" and foreign[0].cells[3][0] == "1"
            queue = table(app, "#queue").rows_by_key[f"j{busy.waiter}"]
            assert queue.cells[0][0] == "1" and "memory" in queue.cells[-1][0]
            panel = app.query_one(GpuPanel)
            assert len(panel.rows) == 2
            # running jobs first (by id), then foreign processes, then ended jobs, newest first
            assert keys_in_order(jobs)[:3] == [f"j{busy.train}", f"j{busy.infer}", f"j{busy.big}"]
            assert keys_in_order(jobs)[-1] == f"j{busy.prep}"

    run(go())


def test_keys_move_sort_and_gpu_view(busy):
    async def go():
        app = busy_app(busy)
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot, app)
            jobs = table(app)
            assert jobs.current().key == f"j{busy.train}"
            await pilot.press("j", "j")
            assert jobs.current().key == f"j{busy.big}"
            await pilot.press("k", "up")
            assert jobs.current().key == f"j{busy.train}"
            await pilot.press("down")
            await pilot.press("s")  # sort by id: the cursor stays on the same job
            assert app.query_one("#jobs").border_subtitle == "sort: id"
            order = keys_in_order(jobs)
            ids = [int(k[1:]) for k in order if k.startswith("j")]
            assert ids == sorted(ids) and jobs.current().key == f"j{busy.infer}"
            for _ in range(len(model.SORTS) - 1):
                await pilot.press("s")
            assert app.query_one("#jobs").border_subtitle == "sort: default"
            uuids = [g["uuid"] for g in app.snap["gpus"]]
            await pilot.press("g")  # GPU 0 alone: its card, its jobs
            assert app.gpu_selected == uuids[0] and app.query(GpuCard)
            assert all(uuids[0] in (r.job or {}).get("gpus", []) for r in jobs.rows_by_key.values())
            assert "on GPU 0" in str(app.query_one("#jobs").border_title)
            await pilot.press("g", "g")  # GPU 1, then all again
            assert app.gpu_selected is None and not app.query(GpuCard)
            assert len(app.query_one(GpuPanel).rows) == 2
            await pilot.click("GpuRow")  # mouse: a GPU line opens its view
            assert app.gpu_selected == uuids[0]
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            await pilot.press("q")
        assert app.return_code == 0

    run(go())


def test_filter_narrows_both_tables_and_escape_clears(busy):
    async def go():
        app = busy_app(busy)
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot, app)
            before = table(app).row_count
            await pilot.press("slash", *"train")
            assert set(table(app).rows_by_key) == {f"j{busy.train}"} and table(app, "#queue").row_count == 0
            await pilot.press("enter")  # keeps the filter, back to the table
            assert app.filter_text == "train" and isinstance(app.focused, KeyedTable)
            await pilot.press("slash", *["backspace"] * len("train"), *"waiter")
            assert table(app).row_count == 0 and set(table(app, "#queue").rows_by_key) == {f"j{busy.waiter}"}
            await pilot.press("escape")
            assert app.filter_text == "" and table(app).row_count == before

    run(go())


def test_enter_shows_explain_and_last_log_lines(busy):
    async def go():
        app = busy_app(busy)
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot, app)
            await pilot.press("tab")  # the queue
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, DetailScreen) and not app.screen.workers, what="details")
            why = str(app.screen.query_one("#detail-explain").render())
            assert "memory" in why, why
            assert busy.d.client.explain(busy.waiter)["decision"]["reason"] in why
            await pilot.press("escape")
            await pilot.press("shift+tab")
            jobs = table(app)
            jobs.move_cursor(row=jobs.get_row_index(f"j{busy.broken}"))
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, DetailScreen) and not app.screen.workers, what="details")
            log = str(app.screen.query_one("#detail-log").render())
            summary = str(app.screen.query_one("#detail-summary").render())
            assert "oops" in log and "exit code 3" in summary
            await pilot.press("l")  # from the details to the log screen
            await until(pilot, lambda: "oops" in str(app.screen.query_one("#log-text").render()), what="log screen")

    run(go())


# changes: cancel, daemon gone ------------------------------------------------------------------

def test_cancel_asks_first_then_cancels(daemon, tmp_path):
    gate = tmp_path / "go"
    j = daemon.submit("--process", "--gpu-mem", "1GiB", "--name", "victim", *gate_job(gate))
    daemon.wait_state(j, "running")

    async def go():
        app = make_app(daemon.client, refresh=0.1)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: f"j{j}" in table(app).rows_by_key, what="the job row")
            await pilot.press("c")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("n")  # keep it
            assert not isinstance(app.screen, ConfirmScreen)
            assert daemon.job(j)["state"] == "running"
            await pilot.press("c")
            await pilot.click("#yes")  # mouse on the dialog's button
            await until(pilot, lambda: table(app).rows_by_key[f"j{j}"].cells[-1][0] == "cancelled", what="cancelled")
            await pilot.press("c")  # an ended job is not offered for cancelling again
            assert not isinstance(app.screen, ConfirmScreen)
        assert daemon.job(j)["state"] == "cancelled"

    try:
        run(go())
    finally:
        gate.touch()


def test_daemon_gone_is_a_banner_then_reconnects(daemon, tmp_path):
    gate = tmp_path / "go"
    j = daemon.submit("--process", "--gpu-mem", "1GiB", "--name", "survivor", *gate_job(gate))
    daemon.wait_state(j, "running")

    async def go():
        app = make_app(daemon.client, refresh=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            banner = app.query_one("#banner")
            await until(pilot, lambda: f"j{j}" in table(app).rows_by_key, what="the job row")
            assert not banner.has_class("-error")
            daemon.kill9()  # the daemon crashes; its jobs run on
            await until(pilot, lambda: banner.has_class("-error"), what="the banner")
            assert "daemon" in str(banner.render()) and app.screen.has_class("-stale")
            assert f"j{j}" in table(app).rows_by_key  # last data stays on screen
            daemon.start()  # the job is found again; so is the daemon, by the app
            await until(pilot, lambda: not banner.has_class("-error"), what="reconnection")
            assert not app.screen.has_class("-stale")
            assert table(app).rows_by_key[f"j{j}"].cells[-1][0] == "running"

    try:
        run(go())
    finally:
        gate.touch()
        daemon.wait_state(j, "succeeded")


def test_snapshot_daemon_gone(daemon, tmp_path, snap_compare):
    gate = tmp_path / "go"
    j = daemon.submit("--process", "--gpu-mem", "2GiB", "--name", "survivor", *gate_job(gate))
    daemon.wait_state(j, "running")
    # its SM% is sampled (0), not yet unknown (-): the snapshot must not depend on the sampler's timing
    wait_for(lambda: any(x["id"] == j and x.get("sm_util") is not None for x in daemon.client.top()["jobs"]),
             30, "the job's first sample")

    async def before(pilot):
        app = pilot.app
        await settle(pilot, app)
        gate.touch()
        daemon.wait_state(j, "succeeded")
        daemon.stop()
        app.poll()
        await settle(pilot, app, 2)

    try:
        app = make_app(stable_client(daemon), clock=lambda: FIXED, refresh=3600)
        assert snap_compare(app, terminal_size=(80, 24), run_before=before)
    finally:
        gate.touch()


# the plain frame --------------------------------------------------------------------------------

def test_once_prints_one_plain_frame(busy):
    r = busy.d.cli("top", "--once", check=True)
    out = r.stdout
    assert "\x1b[" not in out  # plain text
    lines = out.splitlines()
    assert lines[0].startswith("colo top") and "3 running" in lines[0] and "1 queued" in lines[0]
    assert sum(1 for ln in lines if "Colo Simulated" in ln and "MPS" in ln) == 2
    assert any(ln.split()[:2] == [str(busy.train), "train"] and "6.0GiB" in ln and "3.0GiB" in ln for ln in lines)
    assert any("foreign" in ln and "colo-burn" in ln for ln in lines)
    q = lines.index(next(ln for ln in lines if ln.startswith("QUEUE")))
    assert "1 waiting" in lines[q] and str(busy.waiter) in lines[q + 2] and "memory" in lines[q + 2]


def test_once_without_daemon_is_one_line_and_exit_1(tmp_path):
    d = DaemonProc(tmp_path)  # never started
    r = d.cli("top", "--once")
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "not running" in r.stderr


def test_many_gpus_and_jobs_fit_small_and_large_terminals(tmp_path, native_dir):
    """8 GPUs, 200 jobs: 8 run, 192 wait; 80x24 and 200x60 both draw without error."""
    from colo.node import fakegpu as fg

    state = tmp_path / "fakegpu.state"
    fg.create(state, count=8, mem=16 * GiB)
    d = DaemonProc(tmp_path, state).start()
    gate = tmp_path / "go"
    try:
        spec = {"argv": gate_job(gate)[1:], "gpu_mem": 16 * GiB, "gpus": 1, "workdir": str(tmp_path)}
        ids = [d.client.submit({**spec, "name": f"job-{i}"})["id"] for i in range(200)]
        wait_for(lambda: model.counts(d.client.top()).get("queued") == 192, 60, "8 jobs placed, 192 waiting")
        assert ids[8] == ids[0] + 8

        async def go(size):
            app = make_app(d.client, refresh=3600)
            async with app.run_test(size=size) as pilot:
                await settle(pilot, app)
                assert table(app).row_count == 8 and table(app, "#queue").row_count == 192
                assert len(app.query_one(GpuPanel).rows) == 8
                assert [r.cells[1][0] for r in table(app, "#queue").rows_by_key.values()][:2] == ["9", "10"]
                await pilot.press("tab", "ctrl+end")  # the end of the queue
                assert table(app, "#queue").current().cells[0][0] == "192"

        run(go((80, 24)))
        run(go((200, 60)))
        out = d.cli("top", "--once", check=True).stdout
        assert out.count("\n") > 200
    finally:
        gate.touch()
        d.stop()


def test_zero_gpus_are_shown_not_fatal(tmp_path):
    """A daemon without any GPU (no driver): the view says so and still lists CPU jobs."""
    d = DaemonProc(tmp_path).start()
    try:
        j = d.submit("--process", "--gpus", "0", "--name", "cpu-only", "--", "true")
        d.wait_state(j, "succeeded")

        async def go():
            app = make_app(d.client, refresh=3600)
            async with app.run_test(size=(80, 24)) as pilot:
                await settle(pilot, app)
                assert not app.query_one(GpuPanel).rows
                assert "no GPUs" in str(app.query_one("#gpus .empty").render())
                assert f"j{j}" in table(app).rows_by_key
                await pilot.press("g")  # nothing to select; a notification, not an error
                assert app.gpu_selected is None

        run(go())
        out = d.cli("top", "--once", check=True).stdout
        assert "no GPUs" in out and "cpu-only" in out
    finally:
        d.stop()


def test_tui_reaches_colo_only_through_the_client():
    """Like nvitop's TUI, the view never imports NVML, the store or the daemon."""
    code = ("import sys, colo.tui.app; "
            "print([m for m in ('pynvml', 'colo.node.gpu', 'colo.store', 'colo.daemon') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_snapshot_another_users_escapes_are_shown_escaped(fakegpu, other_user, snap_compare):
    """Issue 11 item 4: a command holding ESC[2J and a newline, run by another real user, is drawn
    as escaped text in the table and the detail screen: no cleared screen, no forged row."""
    import shutil
    import tempfile

    from colo.textsafe import safe
    from harness.daemon import as_user

    root = Path(tempfile.mkdtemp(prefix="colo-tui-safe-"))
    os.chmod(root, 0o755)
    d = DaemonProc(root, fakegpu.state).start()
    os.chmod(d.socket.parent, 0o755)
    gate = root / "go"
    evil = "evil\x1b[2J\x1b[H\n99 root forged\r"
    prog = root / "bin" / evil  # a link to sh: the job's argv[0] is what a user chose
    prog.parent.mkdir(mode=0o755)
    prog.symlink_to("/bin/sh")
    spec = {"argv": [str(prog), "-c", f"echo 'out\x1b[2J'; while [ ! -e {gate} ]; do sleep 0.05; done"],
            "gpus": 0, "workdir": "/tmp"}
    kind, j = as_user(other_user, lambda: Client(d.socket).submit(spec)["id"])
    assert kind == "ok", j
    try:
        d.wait_state(j, "running")

        async def before(pilot):
            app = pilot.app
            await settle(pilot, app)
            row = table(app).rows_by_key[f"j{j}"]
            assert all("\x1b" not in c and "\n" not in c for c, _ in row.cells)
            assert row.job["argv"][0] == safe(str(prog)).replace(str(root), "/tmp/scene")
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, DetailScreen) and not app.screen.workers,
                        what="details")

        assert snap_compare(make_app(stable_client(d), clock=lambda: FIXED, refresh=3600),
                            terminal_size=(100, 30), run_before=before)
    finally:
        gate.touch()
        d.wait_state(j, "succeeded", "failed", "cancelled")
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
