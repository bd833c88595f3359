"""Loss and throughput over steps as two plotext plots, the learning rate and the gradient norm as a
labelled sparkline each under them; redrawn at most 4 times a second. The loss plot draws the validation loss
of every evaluation beside the training loss (`set_validation`: the eval events' `val_loss`).

`add_point(step, loss, samples_per_s, lr, grad_norm, clipped, skipped)` only records; a timer redraws
when something changed, because building a plotext figure costs far more than a step message.
Every curve is the last KEEP steps. The learning rate's and the gradient norm's lines show once they
have a finite point there: logs from before steps carried them, and runs that neither clip nor skip
(their `grad_norm` is null), draw the loss and the throughput alone. The gradient norm's line counts
the clipped and the skipped steps among them.
"""

from __future__ import annotations

from collections import deque
from math import isfinite, nan
from time import monotonic

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.events import Resize
from textual.geometry import Size
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


class CurveLine(Horizontal):
    """One curve on one row: `grad norm 0.83 ▂▁▃▇▁▂ 3 clipped, 1 skipped`."""

    def __init__(self) -> None:
        super().__init__(classes="curves-line")
        self.label, self.spark, self.note = Static(), Sparkline(), Static(classes="curves-note")

    def compose(self) -> ComposeResult:
        yield from (self.label, self.spark, self.note)

    def show(self, title: str, values, note: str = "") -> None:
        # the whole window, each bar the most of its steps (the sparkline's own buckets): a spike shows
        self.label.update(title)
        self.spark.data = [v for v in values if isfinite(v)]
        self.note.update(f" {note}" if note else "")


