"""Pipeline stages: each stage's layers, and its forward / backward / idle time scaled to the slowest.

Feed it the pipeline's per-stage figures: `update_stages(stages, mode, imbalance_ms,
threshold_ms, migrating, figures)`; `figures`, by stage, the (label, unit, value) of each figure the run
declares this panel shows, from the stage's rank (console/state.py RunState.panel_figures: the pipeline's
`recv_wait_ms`), each value after the stage's times, under its label on a line of its own. One widget that
renders its rows itself: a pipeline has at most a few dozen stages, and a single render is cheaper than a widget per bar. A stage's layers
are summarised (`embed, blocks.0-11 (73)`: layer_span), and when the panel is shorter than
its stages, its last line says how many more there are.
"""

from __future__ import annotations

import re

from rich.text import Text
from textual.app import RenderResult
from textual.widget import Widget

from .bars import figure_text
from .devices import segment_bar

PARTS = [("fwd_ms", "fwd", "#4c8dff"), ("bwd_ms", "bwd", "#b07cff"), ("idle_ms", "idle", "grey42")]
MIN_BAR = 10   # cells a bar keeps before the layer summaries give way


def ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def layer_span(names: list[str]) -> str:
    """A stage's layers in a few characters: each name's stem (up to its first number) once, with
    its numbers as ranges, in the order the stems first come.

    ['embed', 'blocks.0.ln1', 'blocks.0.attn', ..., 'blocks.11.mlp.proj'] -> 'embed, blocks.0-11'
    ['fc0', 'act0', 'fc1', 'act1', 'head'] -> 'fc0-1, act0-1, head'
    """
    stems: dict[str, list[int]] = {}
    for name in names:
        match = re.match(r"(\D*)(\d+)", name)
        numbers = stems.setdefault(match.group(1) if match else name, [])
        if match:
            numbers.append(int(match.group(2)))
    return ", ".join(stem + ranges(numbers) for stem, numbers in stems.items())


def fitted(span: str, count: int, width: int) -> str:
    """`span (count)` in `width` cells: the span cut with an ellipsis, the count always whole."""
    tail = f" ({count})"
    return span + tail if len(span) + len(tail) <= width else span[:max(0, width - len(tail) - 1)] + "…" + tail


