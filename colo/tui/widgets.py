"""Widgets of `colo top`: GPU lines, the one-GPU card, and a table updated by row key."""
from __future__ import annotations

from collections import deque

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget

from ..units import format_size
from . import model
from .render import gpu_line

HISTORY = 120  # samples of SM / bandwidth % kept per GPU (two minutes at 1 s)


class History:
    """SM and memory-bandwidth % over time for one GPU."""

    def __init__(self) -> None:
        self.sm: deque[int | None] = deque(maxlen=HISTORY)
        self.bw: deque[int | None] = deque(maxlen=HISTORY)

    def add(self, g: dict) -> None:
        self.sm.append(g.get("sm_util"))
        self.bw.append(g.get("mem_util"))


def _text(pieces: list[tuple[str, str]]) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    for s, style in pieces:
        t.append(s, style or None)
    return t


class Line(Widget):
    """One line of text that repaints only itself, and only when the text changes (a Static's
    update() re-lays out the whole screen, every second)."""

    def __init__(self, text: str = "", **kw) -> None:
        super().__init__(**kw)
        self._text = Text(text)

    def set(self, text: Text) -> None:
        if text != self._text:
            self._text = text
            self.refresh()

    def render(self) -> Text:
        return self._text


class GpuRow(Widget):
    """One line per GPU; clicking it opens that GPU's view."""

    class Clicked(Message):
        def __init__(self, uuid: str) -> None:
            super().__init__()
            self.uuid = uuid

    def __init__(self, uuid: str) -> None:
        super().__init__(classes="gpu-row")
        self.uuid = uuid
        self._data: tuple | None = None

    def set_data(self, snap: dict, g: dict, hist: History) -> None:
        # each poll brings new dicts: repaint only when what is drawn changed
        data = (snap, g, tuple(hist.sm), tuple(hist.bw))
        if self._data is None or self._data[1:] != data[1:] or \
                model.bar_parts(self._data[0], g) != model.bar_parts(snap, g):
            self._data = data
            self.refresh()

    def render(self) -> Text:
        if self._data is None:
            return Text("")
        snap, g, sm, bw = self._data
        width = self.size.width or 80
        spark_w = 0 if width < 90 else (8 if width < 140 else 20)
        return _text(gpu_line(snap, g, width, sm, bw, spark_w))

    def on_click(self) -> None:
        self.post_message(self.Clicked(self.uuid))


class GpuCard(Widget):
    """The per-GPU view: bar with a legend of budgets, wide sparklines, MPS and processes."""

    def __init__(self) -> None:
        super().__init__(id="gpu-card")
        self._data: tuple | None = None

    def set_data(self, snap: dict, g: dict, hist: History) -> None:
        self._data = (snap, g, tuple(hist.sm), tuple(hist.bw))
        self.refresh(layout=True)

    def render(self) -> Text:
        if self._data is None:
            return Text("")
        snap, g, sm, bw = self._data
        width = max(20, (self.size.width or 80))
        mps_text, mps_style = model.mps_label(g)
        t = Text(no_wrap=False)
        t.append(f"GPU {g['index']} ", "bold")
        t.append(f"{g.get('name') or '?'}  ")
        t.append(f"{model.mem_text(g)} used · {format_size(g.get('budgeted'))} budgeted of "
                 f"{format_size(g.get('usable'))} usable · mode {g.get('compute_mode', '?')} · ", "")
        t.append(mps_text, mps_style)
        t.append("\n")
        if g.get("error"):
            t.append(f"out of service: {g['error']}: no new job is placed here; its jobs are left running\n",
                     "bold red")
        t.append_text(_text(model.bar_cells(model.bar_parts(snap, g), width)))
        t.append("\n")
        for j in sorted(model.gpu_jobs(snap, g), key=lambda j: j["id"]):
            t.append("■ ", model.job_colour(j["id"]))
            used = j.get("used")
            t.append(f"#{j['id']} {j.get('name') or '-'} ({j.get('user')}) "
                     f"{format_size(used) if used is not None else '?'}/{format_size(j.get('budget'))}   ")
        fu = model.foreign_used(snap, g)
        if fu:
            t.append("■ ", model.FOREIGN_STYLE)
            t.append(f"foreign {format_size(fu)}   ")
        t.append("· free", "grey37")
        t.append("\n")
        sw = max(8, width - 10)
        t.append("SM ", "dim")
        t.append(model.pct(g.get("sm_util")) + "% ")
        t.append(model.spark(sm, sw), "green")
        t.append("\nBW ", "dim")
        t.append(model.pct(g.get("mem_util")) + "% ")
        t.append(model.spark(bw, sw), "cyan")
        return t


