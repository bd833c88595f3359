"""Per-layer timings and memory policy: a DataTable that keeps its cursor on a layer.

Feed it a step message's `layers` (`update_layers(msg["layers"])`); `cycle_sort()`,
`set_filter("fc")` and `selected_layer` are for the console's keys and commands.
A parameter-server run also passes the step's `ps` (`update_layers(layers, ps=msg["ps"])`):
the table then shows each layer's server, version and last sync window instead of the
activation-policy columns, which that mode leaves empty. A pipeline of several replicas passes its
grid (`update_layers(layers, grid=hello["layout"]["grid"])`): a layer's stage says how many replicas
hold it, `stage 3 ×4`, and a command on the layer applies to each of them.

The rows start in the model's order (the step's own); `g` groups them under a header per
stage, owner or server, Enter folds the group under the cursor and `z` every group
(widgets/layer_order.py decides the lines). An update with the same lines changes cells
in place and, when only their order changed, moves the rows: 200 rows are not rebuilt
each second.
"""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.coordinate import Coordinate
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist

from .throttle import Throttle
from .layer_order import ALIASES, HEADER, SORTS, Header, arrange, group_field, headers_of, line_key

# (column key, title); the sort keys (layer_order.SORTS) index into the same figures
COLUMNS = [("name", "layer"), ("where", "stage/owner"), ("fwd", "fwd ms"), ("bwd", "bwd ms"),
           ("act", "act MiB"), ("policy", "policy"), ("placement", "placement"), ("update", "upd ms")]
# parameter server: the sync figures take the place of the activation and policy columns (the
# policy ones shown there only when the layer rows carry them), so that they fit the wide screen's
# table; a layer without parameters has no server and blank cells
PS_COLUMNS = [("name", "layer"), ("server", "server"), ("fwd", "fwd ms"), ("bwd", "bwd ms"),
              ("version", "version"), ("workers", "workers"), ("staleness", "stale"), ("window", "win ms")]
PS_OPTIONAL = {"policy": "policy", "placement": "placement", "update": "update_ms"}   # column -> row field
POLICY_STYLES = {"keep": "", "swap": "cyan", "recompute": "magenta", "host": "cyan"}
EMPTY_KEY = "\0empty"   # the key of the one dim "nothing to show" row; never a layer name
GROUP_NAMES = {"stage": "stage", "owner_rank": "owner", "server": "server"}   # the caption's "by ..."


def _number(value: float | None, scale: float = 1.0, style: str = "") -> Text:
    if value is None:
        return Text("—", style="dim", justify="right")
    return Text(f"{value / scale:.2f}", style=style, justify="right")


def _where(row: dict) -> Text:
    if "stage" in row:   # `×4`: held by 4 replicas (a pipeline's grid), each of which a command changes
        return Text(f"stage {row['stage']}" + (f" ×{row['replicas']}" if (row.get("replicas") or 1) > 1 else ""))
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


def _cells(row: dict, columns: list[tuple[str, str]] = COLUMNS, indent: str = "") -> tuple:
    cells = tuple(CELLS[key](row) for key, _ in columns)
    return (Text(indent) + cells[0], *cells[1:]) if indent else cells


def _header_cells(header: Header, columns: list[tuple[str, str]]) -> tuple:
    """`▾ stage 3   13 layers   20.12   40.24   312.00`: a group's count and its layers' sums."""
    count = Text(f"{header.layers} layer{'' if header.layers == 1 else 's'}", style="dim")
    cells = {"name": Text(("▸ " if header.folded else "▾ ") + header.label, style="bold"),
             "where": count, "server": count, "fwd": _number(header.fwd_ms, style="bold"),
             "bwd": _number(header.bwd_ms, style="bold"), "act": _number(header.activation_bytes, 2**20, "bold")}
    return tuple(cells.get(key, Text("")) for key, _ in columns)


