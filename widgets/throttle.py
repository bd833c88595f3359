"""Throttle: a panel's repaint at most a few times a second, whatever the rate of its updates.

    self.repaint = Throttle(self, 0.25, self.refill); self.repaint()   # on every update

Imports textual only.
"""

from __future__ import annotations

from time import monotonic

from textual.widget import Widget


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
