"""Per-layer timings and memory policy: a DataTable that keeps its cursor on a layer.

Feed it a step message's `layers` (`update_layers(msg["layers"])`); `cycle_sort()`,
`set_filter("fc")` and `selected_layer` are for the console's keys and commands.
A parameter-server run also passes the step's `ps` (`update_layers(layers, ps=msg["ps"])`):
the table then shows each layer's server, version and last sync window instead of the
activation-policy columns, which that mode leaves empty.
"""

from __future__ import annotations

import re

from rich.text import Text
from textual.widgets import DataTable

from .devices import Throttle

# (column key, title); the sort keys below index into the same figures
COLUMNS = [("name", "layer"), ("where", "stage/owner"), ("fwd", "fwd ms"), ("bwd", "bwd ms"),
           ("act", "act MiB"), ("policy", "policy"), ("placement", "placement"), ("update", "upd ms")]
# parameter server: the sync figures take the place of the activation and policy columns (the
# policy ones shown there only when the layer rows carry them), so that they fit the wide screen's
# table; a layer without parameters has no server and blank cells
PS_COLUMNS = [("name", "layer"), ("server", "server"), ("fwd", "fwd ms"), ("bwd", "bwd ms"),
              ("version", "version"), ("workers", "workers"), ("staleness", "stale"), ("window", "win ms")]
PS_OPTIONAL = {"policy": "policy", "placement": "placement", "update": "update_ms"}   # column -> row field
SORTS = ["name", "fwd", "bwd", "act", "update", "staleness", "window"]
SORT_FIELDS = {"name": "name", "fwd": "fwd_ms", "bwd": "bwd_ms", "act": "activation_bytes", "update": "update_ms",
               "staleness": "mean_staleness", "window": "window_ms"}
ALIASES = {"fwd_ms": "fwd", "bwd_ms": "bwd", "activation_bytes": "act", "act_mib": "act", "layer": "name",
           "update_ms": "update", "mean_staleness": "staleness", "window_ms": "window"}
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


def _where(row: dict) -> Text:
    if "stage" in row:
        return Text(f"stage {row['stage']}")
    if "owner_rank" in row:
        return Text(f"rank {row['owner_rank']}")
    return Text("—", style="dim")


def _window_workers(row: dict) -> Text:
    """`3/4`: workers whose gradients made the layer's last window, of the workers alive."""
    got, live = row.get("window_workers"), row.get("workers_live")
    if got is None:
        return Text("")
    short = live is not None and got < live
    return Text(f"{got}/{'?' if live is None else live}", style="#ffb000" if short else "", justify="right")


def _staleness(row: dict) -> Text:
    value, bound = row.get("mean_staleness"), row.get("staleness_bound")
    if value is None:
        return Text("")
    return Text(f"{value:.2f}", style="bold red" if bound is not None and value > bound else "", justify="right")


def _blank_or(value) -> Text:
    return Text("") if value is None else Text(str(value), justify="right")


CELLS = {
    "name": lambda row: Text(str(row["name"])),
    "where": _where,
    "fwd": lambda row: _number(row.get("fwd_ms")),
    "bwd": lambda row: _number(row.get("bwd_ms")),
    "act": lambda row: _number(row.get("activation_bytes"), 2**20),
    "policy": lambda row: Text(row.get("policy", "—"), style=POLICY_STYLES.get(row.get("policy"), "dim")),
    "placement": lambda row: Text(row.get("placement", "—"), style=POLICY_STYLES.get(row.get("placement"), "dim")),
    "update": lambda row: _number(row.get("update_ms")),
    "server": lambda row: _blank_or(row.get("server")),
    "version": lambda row: _blank_or(row.get("version")),
    "workers": _window_workers,
    "staleness": _staleness,
    "window": lambda row: Text("") if row.get("window_ms") is None else _number(row["window_ms"]),
}


def _cells(row: dict, columns: list[tuple[str, str]] = COLUMNS) -> tuple:
    return tuple(CELLS[key](row) for key, _ in columns)


def ps_rows(rows: list[dict], ps: dict) -> list[dict]:
    """Each layer row with its sync figures from a step's `ps` merged in (layers without
    parameters get none). Before the first timed step the names come from `ps` alone."""
    by_name = {entry.get("name"): entry for entry in ps.get("layers") or []}
    rows = rows or [{"name": name} for name in by_name]
    live, bound = ps.get("workers_live"), ps.get("staleness_bound")
    merged = []
    for row in rows:
        sync = by_name.get(row.get("name"))
        if sync is None:
            merged.append(row)
        else:
            merged.append({**row, **{k: v for k, v in sync.items() if k != "name"},
                           "workers_live": live, "staleness_bound": bound})
    return merged


def columns_for(rows: list[dict], ps: dict | None) -> list[tuple[str, str]]:
    if ps is None:
        return COLUMNS
    optional = [(key, title) for key, title in COLUMNS
                if key in PS_OPTIONAL and any(PS_OPTIONAL[key] in row for row in rows)]
    return PS_COLUMNS + optional


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
        self.columns_shown = COLUMNS           # (key, title): COLUMNS, or the parameter server's
        self.repaint = Throttle(self, self.REPAINT_S, self.refill)

    def on_mount(self) -> None:
        self.add_titles()
        self.refill()

    def add_titles(self) -> None:
        for key, title in self.columns_shown:
            if key == self.sort_key:
                title += " ▲" if key == "name" else " ▼"
            self.add_column(title, key=key)

    @property
    def selected_layer(self) -> str | None:
        if not self.shown or not self.row_count:
            return None
        row = min(max(self.cursor_row, 0), len(self.shown) - 1)
        return self.shown[row]

    def update_layers(self, rows: list[dict] | None, ps: dict | None = None) -> None:
        """`rows`: a step's `layers`; `ps`: a parameter-server step's `ps` (None in other modes)."""
        self.rows_in = ps_rows(list(rows or []), ps) if ps is not None else list(rows or [])
        columns = columns_for(self.rows_in, ps)
        if columns != self.columns_shown:
            self.columns_shown = columns
            self.shown = None   # rebuild, titles included
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
        """The next sort key among the columns on show."""
        keys = [key for key in SORTS if key == "name" or key in dict(self.columns_shown)]
        at = keys.index(self.sort_key) if self.sort_key in keys else -1
        self.sort_by(keys[(at + 1) % len(keys)])
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
                new = _cells(row, self.columns_shown)
                old = self.cells[row["name"]]
                for (key, _), before, after in zip(self.columns_shown, old, new, strict=True):
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
            self.add_row(Text(message, style="dim italic"), *[""] * (len(self.columns_shown) - 1), key=EMPTY_KEY)
            return
        for row in rows:
            self.cells[row["name"]] = _cells(row, self.columns_shown)
            self.add_row(*self.cells[row["name"]], key=row["name"])
        self.shown = names
        if selected in names:
            self.move_cursor(row=names.index(selected), animate=False)
