"""Pipeline stages: forward / backward / idle time per stage, scaled to the slowest stage.

Feed it the pipeline's per-stage figures: `update_stages(stages, mode, imbalance_ms,
threshold_ms, migrating)`. One widget that renders its rows itself: a pipeline has a
handful of stages, and a single render is cheaper than a widget per bar.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import RenderResult
from textual.widget import Widget

from .devices import segment_bar

PARTS = [("fwd_ms", "fwd", "#4c8dff"), ("bwd_ms", "bwd", "#b07cff"), ("idle_ms", "idle", "grey42")]


class StagesPanel(Widget):
    """`stage 0 ████████▓▓▓▓▓▓▓▓▓▓░░  1.2 / 3.4 / 0.5 ms  mb 2`, one row per stage."""

    DEFAULT_CSS = """
    StagesPanel { height: auto; min-height: 1; padding: 0 1; }
    StagesPanel.-empty { color: $text-muted; content-align: center middle; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stages: list[dict] = []
        self.mode = ""
        self.imbalance_ms: float | None = None
        self.threshold_ms: float | None = None
        self.migrating = False
        self.add_class("-empty")

    def update_stages(self, stages: list[dict] | None, mode: str, imbalance_ms: float | None = None,
                      threshold_ms: float | None = None, migrating: bool = False) -> None:
        state = (list(stages or []), mode, imbalance_ms, threshold_ms, migrating)
        if state == (self.stages, self.mode, self.imbalance_ms, self.threshold_ms, self.migrating):
            return
        relayout = len(state[0]) != len(self.stages)
        self.stages, self.mode, self.imbalance_ms, self.threshold_ms, self.migrating = state
        self.set_class(not self.stages, "-empty")
        self.refresh(layout=relayout)

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(self.stages) + 1 if self.stages else 1

    def header(self, width: int) -> Text:
        imbalance = self.imbalance_ms
        if imbalance is None:   # not given: the spread of the stages' busy time
            busy = [(s.get("fwd_ms") or 0) + (s.get("bwd_ms") or 0) for s in self.stages]
            imbalance = max(busy) - min(busy)
        over = self.threshold_ms is not None and imbalance > self.threshold_ms
        text = Text("⟳ rebalancing  ", "bold #ffb000") if self.migrating else Text()
        text.append("imbalance ", "dim").append(f"{imbalance:.2f} ms", "bold red" if over else "bold green")
        if self.threshold_ms is not None:
            text.append(f" {'>' if over else '≤'} threshold {self.threshold_ms:.2f} ms", "dim")
        legend = Text("   ")
        for _, label, colour in PARTS:
            legend.append("■", colour).append(f"{label} ", "dim")
        legend.append("ms/step", "dim")
        return text + legend if text.cell_len + legend.cell_len <= width else text

    def render(self) -> RenderResult:
        if not self.stages:
            return Text(f"no pipeline stages in mode {self.mode}")
        width = self.size.width
        longest = max(sum(s.get(f) or 0 for f, _, _ in PARTS) for s in self.stages) or 1.0
        label_w = max(len(f"stage {s.get('stage', '?')}") for s in self.stages) + 1
        lines = [self.header(width)]
        for s in self.stages:
            figures = Text.assemble(
                "  ", (f"{s.get('fwd_ms') or 0:.1f}", "#4c8dff"), "/",
                (f"{s.get('bwd_ms') or 0:.1f}", "#b07cff"), "/",
                (f"{s.get('idle_ms') or 0:.1f}", "grey62"), " ms")
            if s.get("micro_batches_in_flight") is not None:
                figures.append(f"  mb {s['micro_batches_in_flight']}", "dim")
            bar_w = max(4, width - label_w - figures.cell_len)
            line = Text.assemble((f"stage {s.get('stage', '?')}".ljust(label_w), "bold"),
                                 self.bar(s, longest, bar_w), figures)
            lines.append(line)
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        return Text("\n").join(lines)

    @staticmethod
    def bar(stage: dict, longest: float, width: int) -> Text:
        # segment_bar works on integers: microseconds keep sub-millisecond stages visible
        parts = [(round((stage.get(f) or 0) * 1000), colour) for f, _, colour in PARTS]
        return segment_bar(parts, round(longest * 1000), width, None)
