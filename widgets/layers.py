"""Per-layer timings and memory policy: a DataTable that keeps its cursor on a layer.

Feed it a step message's `layers` (`update_layers(msg["layers"])`); `cycle_sort()`,
`set_filter("fc")` and `selected_layer` are for the console's keys and commands.
"""

from __future__ import annotations

import re

from rich.text import Text
from textual.widgets import DataTable

from .devices import Throttle

# (column key, title); the sort keys below index into the same figures
COLUMNS = [("name", "layer"), ("where", "stage/owner"), ("fwd", "fwd ms"), ("bwd", "bwd ms"),
           ("act", "act MiB"), ("policy", "policy"), ("placement", "placement"), ("update", "upd ms")]
SORTS = ["name", "fwd", "bwd", "act", "update"]
SORT_FIELDS = {"name": "name", "fwd": "fwd_ms", "bwd": "bwd_ms", "act": "activation_bytes", "update": "update_ms"}
ALIASES = {"fwd_ms": "fwd", "bwd_ms": "bwd", "activation_bytes": "act", "act_mib": "act", "layer": "name",
           "update_ms": "update"}
POLICY_STYLES = {"keep": "", "swap": "cyan", "recompute": "magenta", "host": "cyan"}
EMPTY_KEY = "\0empty"   # the key of the one dim "nothing to show" row; never a layer name


def _natural(name: str) -> list:
    """'fc10' after 'fc9': digit runs compare as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", name) if part]


def _number(value: float | None, scale: float = 1.0) -> Text:
    if value is None:
        return Text("—", style="dim", justify="right")
    return Text(f"{value / scale:.2f}", justify="right")


def _cells(row: dict) -> tuple:
    if "stage" in row:
        where = f"stage {row['stage']}"
    elif "owner_rank" in row:
        where = f"rank {row['owner_rank']}"
    else:
        where = "—"
    act = row.get("activation_bytes")
    return (Text(str(row["name"])), Text(where, style="" if where != "—" else "dim"),
            _number(row.get("fwd_ms")), _number(row.get("bwd_ms")),
            _number(act, 2**20) if act is not None else _number(None),
            Text(row.get("policy", "—"), style=POLICY_STYLES.get(row.get("policy"), "dim")),
            Text(row.get("placement", "—"), style=POLICY_STYLES.get(row.get("placement"), "dim")),
            _number(row.get("update_ms")))


class LayerTable(DataTable):
    """One row per layer; sorted by name or by a figure (largest first), filtered by name."""

    DEFAULT_CSS = """
    LayerTable { height: 1fr; }
    """
    REPAINT_S = 0.25   # a DataTable repaint redraws every visible cell: at most 4 a second

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("cursor_type", "row")
        kwargs.setdefault("zebra_stripes", True)
        super().__init__(**kwargs)
        self.rows_in: list[dict] = []
        self.sort_key = "name"
        self.filter_text = ""
        self.shown: list[str] | None = None   # the layer names in the table, in order
        self.cells: dict[str, tuple] = {}
        self.repaint = Throttle(self, self.REPAINT_S, self.refill)

    def on_mount(self) -> None:
        self.add_titles()
        self.refill()

    def add_titles(self) -> None:
        for key, title in COLUMNS:
            if key == self.sort_key:
                title += " ▲" if key == "name" else " ▼"
            self.add_column(title, key=key)

    @property
    def selected_layer(self) -> str | None:
        if not self.shown or not self.row_count:
            return None
        row = min(max(self.cursor_row, 0), len(self.shown) - 1)
        return self.shown[row]

    def update_layers(self, rows: list[dict] | None) -> None:
        self.rows_in = list(rows or [])
        self.repaint()   # sorting and filtering apply at once: they are the operator's keys

    def sort_by(self, key: str) -> None:
        key = ALIASES.get(key, key)
        if key not in SORTS:
            raise ValueError(f"sort key must be one of {', '.join(SORTS)}, got {key!r}")
        if key != self.sort_key:
            self.sort_key = key
            self.shown = None   # rebuild, titles included
            self.refill()

    def cycle_sort(self) -> str:
        self.sort_by(SORTS[(SORTS.index(self.sort_key) + 1) % len(SORTS)])
        return self.sort_key

    def set_filter(self, text: str) -> None:
        self.filter_text = text.strip().lower()
        self.refill()

    def visible_rows(self) -> list[dict]:
        rows = [r for r in self.rows_in if self.filter_text in str(r.get("name", "")).lower()]
        field = SORT_FIELDS[self.sort_key]
        if self.sort_key == "name":
            return sorted(rows, key=lambda r: _natural(str(r["name"])))
        return sorted(rows, key=lambda r: -(r.get(field) or 0.0))   # the costliest first

    def refill(self) -> None:
        if not self.columns:   # not mounted yet: on_mount fills
            return
        rows = self.visible_rows()
        names = [str(r["name"]) for r in rows]
        if names and names == self.shown:   # same layers, same order: change cells in place
            for row in rows:
                new = _cells(row)
                old = self.cells[row["name"]]
                for (key, _), before, after in zip(COLUMNS, old, new, strict=True):
                    if before != after:   # measuring every cell costs more than the rest: only a wider one
                        wider = after.cell_len > self.columns[key].content_width
                        self.update_cell(row["name"], key, after, update_width=wider)
                self.cells[row["name"]] = new
            return
        selected = self.selected_layer
        self.clear(columns=True)   # and the columns, so their widths fit the new rows
        self.add_titles()
        self.cells = {}
        if not rows:
            self.shown = []
            message = "no layer timings yet" if not self.rows_in else f"no layer matches '{self.filter_text}'"
            self.add_row(Text(message, style="dim italic"), *[""] * (len(COLUMNS) - 1), key=EMPTY_KEY)
            return
        for row in rows:
            self.cells[row["name"]] = _cells(row)
            self.add_row(*self.cells[row["name"]], key=row["name"])
        self.shown = names
        if selected in names:
            self.move_cursor(row=names.index(selected), animate=False)