def _same(before: Text, after: Text) -> bool:
    return before == after and before.style == after.style   # Text's == leaves the base style out


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
    """One row per layer, in the model's order or sorted by a figure (largest first) or by name,
    filtered by name, and grouped under a header per stage, owner or server on `g`."""

    DEFAULT_CSS = """
    LayerTable { height: 1fr; }
    """
    # the table's own keys: a focused widget's bindings come before the App's (console/app.py's help lists them)
    BINDINGS = [
        Binding("g", "group", "Group", show=False,
                tooltip="layers: group by pipeline stage, owner rank or server (again: ungroup)"),
        Binding("enter", "fold", "Fold", show=False,
                tooltip="layers, grouped: fold or unfold the group under the cursor"),
        Binding("z", "fold_all", "Fold all", show=False,
                tooltip="layers, grouped: fold every group (again: unfold them all)"),
    ]
    REPAINT_S = 0.25   # a DataTable repaint redraws every visible cell: at most 4 a second

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("cursor_type", "row")
        kwargs.setdefault("zebra_stripes", True)
        super().__init__(**kwargs)
        self.rows_in: list[dict] = []
        self.sort_key = "model"
        self.filter_text = ""
        self.grouped = False
        self.folded: set[str] = set()         # the labels of the folded groups ("stage 3"): kept across updates
        self.shown: list[str] | None = None   # the row keys in the table, in order: layer names, header keys
        self.cells: dict[str, tuple] = {}
        self.group_of: dict[str, str] = {}    # grouped: a layer's header key
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

    def caption(self) -> str:
        """The panel's subtitle: `sort model · by stage · filter 'attn'`."""
        field = group_field(self.rows_in) if self.grouped else None
        return (f"sort {self.sort_key}" + (f" · by {GROUP_NAMES[field]}" if field else "")
                + (f" · filter '{self.filter_text}'" if self.filter_text else ""))

    @property
    def selected_key(self) -> str | None:
        """The row key under the cursor: a layer's name, a group header's key, or None."""
        if not self.row_count:
            return None
        try:
            row_key, _ = self.coordinate_to_cell_key(Coordinate(self.cursor_row, 0))
        except CellDoesNotExist:
            return None
        return None if row_key.value == EMPTY_KEY else row_key.value

    @property
    def selected_layer(self) -> str | None:
        """The layer under the cursor; None on a group's header (the layer keys need a layer)."""
        key = self.selected_key
        return None if key is None or key.startswith(HEADER) else key

    def update_layers(self, rows: list[dict] | None, ps: dict | None = None, grid: dict | None = None) -> None:
        """`rows`: a step's `layers`; `ps`: a parameter-server step's `ps` (None in other modes); `grid`: a
        pipeline's stages x replicas (hello's layout.grid; None in other modes)."""
        self.rows_in = ps_rows(list(rows or []), ps) if ps is not None else list(rows or [])
        replicas = (grid or {}).get("replicas") if isinstance(grid, dict) else None
        if isinstance(replicas, int) and replicas > 1:
            self.rows_in = [{**row, "replicas": replicas} if "stage" in row else row for row in self.rows_in]
        columns = columns_for(self.rows_in, ps)
        if columns != self.columns_shown:
            self.columns_shown = columns
            self.shown = None   # rebuild, titles included
        self.repaint()   # sorting, filtering, grouping and folding apply at once: they are the operator's keys

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
        keys = [key for key in SORTS if key in ("model", "name") or key in dict(self.columns_shown)]
        at = keys.index(self.sort_key) if self.sort_key in keys else -1
        self.sort_by(keys[(at + 1) % len(keys)])
        return self.sort_key

    def set_filter(self, text: str) -> None:
        self.filter_text = text.strip().lower()
        self.refill()

    def action_group(self) -> None:
        if not self.grouped and group_field(self.rows_in) is None:
            self.notify("layers: no stage, owner or server to group by in this run", timeout=3)
            return
        self.grouped = not self.grouped
        self.refill()

    def action_fold(self) -> None:
        """Fold or unfold the group of the row under the cursor: its header, or one of its layers."""
        key = self.selected_key
        header = key if key and key.startswith(HEADER) else self.group_of.get(key)
        if header is None:   # not grouped: Enter selects, as in any DataTable
            self.action_select_cursor()
            return
        self.folded ^= {header.removeprefix(HEADER)}
        self.refill()

    def action_fold_all(self) -> None:
        labels = {key.removeprefix(HEADER) for key in self.shown or [] if key.startswith(HEADER)}
        self.folded = set() if labels and labels <= self.folded else self.folded | labels
        self.refill()

    def line_cells(self, line: dict | Header, indent: str) -> tuple:
        if isinstance(line, Header):
            return _header_cells(line, self.columns_shown)
        return _cells(line, self.columns_shown, indent)

    def refill(self) -> None:
        if not self.columns:   # not mounted yet: on_mount fills
            return
        lines = arrange(self.rows_in, self.sort_key, self.filter_text, self.grouped, self.folded)
        keys = [line_key(line) for line in lines]
        selected, group_of, self.group_of = self.selected_key, self.group_of, headers_of(lines)
        indent = "  " if self.group_of else ""   # grouped: a layer's name stands under its header
        if self.border_subtitle != (caption := self.caption()):
            self.border_subtitle = caption
        if keys and self.shown is not None and len(keys) == len(self.shown) and set(keys) == set(self.shown):
            self.change_cells(lines, keys, indent)
            if keys != self.shown:   # the same rows in another order: move them, their cells and widths kept
                at = {self.cells[key][0].plain: i for i, key in enumerate(keys)}
                self.sort("name", key=lambda cell: at[cell.plain])
                self.shown = keys
                self.keep_cursor(selected)
            return
        self.clear(columns=True)   # and the columns, so their widths fit the new rows
        self.add_titles()
        self.cells = {}
        if not lines:
            self.shown = []
            message = "no layer timings yet" if not self.rows_in else f"no layer matches '{self.filter_text}'"
            self.add_row(Text(message, style="dim italic"), *[""] * (len(self.columns_shown) - 1), key=EMPTY_KEY)
            return
        for line, key in zip(lines, keys):
            self.cells[key] = self.line_cells(line, indent)
            self.add_row(*self.cells[key], key=key)
        self.shown = keys
        # a layer folded away: the cursor goes to its group's header
        self.keep_cursor(selected if selected in keys else group_of.get(selected))

    def change_cells(self, lines: list[dict | Header], keys: list[str], indent: str) -> None:
        for line, key in zip(lines, keys):
            new = self.line_cells(line, indent)
            for (column, _), before, after in zip(self.columns_shown, self.cells[key], new, strict=True):
                if not _same(before, after):   # measuring every cell costs more than the rest: only a wider one
                    wider = after.cell_len > self.columns[column].content_width
                    self.update_cell(key, column, after, update_width=wider)
            self.cells[key] = new

    def keep_cursor(self, key: str | None) -> None:
        if key in self.shown:
            self.move_cursor(row=self.shown.index(key), animate=False)