class StagesPanel(Widget):
    """`stage 0 embed, blocks.0-2 (19)  ████████▓▓▓▓▓▓▓▓▓▓░░  1.2/3.4/0.5 ms`, one row per stage, under a header
    with the imbalance, the threshold and the micro-batches a step is cut into (the same on every stage)."""

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
        self.extra: list[list[tuple]] = []   # by stage: (label, unit, value) of its declared figures
        self.add_class("-empty")

    def update_stages(self, stages: list[dict] | None, mode: str, imbalance_ms: float | None = None,
                      threshold_ms: float | None = None, migrating: bool = False,
                      figures: list[list[tuple]] | None = None) -> None:
        state = (list(stages or []), mode, imbalance_ms, threshold_ms, migrating, list(figures or []))
        if state == (self.stages, self.mode, self.imbalance_ms, self.threshold_ms, self.migrating, self.extra):
            return
        lines = (len(self.stages), bool(self.labels()))   # a line more or fewer: lay out again
        self.stages, self.mode, self.imbalance_ms, self.threshold_ms, self.migrating, self.extra = state
        self.set_class(not self.stages, "-empty")
        self.refresh(layout=lines != (len(self.stages), bool(self.labels())))

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(self.stages) + 1 + bool(self.labels()) if self.stages else 1

    def labels(self) -> list[str]:
        """The labels of the stages' figures besides their times, in the lines' order."""
        return list(dict.fromkeys(label for more in self.extra for label, _, _ in more))

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
        micro = self.stages[0].get("micro_batches")   # parallel.pipeline.micro_batches (logs from before it lack it)
        for extra in [legend] + ([Text(f"  {micro} micro-batches/step", "dim")] if micro is not None else []):
            if text.cell_len + extra.cell_len <= width:   # each whole or not at all
                text = text + extra
        return text

    def render(self) -> RenderResult:
        if not self.stages:
            return Text(f"no pipeline stages in mode {self.mode}")
        width, height = self.size.width, self.size.height
        top = [self.header(width)]
        if labels := self.labels():   # `· recv wait`, over the values after the times (right-aligned, as they are)
            top.append(Text(" · " + " · ".join(labels), "dim"))
            top[1].align("right", width)
        lines = [*top, *self.stage_lines(width)]
        if len(top) < height < len(lines):   # shorter than its stages: the last line says which are left out
            hidden = self.stages[height - len(top) - 1:]
            first, last = hidden[0].get("stage", "?"), hidden[-1].get("stage", "?")
            lines = [*lines[:height - 1], Text(f"… {len(hidden)} more: stages {first}-{last}", "dim italic")]
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        return Text("\n").join(lines)

    def stage_lines(self, width: int) -> list[Text]:
        """`stage 3 blocks.8-11 (24)  ████▓▓▓▓░░  25.4/50.8/9.2 ms`: every bar on one scale and of one
        width; the layer summaries take what the bars leave, or go when that is too little."""
        longest = max(sum(s.get(f) or 0 for f, _, _ in PARTS) for s in self.stages) or 1.0
        label_w = max(len(f"stage {s.get('stage', '?')}") for s in self.stages) + 1
        extra = self.extra + [[]] * (len(self.stages) - len(self.extra))
        figures = [self.figures(s, more) for s, more in zip(self.stages, extra)]
        figures_w = max(f.cell_len for f in figures)
        spans = [(layer_span(s["layers"]), len(s["layers"])) if s.get("layers") else ("", 0) for s in self.stages]
        span_w = min(max(len(span) + len(f" ({n})") if n else 0 for span, n in spans),
                     width - label_w - figures_w - MIN_BAR - 2)
        span_w = span_w if span_w >= 8 else 0   # too narrow for a useful summary: the bars alone
        bar_w = max(4, width - label_w - (span_w + 2 if span_w else 0) - figures_w)
        lines = []
        for s, figure, (span, count) in zip(self.stages, figures, spans):
            line = Text(f"stage {s.get('stage', '?')}".ljust(label_w), "bold")
            if span_w:
                line.append((fitted(span, count, span_w) if count else "").ljust(span_w + 2), "grey70")
            figure.align("right", figures_w)
            lines.append(line + self.bar(s, longest, bar_w) + figure)
        return lines

    @staticmethod
    def figures(stage: dict, more: list[tuple] = ()) -> Text:
        """`  25.4/50.8/9.2 ms`: fwd / bwd / idle (of its slowest replica, where the stage has several); then
        the replicas' spread, `· 2× 70.1-76.2` (each replica's fwd + bwd, the fastest's and the slowest's); then
        the value of each of `more`, (label, unit, value), as ` · 3.10 ms` (the header's legend names them)."""
        text = Text.assemble(
            "  ", (f"{stage.get('fwd_ms') or 0:.1f}", "#4c8dff"), "/",
            (f"{stage.get('bwd_ms') or 0:.1f}", "#b07cff"), "/",
            (f"{stage.get('idle_ms') or 0:.1f}", "grey62"), " ms")
        spread = stage.get("replicas_ms") or []
        if len(spread) > 1:
            text.append(" · ", "dim").append(f"{len(spread)}× {min(spread):.1f}-{max(spread):.1f}", "grey62")
        for _, unit, value in more:
            text.append(" · ", "dim").append(figure_text(value, unit), "grey62")
        return text

    @staticmethod
    def bar(stage: dict, longest: float, width: int) -> Text:
        # segment_bar works on integers: microseconds keep sub-millisecond stages visible
        parts = [(round((stage.get(f) or 0) * 1000), colour) for f, _, colour in PARTS]
        return segment_bar(parts, round(longest * 1000), width, None)
