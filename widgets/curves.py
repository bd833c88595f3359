"""Loss and throughput over steps: two plotext plots, redrawn at most 4 times a second.

`add_point(step, loss, samples_per_s)` only records; a timer redraws when something
changed, because building a plotext figure costs far more than a step message.
"""

from __future__ import annotations

from collections import deque
from math import isfinite, nan
from time import monotonic

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.events import Resize
from textual.widget import Widget
from textual.widgets import Sparkline, Static
from textual_plotext import PlotextPlot

KEEP = 500            # points kept per curve
REDRAW_S = 0.25       # at most 4 redraws a second...
PLOT_SHARE = 0.1      # ...and fewer when plots are big: at most 10% of the time plotting
NARROW_COLUMNS = 70   # below this width the plots stack instead of sitting side by side
PLOT_ROWS = 8         # a plot shorter than this is unreadable: show sparklines instead


class TimedPlot(PlotextPlot):
    """A PlotextPlot that remembers how long its last render took."""

    render_s = 0.0

    def render(self):
        start = monotonic()
        result = super().render()
        self.render_s = monotonic() - start
        return result


class Curves(Widget):
    """`loss` beside `samples/s`, both against the step; stacked when narrow, and two
    labelled sparklines when too short for plots."""

    DEFAULT_CSS = """
    Curves { layout: horizontal; height: 1fr; min-height: 2; }
    Curves.-narrow, Curves.-compact { layout: vertical; }
    Curves > TimedPlot { width: 1fr; height: 1fr; }
    Curves > #curves-empty { width: 1fr; height: 1fr; content-align: center middle; color: $text-muted; }
    Curves > .curves-line { height: 1; }
    Curves > .curves-line > Static { width: 18; }
    Curves > .curves-line > Sparkline { width: 1fr; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.steps: deque[int] = deque(maxlen=KEEP)
        self.losses: deque[float] = deque(maxlen=KEEP)
        self.rates: deque[float] = deque(maxlen=KEEP)
        self.dirty = False
        self.last_redraw = float("-inf")
        self.loss_plot = TimedPlot(id="curves-loss")
        self.rate_plot = TimedPlot(id="curves-rate")
        self.lines = [(Static(), Sparkline()) for _ in range(2)]   # the compact form

    def compose(self) -> ComposeResult:
        yield Static("no steps yet", id="curves-empty")
        yield self.loss_plot
        yield self.rate_plot
        for label, spark in self.lines:
            yield Horizontal(label, spark, classes="curves-line")

    def on_mount(self) -> None:
        self.show_plots(False)
        self.set_interval(REDRAW_S, self.redraw)

    def on_resize(self, event: Resize) -> None:
        narrow = event.size.width < NARROW_COLUMNS
        self.set_class(narrow, "-narrow")
        self.set_class(event.size.height < PLOT_ROWS * (2 if narrow else 1), "-compact")
        self.dirty = True
        self.redraw()

    def show_plots(self, show: bool) -> None:
        compact = self.has_class("-compact")
        self.query_one("#curves-empty").display = not show
        self.loss_plot.display = self.rate_plot.display = show and not compact
        for line in self.query(".curves-line"):
            line.display = show and compact

    def add_point(self, step: int, loss: float, samples_per_s: float) -> None:
        # after a restart the log replays steps from the checkpoint: drop the old future
        while self.steps and self.steps[-1] >= step:
            for series in (self.steps, self.losses, self.rates):
                series.pop()
        self.steps.append(step)
        self.losses.append(nan if loss is None else float(loss))
        self.rates.append(nan if samples_per_s is None else float(samples_per_s))
        self.dirty = True

    def clear(self) -> None:
        for series in (self.steps, self.losses, self.rates):
            series.clear()
        self.dirty = True

    def redraw(self) -> None:
        cost_s = self.loss_plot.render_s + self.rate_plot.render_s
        if not self.dirty or monotonic() - self.last_redraw < cost_s / PLOT_SHARE:
            return
        self.dirty, self.last_redraw = False, monotonic()
        self.show_plots(bool(self.steps))
        if not self.steps:
            return
        curves = ((self.loss_plot, self.losses, f"loss {self.losses[-1]:.4g}", "orange"),
                  (self.rate_plot, self.rates, f"samples/s {self.rates[-1]:,.0f}", "cyan"))
        if self.has_class("-compact"):
            for (label, spark), (_, values, title, _) in zip(self.lines, curves, strict=True):
                label.update(title)
                spark.data = [v for v in values if isfinite(v)][-spark.size.width or None:]
            return
        for plot, values, title, colour in curves:
            # a diverged run's nan or inf would break plotext's axis ticks: plot the finite points
            points = [(step, v) for step, v in zip(self.steps, values, strict=True) if isfinite(v)]
            plt = plot.plt
            plt.clear_data()
            plt.title(title)
            if points:
                plt.plot(*zip(*points, strict=True), marker="braille", color=colour)
            plot.refresh()
