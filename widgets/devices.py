"""Per-rank memory cards: the ledger's categories against the device's capacity.

Try it: `python -m console.demo` (or mount `DevicesPanel` in any App) and call
`update_ranks(step["ranks"], simulated)` with a step message's `ranks`. A parameter-server
run also passes the step's `ps` (`update_ranks(ranks, simulated, ps=step["ps"])`): cards are
then named by role (`server 0`, `worker 1`), a worker's card shows its step rate, its wait
and its emulated slowness, and a lost worker's card says so. A run on GPUs passes hello's
`devices` (`update_ranks(ranks, False, names=hello["devices"])`): a rank whose entry carries
the GPU's own figures (GPU_FIELDS) shows its GPU's name, the allocator's and NVML's figures,
and how far the allocator is from the ledger.
"""

from __future__ import annotations

from itertools import groupby
from time import monotonic

from rich.text import Text
from textual.app import ComposeResult, RenderResult
from textual.containers import Grid, VerticalScroll
from textual.widget import Widget
from textual.widgets import Static

CARD_WIDTH = 36   # cells, border included; the grid fits as many per row as it can

# (field, legend label, colour): the ledger's categories, stacked in this order
CATEGORIES = [
    ("parameters_bytes", "param", "#4c8dff"),
    ("gradients_bytes", "grad", "#b07cff"),
    ("optimizer_state_bytes", "optim", "#2ec4b6"),
    ("activations_bytes", "act", "#e879a6"),
]
WARN_FRACTION, CRIT_FRACTION = 0.80, 0.95
LEDGER_FIELDS = ("used_bytes", "capacity_bytes")   # a card without them has no memory to draw
# a CUDA rank's own figures (the torch allocator's, then NVML's; engine/runtime/control.py sends them): a CPU
# rank has none of them, absent rather than zero
GPU_FIELDS = ("allocated_bytes", "reserved_bytes", "allocator_peak_bytes",
              "nvml_used_bytes", "nvml_total_bytes", "gpu_util_percent")
LEGEND = Text(" ").join(Text.assemble(("■", colour), label) for _, label, colour in CATEGORIES)


