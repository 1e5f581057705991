"""`colo top`: the live view. Data comes only from `colo.client.Client.top()`.

One poll at a time: a thread worker fetches the snapshot (blocking socket I/O stays off the UI
thread), the UI is updated when it succeeds or fails, and only then is the next poll armed. A
daemon that goes away turns into a banner and the polls go on until it answers again.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.widgets import Footer, Input, Static
from textual.worker import Worker, WorkerState

from ..client import Client, ClientError
from ..textsafe import safe, safe_tree
from . import model
from .render import header
from .screens import ConfirmScreen, DetailScreen, HelpScreen, LogScreen
from .widgets import GpuPanel, GpuRow, History, KeyedTable, Line


class ColoTop(App):
    CSS_PATH = "top.tcss"
    TITLE = "colo top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("slash", "filter", "Filter"),
        Binding("s", "sort", "Sort"),
        Binding("g", "gpu_view", "GPU view"),
        Binding("l", "logs", "Logs"),
        Binding("c", "cancel", "Cancel"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    def __init__(self, client: Client, clock: Callable[[], float] | None = None, refresh: float = 1.0):
        super().__init__()
        self.client = client
        self.clock = clock or time.time
        self.refresh_interval = refresh
        self.snap: dict | None = None
        self.error: str | None = None
        self.last_ok: float | None = None
        self.history: dict[str, History] = {}
        self.filter_text = ""
        self.sort_index = 0
        self.gpu_selected: str | None = None
        self.polls = 0  # completed polls, ok or not (tests wait on it)

    # layout ------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Line("colo top · connecting…", id="status")
        yield Static("", id="banner")
        yield GpuPanel(id="gpus")
        yield KeyedTable(model.JOB_COLUMNS, id="jobs")
        yield KeyedTable(model.QUEUE_COLUMNS, id="queue")
        yield Input(placeholder="filter: id, name, user, state, GPU …  (enter keeps, esc clears)", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#gpus").border_title = "GPUs"
        self._titles()
        self.query_one("#jobs").focus()
        self.poll()

    # polling -----------------------------------------------------------------------------------
    def poll(self) -> None:
        self.run_worker(self.client.top, name="poll", group="poll", thread=True, exit_on_error=False)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        w = event.worker
        if w.group != "poll" or w.state not in (WorkerState.SUCCESS, WorkerState.ERROR):
            return
        try:
            if w.state == WorkerState.SUCCESS:
                self.error = None
                self.last_ok = self.clock()
                self.apply(safe_tree(w.result))  # everything shown is drawn from this: other users' text made safe
            else:
                e = w.error
                self.error = safe(str(e) if isinstance(e, ClientError) else f"{type(e).__name__}: {e}")
                self._banner()
        except NoMatches:  # a poll that ended as the app closes: its widgets are gone already
            return
        self.polls += 1
        self.set_timer(self.refresh_interval, self.poll)

    def apply(self, snap: dict) -> None:
        self.snap = snap
        uuids = [g["uuid"] for g in snap.get("gpus", [])]
        for g in snap.get("gpus", []):
            self.history.setdefault(g["uuid"], History()).add(g)
        for u in [u for u in self.history if u not in uuids]:
            del self.history[u]
        if self.gpu_selected not in uuids:
            self.gpu_selected = None
        self._banner()
        self.query_one(GpuPanel).sync(snap, self.history, self.gpu_selected)
        self.refresh_tables()

    def refresh_tables(self) -> None:
        if self.snap is None:
            return
        now = self.clock()
        rows = [r for r in model.job_rows(self.snap, now, self.gpu_selected) if r.matches(self.filter_text)]
        self.query_one("#jobs", KeyedTable).sync(rows, model.SORTS[self.sort_index])
        q = [r for r in model.queue_rows(self.snap, now) if r.matches(self.filter_text)]
        self.query_one("#queue", KeyedTable).sync(q)
        self._titles(len(rows), len(q))
        self.query_one("#status", Line).set(Text(header(self.snap, now), no_wrap=True, overflow="ellipsis"))

    def _titles(self, njobs: int = 0, nqueue: int = 0) -> None:
        jobs, queue = self.query_one("#jobs"), self.query_one("#queue")
        sel = ""
        if self.gpu_selected and self.snap:
            sel = f" on GPU {model.gpu_indexes(self.snap).get(self.gpu_selected)}"
        filt = f" matching '{self.filter_text}'" if self.filter_text else ""
        titles = ((jobs, "border_title", f"jobs{sel}: {njobs}{filt}"),
                  (jobs, "border_subtitle", f"sort: {model.SORTS[self.sort_index]}"),
                  (queue, "border_title", f"queue: {nqueue} waiting{filt}"))
        for widget, attr, text in titles:
            if getattr(widget, attr) != text:  # setting it repaints, even when equal
                setattr(widget, attr, text)

    def _banner(self) -> None:
        banner = self.query_one("#banner", Static)
        if self.error:
            since = f" · showing data from {time.strftime('%H:%M:%S', time.localtime(self.last_ok))}" \
                if self.last_ok else ""
            banner.update(Text(f"daemon unreachable: {self.error} · retrying{since}"))
            banner.set_class(True, "-error")
        elif self.snap and self.snap.get("gpu_error"):
            banner.update(Text(f"GPUs unavailable: {self.snap['gpu_error']}"))
            banner.set_class(True, "-warning")
            banner.set_class(False, "-error")
        else:
            banner.set_class(False, "-error", "-warning")
        self.screen.set_class(bool(self.error), "-stale")

    # selection ---------------------------------------------------------------------------------
    def selected(self) -> model.Row | None:
        table = self.focused if isinstance(self.focused, KeyedTable) else self.query_one("#jobs", KeyedTable)
        return table.current()

    def on_keyed_table_selected(self, event: KeyedTable.Selected) -> None:
        self.open_details(event.row)

    def on_keyed_table_header_clicked(self, event: KeyedTable.HeaderClicked) -> None:
        if event.table.id == "jobs" and event.column in model.SORTS:
            self.sort_index = model.SORTS.index(event.column)
            self.refresh_tables()

    def open_details(self, row: model.Row | None) -> None:
        if row is None:
            return
        if row.job is None:
            self.notify(f"{row.cells[0][0]} is not a colo job: {row.cells[1][0]} ({row.cells[2][0]})",
                        title="foreign process", markup=False)  # a command line is anyone's text
            return
        label = model.gpu_label(row.job.get("gpus") or [], model.gpu_indexes(self.snap or {}))
        self.push_screen(DetailScreen(row.job, label, self.clock()))

    def on_gpu_row_clicked(self, event: GpuRow.Clicked) -> None:
        self.gpu_selected = event.uuid
        self._gpu_changed()

    # actions -----------------------------------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_sort(self) -> None:
        self.sort_index = (self.sort_index + 1) % len(model.SORTS)
        self.refresh_tables()

    def action_gpu_view(self) -> None:
        uuids = [g["uuid"] for g in (self.snap or {}).get("gpus", [])]
        if not uuids:
            self.notify("no GPUs to show", severity="warning")
            return
        i = uuids.index(self.gpu_selected) + 1 if self.gpu_selected in uuids else 0
        self.gpu_selected = uuids[i] if i < len(uuids) else None
        self._gpu_changed()

    def _gpu_changed(self) -> None:
        if self.snap is not None:
            self.query_one(GpuPanel).sync(self.snap, self.history, self.gpu_selected)
            self.refresh_tables()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("-show")
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.refresh_tables()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.remove_class("-show")
        self.query_one("#jobs").focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        if box.has_class("-show") or self.filter_text:
            box.value = ""  # fires Input.Changed, which refreshes the tables
            box.remove_class("-show")
            self.filter_text = ""
            self.refresh_tables()
            self.query_one("#jobs").focus()

    def action_logs(self) -> None:
        row = self.selected()
        if row is not None and row.job is not None:
            self.push_screen(LogScreen(row.job))

    def action_cancel(self) -> None:
        row = self.selected()
        if row is not None and row.job is not None:
            self.ask_cancel(row.job)

    def ask_cancel(self, job: dict) -> None:
        you = (self.snap or {}).get("you")
        if job["state"] in model.ENDED:
            self.notify(f"job {job['id']} already ended ({job['state']})", severity="warning")
            return
        if job.get("user") != you and you != "root":
            self.notify(f"job {job['id']} belongs to {job.get('user')}: only its owner (or an admin, "
                        f"with `colo cancel {job['id']}`) can cancel it", severity="error", markup=False)
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.cancel_job(job["id"])

        self.push_screen(ConfirmScreen(f"Cancel job {job['id']} ({job.get('name') or '-'}, {job['state']})?\n"
                                       "A running job is stopped gracefully, then killed after the grace period."),
                         answered)

    def cancel_job(self, job_id: int) -> None:
        def work() -> None:
            try:
                self.client.cancel(job_id)
            except ClientError as e:
                self.call_from_thread(self.notify, safe(str(e)), title=f"cancel {job_id}", severity="error", markup=False)
            else:
                self.call_from_thread(self.notify, f"job {job_id} cancelled")

        self.run_worker(work, name="cancel", group="cancel", thread=True, exit_on_error=False)


def make_app(client: Client, *, clock: Callable[[], float] | None = None, refresh: float = 1.0) -> ColoTop:
    """The app as the CLI runs it; tests build it here too (a fixed `clock` makes snapshots stable)."""
    return ColoTop(client, clock=clock, refresh=refresh)


class _Replay:
    """Recorded `Client.top()` snapshots served in order on their own clock; after the last one
    the app stops polling, so that the GPU history ends where the recording did."""

    def __init__(self, frames: list[dict]):
        self.frames, self.served, self.at = frames, 0, frames[0]["at"]
        self.app: ColoTop | None = None

    def top(self) -> dict:
        snap = self.frames[min(self.served, len(self.frames) - 1)]
        self.served += 1
        self.at = snap["at"]
        if self.served >= len(self.frames) and self.app is not None:
            self.app.refresh_interval = 3600.0  # read as this poll ends, to arm the next
        return snap


def screenshot(frames: list[dict], path: Path, size: tuple[int, int] = (150, 19)) -> None:
    """Saves as SVG what `colo top` showed after these snapshots (its GPU history drawn from all of them)."""
    import asyncio

    replay = _Replay(frames)

    async def go() -> None:
        app = replay.app = make_app(replay, clock=lambda: replay.at, refresh=0.01)  # type: ignore[arg-type]
        async with app.run_test(size=size) as pilot:
            while app.polls < len(frames):
                await pilot.pause(0.02)
            await pilot.press("home")  # the cursor on the first row, not on the row it followed,
            app.set_focus(None)  # and drawn blurred: a focused cursor row hides its cells' colours
            await pilot.pause()
            app.save_screenshot(path.name, str(path.parent.resolve()))

    asyncio.run(go())


def run_top(client: Client) -> int:
    """The live view (`colo top --once` is render.once: no Textual loaded for it)."""
    make_app(client).run()
    return 0
