"""Modal screens: a job's details, its log, the cancel confirmation, and help.

Every call to the daemon runs in a thread worker; a failure is shown in place, never raised.
"""
from __future__ import annotations

import time

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

from ..client import ClientError
from ..textsafe import safe
from ..units import format_duration, format_size

LOG_LINES = 20


def describe(job: dict, gpu_label: str, now: float) -> Text:
    t = Text()
    t.append(f"job {job['id']}", "bold")
    t.append(f"  {job.get('name') or '-'}  ·  {job.get('user')}  ·  {job['state']}\n")
    argv = " ".join(job.get("argv") or [])
    t.append("command  ", "dim")
    t.append(f"{argv}\n" if not job.get("image") else f"{job['image']}: {argv}\n")
    t.append("gpu      ", "dim")
    t.append(f"{gpu_label}  mode {job.get('mode') or '-'}  budget {format_size(job.get('budget'))}"
             f"  used {format_size(job.get('used'))}")
    if job.get("refused"):
        t.append(f"  refused allocations {job['refused']}", "bold red")
    t.append("\n")
    t.append("times    ", "dim")
    start, end = job.get("started_at"), job.get("ended_at")
    t.append(f"waited {format_duration((start or now) - job['submitted_at']) if job.get('submitted_at') else '-'}"
             f"  ran {format_duration((end or now) - start) if start else '-'}")
    if job.get("exit_code") is not None:
        t.append(f"  exit code {job['exit_code']}")
    return t


def explain_text(r: dict) -> str:
    d = r.get("decision")
    if d is None:
        return f"no placement decision yet. {r.get('reason') or ''}".strip()
    text = d.get("reason") or ""
    if r.get("reason") and r["reason"] != text and r.get("state") != "queued":
        text += f"\n{r['reason']}"
    return text


class DetailScreen(ModalScreen):
    """Enter on a job: what it is, why it runs where it runs (or waits), and its last lines."""

    BINDINGS = [Binding("escape,q,enter", "dismiss", "Close"), Binding("l", "logs", "Logs"),
                Binding("c", "cancel", "Cancel job")]

    def __init__(self, job: dict, gpu_label: str, now: float) -> None:
        super().__init__()
        self.job = job
        self.gpu_label = gpu_label
        self.now = now

    def compose(self) -> ComposeResult:
        with Vertical(id="detail", classes="dialog"):
            yield Static(describe(self.job, self.gpu_label, self.now), id="detail-summary")
            yield Label("why", classes="section")
            yield Static("…", id="detail-explain")
            yield Label(f"last {LOG_LINES} log lines", classes="section")
            with VerticalScroll(id="detail-log-box"):
                yield Static("…", id="detail-log", markup=False)

    def on_mount(self) -> None:
        self.query_one("#detail").border_title = f"job {self.job['id']}"
        self.fetch()

    @work(thread=True, exit_on_error=False, group="detail")
    def fetch(self) -> None:
        client = self.app.client
        try:
            why = explain_text(client.explain(self.job["id"]))
        except ClientError as e:
            why = f"(cannot explain: {e})"
        why = safe(why, keep="\n")
        try:
            log = "".join(client.logs(self.job["id"], follow=False, tail=LOG_LINES)).rstrip("\n") or "(no output)"
        except ClientError as e:
            log = f"(cannot read log: {e})"
        self.app.call_from_thread(self._show, why, safe(log, keep="\n\t"))  # a job's output may hold escapes

    def _show(self, why: str, log: str) -> None:
        self.query_one("#detail-explain", Static).update(Text(why))
        self.query_one("#detail-log", Static).update(Text(log))

    def action_logs(self) -> None:
        self.dismiss()
        self.app.push_screen(LogScreen(self.job))

    def action_cancel(self) -> None:
        self.dismiss()
        self.app.ask_cancel(self.job)


class LogScreen(ModalScreen):
    """A job's log, re-read about once a second (the last 500 lines) while it is open."""

    BINDINGS = [Binding("escape,q,l", "dismiss", "Close")]
    TAIL = 500

    def __init__(self, job: dict) -> None:
        super().__init__()
        self.job = job
        self._last: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="logs", classes="dialog"):
            with VerticalScroll(id="log-box"):
                yield Static("…", id="log-text", markup=False)

    def on_mount(self) -> None:
        self.query_one("#logs").border_title = f"log of job {self.job['id']} ({self.job.get('name') or '-'})"
        self.fetch()

    @work(thread=True, exit_on_error=False, group="logs", exclusive=True)
    def fetch(self) -> None:
        try:
            text = "".join(self.app.client.logs(self.job["id"], follow=False, tail=self.TAIL)) or "(no output yet)"
        except ClientError as e:
            text = f"(cannot read log: {e})"
        self.app.call_from_thread(self._show, safe(text, keep="\n\t"))

    def _show(self, text: str) -> None:
        if not self.is_attached:
            return
        if text != self._last:
            box = self.query_one("#log-box", VerticalScroll)
            at_end = box.scroll_y >= box.max_scroll_y
            self.query_one("#log-text", Static).update(Text(text.rstrip("\n")))
            if at_end:
                box.call_after_refresh(box.scroll_end, animate=False)
            self._last = text
        self.set_timer(self.app.refresh_interval, self.fetch)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm", classes="dialog"):
            yield Static(self.question, id="question", markup=False)  # it quotes a job name
            with Horizontal(id="buttons"):
                yield Button("Cancel job (y)", variant="error", id="yes")
                yield Button("Keep it (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


HELP = """\
[b]colo top[/b]: who uses which GPU, under which budget, and who waits.

[b]Keys[/b]
  ↑ ↓ j k   move            tab  next table          q  quit
  enter     job details: why it runs there (or waits), last log lines
  l         the job's log, re-read every second
  c         cancel the job (your own; asks first)
  /         filter rows by any text (id, name, user, state); esc clears
  s         sort by the next column (or click a column title)
  g         per-GPU view, one GPU after another (or click a GPU line)

[b]GPU line[/b]
  [dodger_blue1]█[/] a job's use inside [dodger_blue1]▒[/] its budget (one colour per job, as in
  the ID column), [bright_red]█[/] processes colo does not manage, [grey62]█[/] MPS
  servers, [grey37]·[/] free, [grey23]╳[/] reserve.
  SM: SM use; BW: memory-bandwidth use; each with its recent history.
  MPS n: MPS server with n clients; MPS FAULT: new clients refused.
[b]MODE[/b]  MPS: MPS client (spatial); TS: time-sliced context.
"""


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help", classes="dialog"):
            yield Static(HELP.rstrip())

    def on_mount(self) -> None:
        self.query_one("#help").border_title = "help"


def clock_text(now: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(now))
