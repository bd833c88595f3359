"""Per-rank memory cards: the ledger's categories against the device's capacity.

Try it: `python -m console.demo` (or mount `DevicesPanel` in any App) and call
`update_ranks(step["ranks"], simulated)` with a step message's `ranks`. A parameter-server
run also passes the step's `ps` (`update_ranks(ranks, simulated, ps=step["ps"])`): cards are
then named by role (`server 0`, `worker 1`), a worker's card shows its step rate, its wait
and its emulated slowness, and a lost worker's card says so. A run on GPUs passes hello's
`devices` (`update_ranks(ranks, False, names=hello["devices"])`): a rank whose entry carries
the GPU's own figures (GPU_FIELDS) shows its GPU's name, the allocator's and NVML's figures,
and how far the allocator is from the ledger. Hello's `hosts` places each rank on its host
(`update_ranks(ranks, simulated, names=..., hosts=hello["hosts"])`); a pipeline of several replicas its
grid (`grid=hello["layout"]["grid"]`): a card says its place, `stage 1 · replica 0`; the table groups by stage.

Above MAX_CARDS ranks the panel shows the Devices table instead (widgets/device_table.py: a line per
rank, grouped by host, the outliers pinned on top; docs/devices.md); `card_data(rank)` is what a
rank's card would show, for the console's card dialog.
"""

from __future__ import annotations

import functools


from rich.text import Text
from textual import on
from textual.app import ComposeResult, RenderResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.widget import Widget
from textual.widgets import Input, Static

from .bars import bytes_of, human_bytes, segment_bar, signed_bytes
from .device_table import FleetTable
from .fleet import GPU_FIELDS, fleet_rows, places, roles_of, with_lost_ranks
from .throttle import Throttle

CARD_WIDTH = 36   # cells, border included; the grid fits as many per row as it can

# (field, legend label, colour): the ledger's categories, stacked in this order
CATEGORIES = [
    ("parameters_bytes", "param", "#4c8dff"),
    ("gradients_bytes", "grad", "#b07cff"),
    ("optimizer_state_bytes", "optim", "#2ec4b6"),
    ("master_bytes", "master", "#f4d35e"),   # fp32 masters beside bf16 weights (precision.params); else absent
    ("activations_bytes", "act", "#e879a6"),
    ("inputs_bytes", "inputs", "#9be564"),   # masks and rotary tables a model's blocks share; else absent
]
OPTIONAL = ("master_bytes", "inputs_bytes")   # in the legend only where a rank has some
WARN_FRACTION, CRIT_FRACTION = 0.80, 0.95
LEDGER_FIELDS = ("used_bytes", "capacity_bytes")   # a card without them has no memory to draw


@functools.lru_cache(maxsize=8)
def legend(present: frozenset) -> Text:
    """The bar's legend: every category but the optional ones a rank does not have."""
    return Text(" ").join(Text.assemble(("■", colour), label) for field, label, colour in CATEGORIES
                          if field not in OPTIONAL or field in present)