def human_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; three significant-ish digits, binary units."""
    if n is None:
        return "—"
    value, unit = float(n), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, next_unit
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.1f} {unit}"


def bytes_of(part: float | None, whole: float | None) -> str:
    """'6.7 / 79.6 GiB': one unit when both have it, so the line fits a narrow card."""
    a, b = human_bytes(part), human_bytes(whole)
    if a.partition(" ")[2] == b.partition(" ")[2] != "":
        a = a.partition(" ")[0]
    return f"{a} / {b}"


def signed_bytes(n: int) -> str:
    """512 MiB -> '+512 MiB': a difference, whose sign says which side holds more."""
    return f"+{human_bytes(n)}" if n > 0 else human_bytes(n)


class Throttle:
    """Call `apply` at most once per `interval_s`: at once after a quiet spell, else once
    at the end of the interval. Panels record every update but repaint a few times a
    second, because a repaint of 64 cards or 200 table rows costs far more than the data."""

    def __init__(self, widget: Widget, interval_s: float, apply) -> None:
        self.widget, self.interval_s, self.apply = widget, interval_s, apply
        self.last = float("-inf")
        self.timer = None

    def __call__(self) -> None:
        if self.timer is not None:   # already due: it will apply the newest data
            return
        wait = self.last + self.interval_s - monotonic()
        if wait <= 0 or not self.widget.is_mounted:
            self.fire()
        else:
            self.timer = self.widget.set_timer(wait, self.fire)

    def fire(self) -> None:
        self.timer, self.last = None, monotonic()
        self.apply()


def segment_bar(parts: list[tuple[int, str]], capacity: int, width: int,
                peak: int | None) -> Text:
    """A `width`-cell bar whose full width is `capacity`: one coloured run per part
    (bytes, style), `░` for the free rest, `┃` at the peak, `▶` in the last cell when
    the parts overflow the capacity. Boundaries round the running total, so the
    segments always add up to the used width."""
    width = max(1, width)
    total = sum(max(0, n) for n, _ in parts)
    scale = capacity if capacity > 0 else max(total, peak or 0, 1)
    cells: list[tuple[str, str]] = []
    running = 0
    for n, style in parts:
        start = min(width, round(running / scale * width))
        running += max(0, n)
        end = min(width, round(running / scale * width))
        cells.extend(("█", style) for _ in range(end - start))
    cells.extend(("░", "grey30") for _ in range(width - len(cells)))
    if peak is not None and peak > 0:
        col = min(width - 1, int(peak / scale * width))
        over = peak > scale
        bg = cells[col][1] if cells[col][0] == "█" else ""
        cells[col] = ("┃", ("bold red" if over else "bold bright_white") + (f" on {bg}" if bg else ""))
    if total > scale:
        cells[-1] = ("▶", "bold red")
    text = Text()
    for (char, style), run in groupby(cells):   # one span per run: cheap to render
        text.append(char * len(list(run)), style)
    return text


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
        fraction = self.fraction()
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
        lines += [segment_bar(parts, capacity, width, entry.get("peak_bytes")), LEGEND.copy()]
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
    """Every rank's card in a grid that fits as many ~36-cell cards per row as it can."""

    DEFAULT_CSS = """
    DevicesPanel { height: 1fr; }
    DevicesPanel > #devices-empty { width: 1fr; height: 1fr; content-align: center middle; color: $text-muted; }
    DevicesPanel > Grid { height: auto; grid-size: 1; grid-rows: auto; grid-gutter: 0 1; }
    """

    REPAINT_S = 0.25   # memory moves slowly; 4 repaints a second are plenty

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cards: dict[int, DeviceCard] = {}
        self.latest: tuple[list[dict], bool, dict | None, list] = ([], True, None, [])
        self.ready = False   # composed and mounted: before that, updates wait for on_mount
        self.repaint = Throttle(self, self.REPAINT_S, self.apply)

    def compose(self) -> ComposeResult:
        yield Static("no device data yet", id="devices-empty")
        yield Grid(id="devices-grid")

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
                     names: list[str] | None = None) -> None:
        """`ranks`: a step's `ranks`; `ps`: a parameter-server step's `ps` (None in other modes);
        `names`: each rank's device, by rank (hello's `devices`; None when the run did not say)."""
        self.latest = (list(ranks or []), simulated, ps, list(names or []))
        self.repaint()

    def apply(self) -> None:
        if not self.ready:
            return
        ranks, simulated, ps, names = self.latest
        roles = ps_roles(ranks, ps or {}) if ps is not None or any("role" in entry for entry in ranks) else {}
        missing = set(roles) - {entry["rank"] for entry in ranks}
        if missing:   # a lost worker may send no ledger row any more: its card stays, saying it is lost
            ranks = sorted([*ranks, *({"rank": rank} for rank in missing)], key=lambda entry: entry["rank"])
        grid, empty = self.query_one(Grid), self.query_one("#devices-empty")
        empty.display, grid.display = not ranks, bool(ranks)
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
            name = names[rank] if 0 <= rank < len(names) and isinstance(names[rank], str) else None
            self.cards[rank].update_data(entry, simulated, roles.get(rank), name)


def ps_roles(ranks: list[dict], ps: dict) -> dict[int, dict]:
    """rank -> {"label": "server 0", "serves": [...]} or {"label": "worker 1", "worker": {...}}.

    Roles come from the rank rows' `role`; a rank in `ps.workers` is a worker whatever its row says.
    Servers and workers are numbered apart, in rank order; a server's number is the `server` of the
    layers it holds."""
    workers = {w["rank"]: w for w in ps.get("workers") or [] if isinstance(w.get("rank"), int)}
    lost = set(ps.get("workers_lost") or [])
    role_of = {entry["rank"]: entry.get("role") for entry in ranks}
    role_of.update({rank: "worker" for rank in [*workers, *lost] if isinstance(rank, int)})
    roles, counts = {}, {"server": 0, "worker": 0}
    for rank in sorted(role_of):
        role = role_of[rank]
        if role not in counts:
            continue
        label = f"{role} {counts[role]}"
        if role == "server":
            serves = [str(layer.get("name")) for layer in ps.get("layers") or [] if layer.get("server") == counts[role]]
            roles[rank] = {"label": label, **({"serves": serves} if ps.get("layers") else {})}
        else:
            worker = workers.get(rank)
            if rank in lost:
                worker = {**(worker or {"rank": rank}), "alive": False}
            roles[rank] = {"label": label, "worker": worker}
        counts[role] += 1
    return roles
