"""Timing work on the device. On a GPU a layer's kernels run after the Python that queued them has
returned, so a host clock around the layer measures its launch, not its work; a Clock marks points in
the device's stream of work instead, and reads the intervals once that work has run.

    clock = Clock(device)        # CUDA events (enable_timing) on a GPU, perf_counter on the CPU
    a = clock.mark(); ...; b = clock.mark()  # on the current stream: where the work queued so far ends
    clock.settle()               # after the step: waits for the last mark (a GPU; nothing on the CPU)
    ms = clock.ms(a, b)

    times = StepTimes(clock, ("fwd_ms", "bwd_ms"))   # a step's named spans, read without a synchronize
    a = times.mark(); ...; times.add("fwd_ms", a, times.mark())
    timings = times.end_step()   # this step's ms per name, or on a GPU maybe the step before (see StepTimes)

The planners that take measured times (the activation plan, the update placement, the pipeline's
balance) read them through a Clock, and the strategies' per-step times through a StepTimes.
`events`: a stand-in for the CUDA event constructor (tests). Imports torch only.
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

    def wait(self, mark) -> None:
        """Wait until the work up to `mark` has run (nothing on the CPU)."""
        if self.events is not None:
            mark.synchronize()

    def done(self, mark) -> bool:
        """Has the work up to `mark` run? (Never blocks; always true on the CPU.)"""
        return self.events is None or mark.query()

    def ms(self, a, b) -> float:
        """Milliseconds from mark `a` to mark `b` (on a GPU, waiting for `b` if `settle` has not)."""
        if self.events is None:
            return (b - a) * 1000
        b.synchronize()
        return a.elapsed_time(b)


class StepTimes:
    """A step's named spans on a Clock (spans of one name add up), read after the step without a
    synchronize. On the CPU `end_step` returns the step just ended, exactly. On a GPU it does too
    when the step's work has run by then (the strategy read its loss with .item(), which waits for
    it); otherwise it returns the step before, waiting for that step's last mark if need be (the host
    has queued a whole step since: backpressure, never a stall of the device), and the step just
    ended is read at the next `end_step`. So a GPU's figures are at most one step late."""

    def __init__(self, clock: Clock, names: tuple[str, ...]):
        self.clock, self.names = clock, tuple(names)
        self._spans: list = []      # (name, a, b) of the step in progress
        self._last = None           # its last mark: once that has run, all of its marks have
        self._ended: list = []      # ended steps not read yet: (spans, last mark)
        self.latest = dict.fromkeys(self.names, 0.0)

    def mark(self):
        self._last = self.clock.mark()
        return self._last

    def add(self, name: str, a, b) -> None:
        self._spans.append((name, a, b))

    def begin_step(self) -> None:
        """Forget spans marked since the last step ended (outside a step: an evaluation's forward)."""
        self._spans, self._last = [], None

    def end_step(self) -> dict[str, float]:
        """Milliseconds per name of the latest ended step whose work has run (every name; 0 if unmarked)."""
        self._ended.append((self._spans, self._last))
        self._spans, self._last = [], None
        while self._ended:
            spans, last = self._ended[0]
            if last is not None and not self.clock.done(last):
                if len(self._ended) == 1:
                    break   # the step just queued: read at the next end_step
                self.clock.wait(last)
            self._ended.pop(0)
            out = dict.fromkeys(self.names, 0.0)
            for name, a, b in spans:
                out[name] = out.get(name, 0.0) + self.clock.ms(a, b)
            self.latest = out
        return dict(self.latest)
