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


def tensors(value) -> list[torch.Tensor]:
    """The tensors in a layer's arguments or output (nested in tuples and lists)."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors(item)]
    return []


def first_tensor(value) -> torch.Tensor | None:
    found = tensors(value)
    return found[0] if found else None


class LayerSpans:
    """The one per-layer timer: each layer's forward and backward spans on a Clock (the device's), marked as
    the work is queued and read once it has run. Three readers mark through one: the layer profiler (the
    console's layer table, the update trial: engine/runtime/profiler.py), a pipeline stage's layer clock
    (the rebalance: engine/strategies/pipeline/rebalance.py) and the activation plan's measuring step
    (engine/techniques/memory/measure.py).

        spans = LayerSpans(clock)
        t0 = spans.clock.mark(); out = layer(x); spans.forward(key, t0)
        spans.backward_from(key, out)           # out's gradient starts key's backward; the next start ends it
        spans.backward_from(key, out, until=x)  # ...or x's gradient ends it (the layer's own, as measure.py wants)
        loss.backward(); spans.end_backward()   # the last start's span ends here
        fwd_ms, bwd_ms, fwd_n, bwd_n = spans.read()   # summed by key, and spans counted; then cleared

    What a span waited for the host link is left out of its time, a layer's own time being what a recompute
    costs: forward's `wait_s`, and backward_from's `waits`, a callable returning (the host's waits in s so far,
    the device's wait marks so far: [(mark, mark), ...])."""

    def __init__(self, clock: Clock | None = None):
        self.clock = clock or Clock()
        self.spans: list[tuple] = []   # ("fwd" or "bwd", key, mark, mark, host wait s, device wait marks)
        self._open = None              # the chain's last start: (key, mark, waits then, waits)

    def forward(self, key, t0, wait_s: float = 0.0) -> None:
        """`key`'s forward began at mark `t0` and ends now, after waiting `wait_s` for the link."""
        self.spans.append(("fwd", key, t0, self.clock.mark(), wait_s, ()))

    def backward_from(self, key, out: torch.Tensor, until: torch.Tensor | None = None, waits=None) -> None:
        if until is None:
            out.register_hook(lambda grad: self._chain(key, waits))
            return
        started = []
        out.register_hook(lambda grad: started.append((self.clock.mark(), _waited(waits))))

        def ended(grad):
            if started:
                t0, before = started.pop()
                self._close(key, t0, before, waits, self.clock.mark())
        until.register_hook(ended)

    def _chain(self, key, waits) -> None:
        now = self.clock.mark()
        if self._open is not None:
            self._close(*self._open, now)
        self._open = (key, now, _waited(waits), waits)

    def _close(self, key, t0, before, waits, t1) -> None:
        (w0, n0, _), (w1, n1, marks) = before, _waited(waits)
        self.spans.append(("bwd", key, t0, t1, w1 - w0, tuple(marks[n0:n1])))

    def end_backward(self) -> None:
        if self._open is not None:
            self._close(*self._open, self.clock.mark())
            self._open = None

    def read(self) -> tuple[dict, dict, dict, dict]:
        """Milliseconds summed by key for forward and backward (each span less its waits, at least 0), and
        how many spans each; clears the spans. A GPU waits here for each span's end mark (clock.ms), so a step
        that marked nothing (a stage's unarmed step) waits for nothing: the clock is the step times' too."""
        ms, count = ({}, {}), ({}, {})
        for kind, key, a, b, wait_s, stalls in self.spans:
            side = kind == "bwd"
            stalled = sum(self.clock.ms(s0, s1) for s0, s1 in stalls)
            ms[side][key] = ms[side].get(key, 0.0) + max(0.0, self.clock.ms(a, b) - wait_s * 1000 - stalled)
            count[side][key] = count[side].get(key, 0) + 1
        self.spans, self._open = [], None
        return ms[0], ms[1], count[0], count[1]

    def clear(self) -> None:
        """Forget what was marked (a step that is not a cost)."""
        self.spans, self._open = [], None


def _waited(waits) -> tuple[float, int, list]:
    """(the host's waits in s, how many device wait marks, those marks) so far."""
    if waits is None:
        return 0.0, 0, ()
    host_s, marks = waits()
    return host_s, len(marks), marks