class GpuPanel(VerticalScroll):
    """All GPUs, one line each, or one GPU's card (`selected`)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.rows: dict[str, GpuRow] = {}
        self.card: GpuCard | None = None
        self.empty: Widget | None = None

    def sync(self, snap: dict, history: dict[str, History], selected: str | None) -> None:
        gpus = {g["uuid"]: g for g in snap.get("gpus", [])}
        if selected in gpus:
            for r in self.rows.values():
                r.remove()
            self.rows.clear()
            if self.card is None:
                self.card = GpuCard()
                self.mount(self.card)
            self.card.set_data(snap, gpus[selected], history[selected])
            self._set_empty(None)
            return
        if self.card is not None:
            self.card.remove()
            self.card = None
        for uuid in [u for u in self.rows if u not in gpus]:
            self.rows.pop(uuid).remove()
        new = [GpuRow(u) for u in gpus if u not in self.rows]
        for r in new:
            self.rows[r.uuid] = r
        if new:
            self.mount_all(new)
        for uuid, g in gpus.items():
            self.rows[uuid].set_data(snap, g, history[uuid])
        self._set_empty(None if gpus else ("no GPUs: " + (snap.get("gpu_error") or "none found")))

    def _set_empty(self, text: str | None) -> None:
        from textual.widgets import Static

        if text is None:
            if self.empty is not None:
                self.empty.remove()
                self.empty = None
        elif self.empty is None:
            self.empty = Static(text, classes="empty")
            self.mount(self.empty)
        else:
            self.empty.update(text)


class KeyedTable(ScrollView, can_focus=True):
    """A table kept in step with a list of `model.Row`s by row key, drawn one line per row.

    Textual's DataTable drops every cached cell when any cell changes; with run times ticking in
    every row each second that meant re-rendering the whole visible table through Rich once a
    second (about 3/4 of `colo top`'s CPU). Here a row is redrawn only when its own cells or the
    column widths change, and a line is plain segments, not a Rich render.
    """

    COMPONENT_CLASSES = {"keyed-table--header", "keyed-table--cursor", "keyed-table--cursor-blurred"}
    BINDINGS = [
        Binding("up,k", "move(-1)", "Up", show=False), Binding("down,j", "move(1)", "Down", show=False),
        Binding("pageup", "page(-1)", show=False), Binding("pagedown", "page(1)", show=False),
        Binding("home,ctrl+home", "move(-1000000)", show=False),
        Binding("end,ctrl+end", "move(1000000)", show=False),
        Binding("enter", "select", "Details", show=False),
    ]

    class Selected(Message):
        """Enter or a click on the row under the cursor."""

        def __init__(self, table: "KeyedTable", row: model.Row) -> None:
            super().__init__()
            self.table = table
            self.row = row

    class HeaderClicked(Message):
        def __init__(self, table: "KeyedTable", column: str) -> None:
            super().__init__()
            self.table = table
            self.column = column

    def __init__(self, columns, **kw) -> None:
        super().__init__(**kw)
        self.spec = columns
        self.rows: list[model.Row] = []
        self.rows_by_key: dict[str, model.Row] = {}
        self.order = "default"
        self.cursor_row = 0
        self.widths = [cell_len(t) for _, t in columns]
        self._cache: dict[str, tuple[tuple, Strip]] = {}
        self._styles: dict[str, Style] = {}

    # data ----------------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self.rows)

    def keys(self) -> list[str]:
        return [r.key for r in self.rows]

    def current(self) -> model.Row | None:
        return self.rows[self.cursor_row] if self.rows else None

    def get_row_index(self, key: str) -> int:
        return next(i for i, r in enumerate(self.rows) if r.key == key)

    def sync(self, rows: list[model.Row], order: str = "default") -> None:
        """Show `rows`, ordered by `order`; the cursor stays on the row it was on."""
        was = self.current()
        rows = sorted(rows, key=lambda r: r.order.get(order, 0))
        if [(r.key, r.cells) for r in rows] == [(r.key, r.cells) for r in self.rows]:
            self.rows, self.order = rows, order  # same picture (jobs carry other fields too)
            self.rows_by_key = {r.key: r for r in rows}
            return
        self.rows, self.order = rows, order
        self.rows_by_key = {r.key: r for r in rows}
        for key in [k for k in self._cache if k not in self.rows_by_key]:
            del self._cache[key]
        widths = [cell_len(t) for _, t in self.spec]
        for r in rows:
            for i, (text, _) in enumerate(r.cells):
                if len(text) > widths[i]:  # len: the cell texts are narrow characters
                    widths[i] = cell_len(text)
        if widths != self.widths:
            self.widths = widths
            self._cache.clear()
        if was is not None and was.key in self.rows_by_key:
            self.cursor_row = self.get_row_index(was.key)
        self.cursor_row = max(0, min(self.cursor_row, len(rows) - 1))
        self.virtual_size = Size(sum(w + 2 for w in self.widths), len(rows) + 1)
        self.refresh()

    # drawing -------------------------------------------------------------------------------------
    def _style(self, spec: str) -> Style:
        st = self._styles.get(spec)
        if st is None:
            st = self._styles[spec] = Style.parse(spec) if spec else Style()
        return st

    def _line(self, cells, over: Style | None) -> Strip:
        segs = []
        for (text, style), w in zip(cells, self.widths):
            st = self._style(style)
            segs.append(Segment(" " + text + " " * (w - cell_len(text) + 1), st + over if over else st))
        return Strip(segs)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        base = self.rich_style
        x = int(self.scroll_x)
        if y == 0:
            header = self.get_component_rich_style("keyed-table--header")
            strip = self._line([(t, "") for _, t in self.spec], header)
            return strip.crop_extend(x, x + width, base + header)
        i = int(self.scroll_y) + y - 1
        if i >= len(self.rows):
            return Strip.blank(width, base)
        row = self.rows[i]
        cursor = None
        if i == self.cursor_row:
            cursor = self.get_component_rich_style(
                "keyed-table--cursor" if self.has_focus else "keyed-table--cursor-blurred")
        key = (row.cells, cursor)
        hit = self._cache.get(row.key)
        if hit is None or hit[0] != key:
            hit = self._cache[row.key] = (key, self._line(row.cells, cursor))
        return hit[1].crop_extend(x, x + width, base + cursor if cursor else base)

    # moving --------------------------------------------------------------------------------------
    def move_cursor(self, row: int, scroll: bool = True) -> None:
        self.cursor_row = max(0, min(row, len(self.rows) - 1))
        if scroll:
            top, height = int(self.scroll_y), max(1, self.scrollable_content_region.height - 1)
            if self.cursor_row < top:
                self.scroll_to(y=self.cursor_row, animate=False)
            elif self.cursor_row >= top + height:
                self.scroll_to(y=self.cursor_row - height + 1, animate=False)
        self.refresh()

    def action_move(self, delta: int) -> None:
        self.move_cursor(self.cursor_row + delta)

    def action_page(self, direction: int) -> None:
        self.move_cursor(self.cursor_row + direction * max(1, self.scrollable_content_region.height - 2))

    def action_select(self) -> None:
        if self.rows:
            self.post_message(self.Selected(self, self.rows[self.cursor_row]))

    def on_click(self, event: events.Click) -> None:
        at = event.get_content_offset(self)
        if at is None:
            return
        if at.y == 0:
            x = at.x + int(self.scroll_x)
            for (col, _), w in zip(self.spec, self.widths):
                if x < w + 2:
                    self.post_message(self.HeaderClicked(self, col))
                    return
                x -= w + 2
            return
        i = int(self.scroll_y) + at.y - 1
        if i < len(self.rows):
            again = i == self.cursor_row
            self.move_cursor(i, scroll=False)
            if again or event.chain > 1:
                self.action_select()

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()
