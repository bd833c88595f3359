"""Communication streams: one lane per stream with its recent traffic as a sparkline, under a line of the
figures the run declares this panel shows (sharded: its reduce's and broadcast's waits and spans).

Feed it each step message's `streams` (docs/telemetry.md): `update_streams(msg.get("streams"), mode)`, or,
drawing less often than steps come, the latest step's and every step's since the last draw:
`update_streams(latest, mode, steps)`, so that each lane's sparkline has one bar per step. `figures`:
the latest step's (label, unit, value) of each such figure, its ranks read as one (console/state.py
RunState.panel_figures), e.g. `[("reduce", "ms", 0.52), ("broadcast wait", "ms", 1.3)]`.
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Sparkline, Static

from .bars import figure_text
from .devices import human_bytes

HISTORY = 60   # steps of traffic kept per stream


class StreamLane(Horizontal):
    """`stream 0  ▂▃▅▇▅▃  104 KiB   8%  ⇄0`: bytes this step, busy % of the step, in flight"""

    DEFAULT_CSS = """
    StreamLane { height: 1; }
    StreamLane > .lane-name { width: 9; color: $text; text-style: bold; }
    StreamLane > Sparkline { width: 1fr; min-width: 8; margin: 0 1 0 0; }
    StreamLane > .lane-stats { width: 21; }
    """

    def __init__(self, stream: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stream = stream
        self.history: deque[float] = deque(maxlen=HISTORY)
        self.stats_key: tuple | None = None
        # made here, not in compose, so a lane can take a step before it is mounted
        self.spark = Sparkline([], classes="lane-spark")
        self.stats = Static("", classes="lane-stats")

    def compose(self) -> ComposeResult:
        yield Static(f"stream {self.stream}", classes="lane-name")
        yield self.spark
        yield self.stats

    def add_step(self, entry: dict) -> None:
        """One step's bar, without drawing it."""
        self.history.append(float(entry.get("bytes") or 0))

    def show(self, entry: dict) -> None:
        """Draw the bars so far, and the latest step's figures."""
        self.spark.data = list(self.history)
        busy = entry.get("busy_fraction") or 0.0
        in_flight = entry.get("in_flight") or 0
        key = (human_bytes(entry.get("bytes") or 0), round(busy * 100), in_flight)
        if key == self.stats_key:   # text unchanged: nothing to repaint
            return
        self.stats_key = key
        busy_style = "bold red" if busy > 0.95 else "bold #ffb000" if busy > 0.8 else ""
        self.stats.update(Text.assemble(
            (f"{key[0]:>9}", "bold"), (f"  {key[1]:>3d}%", busy_style),
            ("  ⇄", "dim"), (f"{in_flight}", "bold" if in_flight else "dim")), layout=False)


class StreamsPanel(VerticalScroll):
    """Every communication stream of the run, or why there are none."""

    DEFAULT_CSS = """
    StreamsPanel { height: auto; }
    StreamsPanel > #streams-empty { width: 1fr; content-align: center middle; color: $text-muted; }
    StreamsPanel > #streams-caption { color: $text-muted; height: 1; }
    StreamsPanel > #streams-figures { height: auto; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lanes: dict[int, StreamLane] = {}
        self.mode = ""
        self.early: tuple | None = None   # (latest, mode, steps, figures) that came before on_mount
        self.figures: list[tuple] = []
        self.ready = False

    def compose(self) -> ComposeResult:
        yield Static("no communication streams yet", id="streams-empty")
        yield Static(f"bytes/step (last {HISTORY}) · busy % · ⇄ in flight", id="streams-caption")
        yield Static("", id="streams-figures")

    def on_mount(self) -> None:
        self.query_one("#streams-caption").display = False
        self.query_one("#streams-figures").display = False
        self.ready = True
        if self.early is not None:
            self.update_streams(*self.early)

    def update_streams(self, streams: list[dict] | None, mode: str, steps: list[list[dict]] | None = None,
                       figures: list[tuple] | None = None) -> None:
        """`streams`: the latest step's entries; `steps`: every step's entries since the last call, oldest
        first, the latest's included (None: the latest step alone); `figures`: (label, unit, value) of the
        latest step's figures this panel shows (none: no line)."""
        if steps is None:
            steps = [streams or []]
        if not self.ready:   # keep every step until the lanes exist
            earlier = self.early[2] if self.early is not None else []
            self.early = (streams, mode, [*earlier, *steps][-HISTORY:], figures)
            return
        self.show_figures(list(figures or []))
        empty, caption = self.query_one("#streams-empty", Static), self.query_one("#streams-caption")
        if mode != self.mode:
            self.mode = mode
            empty.update(f"no communication streams in mode {mode}")
        empty.display, caption.display = not streams, bool(streams)
        for lane in self.lanes.values():
            lane.display = bool(streams)
        if not streams:
            return
        ids = [entry["stream"] for entry in streams]
        if ids != list(self.lanes):   # the set of streams changed: remount the lanes
            kept = {i: self.lanes[i].history for i in ids if i in self.lanes}
            for lane in self.lanes.values():
                lane.remove()
            self.lanes = {i: StreamLane(i) for i in ids}
            for i, history in kept.items():
                self.lanes[i].history = history
            self.mount_all(self.lanes.values())
        for entries in steps:
            for entry in entries:
                if entry.get("stream") in self.lanes:   # a stream gone since has no lane
                    self.lanes[entry["stream"]].add_step(entry)
        for entry in streams:
            self.lanes[entry["stream"]].show(entry)

    def show_figures(self, figures: list[tuple]) -> None:
        """`reduce 0.52 ms · broadcast wait 1.30 ms`: a line above the lanes, drawn only when it changed."""
        if figures == self.figures:
            return
        self.figures = figures
        line = self.query_one("#streams-figures", Static)
        line.display = bool(figures)
        line.update(Text(" · ", "dim").join(Text.assemble((f"{label} ", "dim"), (figure_text(value, unit), "bold"))
                                            for label, unit, value in figures))
