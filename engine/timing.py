"""Timing work on the device. On a GPU a layer's kernels run after the Python that queued them has
returned, so a host clock around the layer measures its launch, not its work; a Clock marks points in
the device's stream of work instead, and reads the intervals once that work has run.

    clock = Clock(device)        # CUDA events (enable_timing) on a GPU, perf_counter on the CPU
    a = clock.mark(); ...; b = clock.mark()  # on the current stream: where the work queued so far ends
    clock.settle()               # after the step: waits for the last mark (a GPU; nothing on the CPU)
    ms = clock.ms(a, b)

The planners that take measured times (the activation plan, the update placement, the pipeline's
balance) read them through a Clock. `events`: a stand-in for the CUDA event constructor (tests).
Imports torch only.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


class Clock:
    def __init__(self, device: torch.device | None = None, events: Callable[[], object] | None = None):
        self.device = device
        self.events = events or ((lambda: torch.cuda.Event(enable_timing=True))
                                 if device is not None and device.type == "cuda" else None)
        self._last = None

    @property
    def on_device(self) -> bool:
        """Marks are device events, read after `settle`."""
        return self.events is not None

    def mark(self):
        if self.events is None:
            return time.perf_counter()
        event = self.events()
        event.record()
        self._last = event
        return event

    def settle(self) -> None:
        """Wait until the work up to the last mark has run (marks before it are then complete too)."""
        if self._last is not None:
            self._last.synchronize()
            self._last = None

    def done(self, mark) -> bool:
        """Has the work up to `mark` run? (Never blocks; always true on the CPU.)"""
        return self.events is None or mark.query()

    def ms(self, a, b) -> float:
        """Milliseconds from mark `a` to mark `b` (on a GPU, waiting for `b` if `settle` has not)."""
        if self.events is None:
            return (b - a) * 1000
        b.synchronize()
        return a.elapsed_time(b)