class DeviceCard(Widget):
    """One rank: stacked memory bar, usage, peak, host process; on a GPU also its name, the
    allocator's and NVML's figures, and the allocator's bytes the ledger does not explain."""

    DEFAULT_CSS = """
    DeviceCard {
        width: 1fr; height: auto; min-width: 30;
        border: round $primary 60%; border-title-color: $text; border-subtitle-color: $text-muted;
        padding: 0 1;
    }
    DeviceCard.-warn { border: round $warning; }
    DeviceCard.-crit { border: round $error; border-subtitle-color: $error; }
    DeviceCard.-lost { border: round $error 50%; border-subtitle-color: $error; }
    """

    def __init__(self, rank: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rank = rank
        self.entry: dict = {}
        self.simulated = True
        self.role: dict = {}   # parameter server: label ("worker 1"), and `worker` or `serves`
        self.device_name = ""  # the device's name (hello's `devices`), shown on a GPU rank's card
        self.border_title = f"rank {rank}"

    def update_data(self, entry: dict, simulated: bool, role: dict | None = None, name: str | None = None) -> None:
        """`role` (parameter server only): {"label": "worker 1", "worker": ps worker entry} or
        {"label": "server 0", "serves": [layer names]}. `name`: the rank's device, e.g.
        "NVIDIA H100 80GB HBM3" (hello's `devices`)."""
        role, name = role or {}, name or ""
        if entry == self.entry and simulated == self.simulated and role == self.role and name == self.device_name:
            return
        relayout = self.height_for(entry, role, name) != self.height_for(self.entry, self.role, self.device_name)
        self.entry, self.simulated, self.role, self.device_name = dict(entry), simulated, dict(role), name
        tag = "[dim italic]simulated[/]" if simulated else "[b $success]GPU[/]"
        label = f"[b]{role['label']}[/] [dim]rank {self.rank}[/]" if role.get("label") else f"[b]rank {self.rank}[/]"
        title = f"{label} {tag}"
        if self.border_title != title:
            self.border_title = title
        level, lost = self.level(), self.lost()
        self.set_class(level == "warn" and not lost, "-warn")
        self.set_class(level == "crit" and not lost, "-crit")
        self.set_class(lost, "-lost")
        subtitle = ("[b reverse red] LOST [/]" if lost else
                    "[b reverse red] OVER [/]" if entry.get("over_capacity") else "")
        if self.border_subtitle != subtitle:
            self.border_subtitle = subtitle
        self.refresh(layout=relayout)

    def lost(self) -> bool:
        worker = self.role.get("worker")
        return worker is not None and not worker.get("alive", True)

    def fraction(self) -> float:
        entry = self.entry
        capacity = entry.get("capacity_bytes") or 0
        high = max(entry.get("used_bytes") or 0, entry.get("peak_bytes") or 0)
        return high / capacity if capacity else 0.0

    def level(self) -> str:
        """The border's colour: the ledger's high mark against the capacity, or on a GPU NVML's used memory
        against its total when that is higher (what the operator trusts; the table flags it the same way)."""
        entry = self.entry
        nvml = (entry.get("nvml_used_bytes") or 0) / entry["nvml_total_bytes"] if entry.get("nvml_total_bytes") else 0.0
        fraction = max(self.fraction(), nvml)
        if self.entry.get("over_capacity") or fraction > CRIT_FRACTION:
            return "crit"
        return "warn" if fraction > WARN_FRACTION else "ok"

    def render(self) -> RenderResult:
        entry, width = self.entry, max(10, self.size.width)
        lines = self.role_lines(self.role)
        if not self.has_ledger(entry):
            lines = lines or [Text("waiting for data", style="dim")]
            for line in lines:
                line.truncate(width, overflow="ellipsis")
            return Text("\n").join(lines)
        capacity = entry.get("capacity_bytes") or 0
        parts = [(entry.get(field) or 0, colour) for field, _, colour in CATEGORIES]
        level_style = {"ok": "", "warn": "bold #ffb000", "crit": "bold red"}[self.level()]
        lines = self.name_lines(entry, self.device_name) + lines
        present = frozenset(field for field in OPTIONAL if entry.get(field))
        lines += [segment_bar(parts, capacity, width, entry.get("peak_bytes")), legend(present).copy()]
        # beside the allocator's figures, "used" would be ambiguous: the bar is the ledger's
        used = Text.assemble("ledger " if self.is_gpu(entry) else "used ",
                             (human_bytes(entry.get("used_bytes")), "bold"), " / cap ", human_bytes(capacity))
        lines.append(used)
        peak = Text.assemble("(peak ", (human_bytes(entry.get("peak_bytes")), level_style),
                             ") ", (f"{self.fraction():.0%}", level_style))
        if entry.get("swapped_bytes"):
            peak.append(f"  swap {human_bytes(entry['swapped_bytes'])}", "cyan")
        lines.append(peak)
        if self.policy_line(entry):   # the activation policy at work
            lines.append(Text.assemble(("swap ", "dim"), str(entry.get("swap_layers") or 0),
                                       ("  recompute ", "dim"), str(entry.get("recompute_layers") or 0),
                                       ("  to host ", "dim"),
                                       (f"{human_bytes(entry.get('swapped_out_bytes') or 0)}/step", "cyan"),
                                       *((("  wait ", "dim"), f"{entry['link_wait_ms']:.1f} ms")
                                         if entry.get("link_wait_ms") is not None else ())))
        lines += self.gpu_lines(entry)
        cpu = entry.get("cpu_percent")
        lines.append(Text.assemble(("rss ", "dim"), human_bytes(entry.get("rss_bytes")),
                                   ("  cpu ", "dim"), "—" if cpu is None else f"{cpu:.0f}%"))
        if entry.get("owned_bytes"):   # sharded: this rank's shard, and its wait for others' broadcasts
            lines.append(Text.assemble(("owns ", "dim"), human_bytes(entry["owned_bytes"]),
                                       ("  gate ", "dim"), f"{entry.get('gate_ms') or 0.0:.1f} ms"))
        if entry.get("host_bytes"):    # hybrid update: what the host-placed updates keep in host memory
            lines.append(Text.assemble(("host ", "dim"), human_bytes(entry["host_bytes"]),
                                       ("  busy ", "dim"), f"{entry.get('host_busy_ms') or 0.0:.1f} ms"))
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        return Text("\n").join(lines)

    @staticmethod
    def role_lines(role: dict) -> list[Text]:
        """Parameter server: what a server serves; a worker's pace, its emulated slowness, or that it is lost."""
        if "serves" in role:
            return [Text.assemble(("serves ", "dim"), ", ".join(role["serves"]) or "no layers")]
        worker = role.get("worker")
        if worker is None:
            return []
        if not worker.get("alive", True):
            lines = [Text.assemble(("lost", "bold red"), (f" after {worker.get('iterations', '?')} iterations", "dim"))]
        else:
            lines = [Text.assemble((f"{worker.get('steps_per_s') or 0.0:.1f}", "bold"), (" steps/s  wait ", "dim"),
                                   f"{worker.get('wait_ms') or 0.0:.1f} ms")]
        slow = worker.get("slow_factor")
        if slow is not None and slow != 1.0:
            lines.append(Text(f"{slow:.1f}x slower (emulated)", "#ffb000"))
        return lines

    @staticmethod
    def is_gpu(entry: dict) -> bool:
        return any(field in entry for field in GPU_FIELDS)

    @classmethod
    def name_lines(cls, entry: dict, name: str) -> list[Text]:
        """The GPU's name on a line of its own (the title has no room for it beside a role);
        a CPU rank's card keeps its simulated tag alone."""
        return [Text(name, "bold")] if name and cls.is_gpu(entry) else []

    @staticmethod
    def gpu_lines(entry: dict) -> list[Text]:
        """A GPU's own figures. `unexplained` is the allocator's bytes minus the ledger's: what the
        ledger does not count (DDP's buckets, workspaces, the allocator's rounding), negative when
        the ledger counts more than the allocator holds. NVML's line only where NVML answered."""
        lines = []
        allocated = entry.get("allocated_bytes")
        if allocated is not None:
            lines += [Text.assemble(("alloc ", "dim"), (human_bytes(allocated), "bold"),
                                    ("  peak ", "dim"), human_bytes(entry.get("allocator_peak_bytes"))),
                      Text.assemble(("reserved ", "dim"), human_bytes(entry.get("reserved_bytes")))]
            if entry.get("used_bytes") is not None:
                lines.append(Text.assemble(("unexplained ", "dim"),
                                           (signed_bytes(allocated - entry["used_bytes"]), "bold")))
        if "nvml_used_bytes" in entry:
            util = entry.get("gpu_util_percent")
            lines.append(Text.assemble(
                ("nvml ", "dim"), bytes_of(entry.get("nvml_used_bytes"), entry.get("nvml_total_bytes")),
                ("  util ", "dim"), "—" if util is None else f"{util:.0f}%"))
        return lines

    @staticmethod
    def has_ledger(entry: dict) -> bool:
        return any(field in entry for field in LEDGER_FIELDS)

    @staticmethod
    def policy_line(entry: dict) -> bool:
        return bool(entry.get("swap_layers") or entry.get("recompute_layers"))

    @classmethod
    def extra_lines(cls, entry: dict, name: str = "") -> int:
        """The lines beyond the five every card with a ledger has (bar, legend, used, peak, rss)."""
        return len(cls.name_lines(entry, name)) + len(cls.gpu_lines(entry)) + bool(entry.get("owned_bytes")) \
            + bool(entry.get("host_bytes")) + cls.policy_line(entry)

    @classmethod
    def height_for(cls, entry: dict, role: dict, name: str = "") -> int:
        role_lines = len(cls.role_lines(role))
        if role_lines and not cls.has_ledger(entry):   # a lost worker without a ledger row
            return role_lines
        return 5 + cls.extra_lines(entry, name) + role_lines

    def get_content_height(self, container, viewport, width: int) -> int:
        return self.height_for(self.entry, self.role, self.device_name)


class DevicesPanel(VerticalScroll):
    """Every rank's card in a grid that fits as many ~36-cell cards per row as it can; above
    MAX_CARDS ranks the Devices table (widgets/device_table.py) instead, a line per rank."""

    DEFAULT_CSS = """
    DevicesPanel { height: 1fr; }
    DevicesPanel > #devices-empty { width: 1fr; height: 1fr; content-align: center middle; color: $text-muted; }
    DevicesPanel > Grid { height: auto; grid-size: 1; grid-rows: auto; grid-gutter: 0 1; }
    DevicesPanel > FleetTable { display: none; }
    DevicesPanel.-table { overflow-y: hidden; }
    DevicesPanel.-table > FleetTable { display: block; }
    DevicesPanel > #devices-filter { display: none; }
    DevicesPanel > #devices-filter.-asked { display: block; }
    """

    REPAINT_S = 0.25   # memory moves slowly; 4 repaints a second are plenty
    # Cards up to this many ranks, the table above: four cards fit a 160x48 screen's panel; from 5 ranks
    # on, cards would hide ranks below the fold, and 64 ranks need a line each.
    MAX_CARDS = 4

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cards: dict[int, DeviceCard] = {}
        self.latest: tuple[list[dict], bool, dict | None, list, list] = ([], True, None, [], [])
        self.grid: dict | None = None   # a pipeline's stages x replicas (hello's layout.grid), or None
        self.ready = False   # composed and mounted: before that, updates wait for on_mount
        self.tabular = False  # the table is on show, not the cards
        self.repaint = Throttle(self, self.REPAINT_S, self.apply)

    def compose(self) -> ComposeResult:
        yield Static("no device data yet", id="devices-empty")
        yield Grid(id="devices-grid")
        yield FilterInput(placeholder="filter: h3, host 3, 41, worker — enter applies, esc cancels",
                          id="devices-filter", compact=True)
        yield FleetTable(id="devices-table")

    def on_mount(self) -> None:
        self.query_one(Grid).display = False
        self.ready = True
        self.apply()

    def on_resize(self) -> None:
        self.fit_columns()

    def fit_columns(self) -> None:
        fit = max(1, (self.size.width + 1) // (CARD_WIDTH + 1))
        self.query_one(Grid).styles.grid_size_columns = max(1, min(fit, len(self.cards)))

    def update_ranks(self, ranks: list[dict] | None, simulated: bool, ps: dict | None = None, *,
                     names: list[str] | None = None, hosts: list[int] | None = None, grid: dict | None = None) -> None:
        """`ranks`: a step's `ranks`; `ps`: a parameter-server step's `ps` (None in other modes);
        `names`: each rank's device, by rank (hello's `devices`; None when the run did not say);
        `hosts`: each rank's host, by rank (hello's `hosts`; None: every rank on host 0);
        `grid`: a pipeline's stages x replicas (hello's layout.grid; None in other modes)."""
        self.latest = (list(ranks or []), simulated, ps, list(names or []), list(hosts or []))
        self.grid = grid
        self.repaint()

    def apply(self) -> None:
        if not self.ready:
            return
        ranks, simulated, ps, names, hosts = self.latest
        roles = roles_of(ranks, ps)
        # a lost worker may send no ledger row any more: its card stays, saying it is lost
        ranks = with_lost_ranks(ranks, roles)
        self.show_table(len(ranks) > self.MAX_CARDS)
        grid, empty = self.query_one(Grid), self.query_one("#devices-empty")
        empty.display, grid.display = not ranks, bool(ranks) and not self.tabular
        if self.tabular:
            self.query_one(FleetTable).update_rows(fleet_rows(ranks, simulated, ps, names, hosts, self.grid))
            return
        if not ranks:
            return
        ids = [entry["rank"] for entry in ranks]
        if ids != list(self.cards):   # the set of ranks changed: remount, else update in place
            grid.remove_children()
            self.cards = {rank: DeviceCard(rank) for rank in ids}
            grid.mount_all(self.cards.values())
            self.fit_columns()
        for entry in ranks:
            rank = entry["rank"]
            self.cards[rank].update_data(entry, simulated, self.role_of(rank, roles), self.name_of(rank))

    def role_of(self, rank: int, roles: dict[int, dict]) -> dict | None:
        """A parameter server's role; in a pipeline of several replicas the rank's place, as its card's name."""
        stage, replica = places(self.grid).get(rank, (None, None))
        return roles.get(rank) or ({"label": f"stage {stage} · replica {replica}"} if stage is not None else None)

    def name_of(self, rank: int) -> str | None:
        names = self.latest[3]
        return names[rank] if 0 <= rank < len(names) and isinstance(names[rank], str) else None

    def show_table(self, tabular: bool) -> None:
        """Cards or the table: the cards go when the table comes (64 of them cost a layout a second)."""
        if tabular == self.tabular:
            return
        self.tabular = tabular
        self.can_focus = not tabular   # the table takes the focus, and the keys; the panel no longer scrolls
        self.set_class(tabular, "-table")
        if tabular:
            self.query_one(Grid).remove_children()
            self.cards = {}
            self.scroll_home(animate=False)
        self.describe_table()

    def describe_table(self) -> None:
        """The sort and the filter in the border's subtitle (the table's only)."""
        table = self.query_one(FleetTable)
        text = table.filter_text
        self.border_subtitle = (f"sort {table.sort_key}" + (f" · filter '{text}'" if text else "")) \
            if self.tabular else ""

    def card_data(self, rank: int) -> tuple[dict, bool, dict | None, str | None] | None:
        """What `rank`'s DeviceCard shows now: (entry, simulated, role, name); None once it has gone."""
        ranks, simulated, ps = self.latest[:3]
        roles = roles_of(ranks, ps)
        entry = next((entry for entry in with_lost_ranks(ranks, roles) if entry["rank"] == rank), None)
        return None if entry is None else (entry, simulated, self.role_of(rank, roles), self.name_of(rank))

    @on(FleetTable.FilterAsked)
    def ask_filter(self) -> None:
        field = self.query_one(FilterInput)
        field.value = self.query_one(FleetTable).filter_text
        field.add_class("-asked")
        field.focus()

    @on(Input.Submitted, "#devices-filter")
    def filter_chosen(self, event: Input.Submitted) -> None:
        self.query_one(FleetTable).set_filter(event.value)
        self.close_filter()

    @on(FleetTable.Arranged)
    def arranged(self) -> None:
        self.describe_table()

    def close_filter(self) -> None:
        self.query_one(FilterInput).remove_class("-asked")
        self.query_one(FleetTable).focus()


class FilterInput(Input):
    """The Devices table's filter, a line above it while asked for; esc leaves the filter as it was."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", tooltip="keep the filter as it was")]

    def action_cancel(self) -> None:
        if isinstance(self.parent, DevicesPanel):
            self.parent.close_filter()