class Curves(Widget):
    """`loss` beside `samples/s`, both against the step, with the `lr` and `grad norm` lines under them;
    the plots stacked when narrow, and every curve a labelled sparkline when too short for plots."""

    DEFAULT_CSS = """
    Curves { layout: vertical; height: 1fr; min-height: 2; }
    Curves > #curves-plots { layout: horizontal; height: 1fr; }
    Curves.-narrow > #curves-plots { layout: vertical; }
    Curves > #curves-plots > TimedPlot { width: 1fr; height: 1fr; }
    Curves > #curves-empty { width: 1fr; height: 1fr; content-align: center middle; color: $text-muted; }
    Curves > .curves-line { height: 1; }
    Curves > .curves-line > Static { width: 18; }
    Curves > .curves-line > .curves-note { width: auto; color: $text-muted; }
    Curves > .curves-line > Sparkline { width: 1fr; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.steps: deque[int] = deque(maxlen=KEEP)
        self.losses: deque[float] = deque(maxlen=KEEP)
        self.rates: deque[float] = deque(maxlen=KEEP)
        self.lrs: deque[float] = deque(maxlen=KEEP)
        self.grad_norms: deque[float] = deque(maxlen=KEEP)   # before clipping; nan: not finite, or not computed
        self.clipped: deque[bool] = deque(maxlen=KEEP)
        self.skipped: deque[bool] = deque(maxlen=KEEP)
        self.series = (self.steps, self.losses, self.rates, self.lrs, self.grad_norms, self.clipped, self.skipped)
        self.val_losses: list[tuple[int, float]] = []   # (step, validation loss), every evaluation's
        self.dirty = False
        self.last_redraw = float("-inf")
        self.loss_plot = TimedPlot(id="curves-loss")
        self.rate_plot = TimedPlot(id="curves-rate")
        self.loss_line, self.rate_line = CurveLine(), CurveLine()   # the compact form of the plots
        self.lr_line, self.norm_line = CurveLine(), CurveLine()     # under the plots, or with the lines above

    def compose(self) -> ComposeResult:
        yield Static("no steps yet", id="curves-empty")
        yield Horizontal(self.loss_plot, self.rate_plot, id="curves-plots")
        yield from (self.loss_line, self.rate_line, self.lr_line, self.norm_line)

    def on_mount(self) -> None:
        self.show_curves(False)
        self.set_interval(REDRAW_S, self.redraw)

    def on_resize(self, event: Resize) -> None:
        self.fit(event.size)
        self.dirty = True
        self.redraw()

    def fit(self, size: Size) -> None:
        """Plots when each gets PLOT_ROWS rows after the lr and grad norm lines have theirs; else every curve
        a line."""
        narrow = size.width < NARROW_COLUMNS
        lines = self.has_lr + self.has_grad_norm
        self.set_class(narrow, "-narrow")
        self.set_class(size.height < PLOT_ROWS * (2 if narrow else 1) + lines, "-compact")

    @property
    def has_lr(self) -> bool:
        return any(isfinite(v) for v in self.lrs)

    @property
    def has_grad_norm(self) -> bool:
        return any(isfinite(v) for v in self.grad_norms)

    def show_curves(self, show: bool) -> None:
        compact = self.has_class("-compact")
        self.query_one("#curves-empty").display = not show
        plots = show and not compact
        self.query_one("#curves-plots").display = self.loss_plot.display = self.rate_plot.display = plots
        self.loss_line.display = self.rate_line.display = show and compact
        self.lr_line.display = show and self.has_lr
        self.norm_line.display = show and self.has_grad_norm

    def add_point(self, step: int, loss: float | None, samples_per_s: float | None, lr: float | None = None,
                  grad_norm: float | None = None, clipped: bool = False, skipped: bool = False) -> None:
        # after a restart the log replays steps from the checkpoint: drop the old future
        while self.steps and self.steps[-1] >= step:
            for series in self.series:
                series.pop()
        self.steps.append(step)
        for series, value in ((self.losses, loss), (self.rates, samples_per_s), (self.lrs, lr),
                              (self.grad_norms, grad_norm)):
            series.append(float(value) if isinstance(value, (int, float)) else nan)   # None: not in the record
        self.clipped.append(bool(clipped))
        self.skipped.append(bool(skipped))
        self.dirty = True

    def set_validation(self, points: list[tuple[int, float]]) -> None:
        """Every evaluation's (step, validation loss) so far."""
        if points != self.val_losses:
            self.val_losses, self.dirty = list(points), True

    def clear(self) -> None:
        for series in self.series:
            series.clear()
        self.val_losses = []
        self.dirty = True

    def norm_note(self) -> str:
        """`3 clipped, 1 skipped` among the steps kept; empty when none was."""
        counts = ((sum(self.clipped), "clipped"), (sum(self.skipped), "skipped"))
        return ", ".join(f"{count} {what}" for count, what in counts if count)

    def redraw(self) -> None:
        cost_s = self.loss_plot.render_s + self.rate_plot.render_s
        if not self.dirty or monotonic() - self.last_redraw < cost_s / PLOT_SHARE:
            return
        self.dirty, self.last_redraw = False, monotonic()
        self.fit(self.size)   # the lr and grad norm lines take rows once they have points
        self.show_curves(bool(self.steps))
        if not self.steps:
            return
        val = f" · val {self.val_losses[-1][1]:.4g}" if self.val_losses else ""
        curves = ((self.loss_plot, self.loss_line, self.losses, f"loss {self.losses[-1]:.4g}{val}", "orange"),
                  (self.rate_plot, self.rate_line, self.rates, f"samples/s {self.rates[-1]:,.0f}", "cyan"))
        self.lr_line.show(f"lr {self.lrs[-1]:.3g}", self.lrs)
        self.norm_line.show(f"grad norm {self.grad_norms[-1]:.4g}", self.grad_norms, self.norm_note())
        if self.has_class("-compact"):
            for _, line, values, title, _ in curves:
                line.show(title, values)
            return
        for plot, _, values, title, colour in curves:
            # a diverged run's nan or inf would break plotext's axis ticks: plot the finite points
            points = [(step, v) for step, v in zip(self.steps, values, strict=True) if isfinite(v)]
            plt = plot.plt
            plt.clear_data()
            plt.title(title)
            if points:
                plt.plot(*zip(*points, strict=True), marker="braille", color=colour)
            val_points = [(step, v) for step, v in self.val_losses if isfinite(v) and step >= self.steps[0]]
            if plot is self.loss_plot and val_points:   # the evaluations' validation loss, on the same axes
                plt.plot(*zip(*val_points, strict=True), marker="dot", color="green")
            plot.refresh()
