"""The Devices table: a line per rank, grouped by host (a pipeline of several replicas: by stage), and the
job's outliers pinned above the rows.

DevicesPanel (widgets/devices.py) shows it instead of the cards when a job has more ranks than
cards can show. Feed it rows from widgets/fleet.py (the rules); widgets/fleet_lines.py says what
each line reads:

    table = FleetTable()
    table.update_rows(fleet_rows(step["ranks"], simulated, names=hello["devices"], hosts=hello["hosts"]))
    table.sort_by("memory"); table.set_filter("h3"); table.cursor_rank   # the rank enter would open

While it has focus: ↑ ↓ PgUp PgDn Home End move the cursor, enter posts RankChosen (the console opens
that rank's card), o cycles the sort (fleet.SORT_KEYS), / posts FilterAsked. The top lines stay put
whatever the scroll: the job's min / median / max, a line per outlier (fleet.outlier_groups) and the
column titles. A Line API widget: it draws only the lines on screen, so a second's new figures for
64 ranks cost one pass over the rows and a repaint, never a layout.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.events import Click, Resize
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from .fleet import SORT_KEYS, filter_rows, group_field, group_rows, next_sort, outliers
from .fleet_lines import column_keys, fit_columns, group_line, header, joined, pinned_lines, row_cells


class FleetTable(ScrollView, can_focus=True):
    """Rows of fleet_rows, sorted and filtered; the pinned lines above them."""

    DEFAULT_CSS = """
    FleetTable { height: 1fr; overflow-x: hidden; scrollbar-gutter: stable; background: $surface; }
    FleetTable > .fleet-table--header { text-style: bold; background: $panel; }
    FleetTable > .fleet-table--host { color: $text-muted; }
    FleetTable > .fleet-table--cursor { background: $block-cursor-blurred-background; }
    FleetTable:focus > .fleet-table--cursor { background: $block-cursor-background; text-style: bold; }
    """
    COMPONENT_CLASSES = {"fleet-table--header", "fleet-table--host", "fleet-table--cursor"}
    BINDINGS = [
        Binding("enter", "open", "Card", tooltip="devices table: the selected rank's full card (esc closes it)"),
        Binding("o", "sort", "Sort", tooltip="devices table: sort by memory, step, compute, wait or rank"),
        Binding("slash", "filter", "Filter",
                tooltip="devices table: filter by host, rank or stage (h3, host 3, 41, s5)"),
        Binding("up", "move(-1)", show=False), Binding("down", "move(1)", show=False),
        Binding("pageup", "page(-1)", show=False), Binding("pagedown", "page(1)", show=False),
        Binding("home", "move(-1000000)", show=False), Binding("end", "move(1000000)", show=False),
    ]

    class RankChosen(Message):
        """Enter (or a click on the cursor's row): show `rank`'s card."""

        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    class FilterAsked(Message):
        """`/`: the panel asks for the filter's text, then calls set_filter."""

    class Arranged(Message):
        """The sort or the filter changed (the panel's subtitle says them)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rows: list[dict] = []
        self.found: dict[int, list[str]] = {}
        self.sort_key, self.filter_text = "rank", ""
        self.cursor_rank: int | None = None
        self.pinned: list[Text] = []
        # ("group", (field, host or stage, rows)) or ("rank", row), in drawing order
        self.body: list[tuple[str, object]] = []
        self.keys: list[str] = []                    # the columns that fit
        self.widths: dict[str, int] = {}
        self.cells: dict[int, dict[str, Text]] = {}
        self.strips: dict[tuple, Strip] = {}
        self._styles: dict[str, Style] | None = None

    # --- data -------------------------------------------------------------------------

    def update_rows(self, rows: list[dict]) -> None:
        """The latest fleet rows (fleet.fleet_rows): outliers, cells and lines are worked out again."""
        self.rows = rows
        self.found = outliers(rows)
        self.rebuild()

    def sort_by(self, key: str) -> None:
        if key not in SORT_KEYS:
            raise ValueError(f"sort key must be one of {', '.join(SORT_KEYS)}, got {key!r}")
        self.sort_key = key
        self.rebuild()
        self.move_to_first()   # what the sort puts first is what the operator asked to see
        self.post_message(self.Arranged())

    def cycle_sort(self) -> str:
        self.sort_by(next_sort(self.sort_key))
        return self.sort_key

    def set_filter(self, text: str) -> None:
        self.filter_text = text.strip()
        self.rebuild()
        self.move_to_first()
        self.post_message(self.Arranged())

    @property
    def shown_ranks(self) -> list[int]:
        """The ranks on the table's lines, in order (the filter and the sort applied)."""
        return [payload["rank"] for kind, payload in self.body if kind == "rank"]

    def rebuild(self) -> None:
        keys = column_keys(self.rows)
        self.cells = {row["rank"]: row_cells(row, self.found.get(row["rank"], []), keys) for row in self.rows}
        field = group_field(self.rows)   # a pipeline of several replicas: by stage, else by host
        groups = group_rows(filter_rows(self.rows, self.filter_text), self.sort_key, field)
        several = field == "stage" or len({row.get("host", 0) for row in self.rows}) > 1
        self.body = []
        for value, rows in groups:
            if several:   # one host: the job's line above says it all
                self.body.append(("group", (field, value, rows)))
            self.body += [("rank", row) for row in rows]
        shown = self.shown_ranks
        if self.cursor_rank not in shown:
            self.cursor_rank = shown[0] if shown else None
        self.fit()

    def fit(self) -> None:
        """The columns that fit the width, then the pinned lines; repaint (never a layout)."""
        width = self.scrollable_content_region.width or 200   # before the first layout: any width
        self.keys, self.widths = fit_columns(self.cells, column_keys(self.rows), width, self.sort_key)
        self.pinned = pinned_lines(self.rows, self.found, header(self.keys, self.widths, self.sort_key), width)
        self.virtual_size = Size(width, len(self.pinned) + len(self.body))
        self.strips.clear()
        self.refresh()

    # --- drawing ----------------------------------------------------------------------

    def on_resize(self, event: Resize) -> None:
        if self.rows:
            self.fit()

    def body_text(self, index: int) -> Text:
        kind, payload = self.body[index]
        if kind == "rank":
            return joined(self.cells[payload["rank"]], self.keys, self.widths)
        return group_line(*payload, self.scrollable_content_region.width)

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        if y < len(self.pinned):
            key = ("pinned", y)
        else:
            index = y - len(self.pinned) + self.scroll_offset.y
            if index >= len(self.body):
                return Strip.blank(width, self.rich_style)
            kind, payload = self.body[index]
            key = ("body", index, kind == "rank" and payload["rank"] == self.cursor_rank)
        strip = self.strips.get(key)
        if strip is None:
            strip = self.strips[key] = self.draw(key, width)
        return strip

    def draw(self, key: tuple, width: int) -> Strip:
        styles = self.styles_now()
        if key[0] == "pinned":
            text = self.pinned[key[1]]
            style = styles["header"] if key[1] == len(self.pinned) - 1 else styles["base"]
        else:
            text = self.body_text(key[1])
            style = styles["host"] if self.body[key[1]][0] == "group" else styles["cursor" if key[2] else "base"]
        text.truncate(width, overflow="ellipsis")
        segments = list(Segment.apply_style(text.render(self.app.console), style))
        if width > text.cell_len:
            segments.append(Segment(" " * (width - text.cell_len), style))
        return Strip(segments, max(width, text.cell_len))

    def styles_now(self) -> dict[str, Style]:
        """The line styles, worked out once per change of style or focus (asking is slow)."""
        if self._styles is None:
            base = self.rich_style
            self._styles = {"base": base, **{name: base + self.get_component_rich_style(f"fleet-table--{name}")
                                             for name in ("header", "host", "cursor")}}
        return self._styles

    def restyle(self) -> None:
        self._styles = None
        self.strips.clear()
        self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self.restyle()

    def on_focus(self) -> None:
        self.restyle()   # the cursor's colour says whether the keys go here

    def on_blur(self) -> None:
        self.restyle()

    # --- keys and the mouse -----------------------------------------------------------

    def move_to_first(self) -> None:
        shown = self.shown_ranks
        self.cursor_rank = shown[0] if shown else None
        self.scroll_to(y=0, animate=False, immediate=True)
        self.strips.clear()
        self.refresh()

    def action_move(self, delta: int) -> None:
        shown = self.shown_ranks
        if not shown:
            return
        at = shown.index(self.cursor_rank) if self.cursor_rank in shown else 0
        self.cursor_rank = shown[max(0, min(len(shown) - 1, at + delta))]
        self.show_cursor()

    def action_page(self, direction: int) -> None:
        self.action_move(direction * max(1, self.scrollable_content_region.height - len(self.pinned) - 1))

    def show_cursor(self) -> None:
        """Scroll so that the cursor's line (and its group's line, when just above) is in view."""
        index = next((i for i, (kind, row) in enumerate(self.body)
                      if kind == "rank" and row["rank"] == self.cursor_rank), 0)
        slots = max(1, self.scrollable_content_region.height - len(self.pinned))
        top = round(self.scroll_offset.y)
        first = index - 1 if index and self.body[index - 1][0] == "group" else index
        if first < top:
            self.scroll_to(y=first, animate=False, immediate=True)
        elif index >= top + slots:
            self.scroll_to(y=index - slots + 1, animate=False, immediate=True)
        self.strips.clear()
        self.refresh()

    def action_open(self) -> None:
        if self.cursor_rank is not None:
            self.post_message(self.RankChosen(self.cursor_rank))

    def action_sort(self) -> None:
        self.cycle_sort()

    def action_filter(self) -> None:
        self.post_message(self.FilterAsked())

    def on_click(self, event: Click) -> None:
        index = event.y - len(self.pinned) + round(self.scroll_offset.y)
        if event.y < len(self.pinned) or not 0 <= index < len(self.body) or self.body[index][0] != "rank":
            return
        rank = self.body[index][1]["rank"]
        if rank == self.cursor_rank:   # a second click on the same row opens it, as enter does
            self.action_open()
        self.cursor_rank = rank
        self.strips.clear()
        self.refresh()

