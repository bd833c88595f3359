"""The one meter of a communication stream, every strategy's: bytes, busy time and operations in flight, on the
device's clock, read without waiting; and a step record's `streams` entry from it.

    meter = CommMeter(clock); t0 = meter.started(nbytes); ...; meter.finished(t0)   # completions: any thread
    entry = stream_entry(0, meter.take(), step_ms)
    CommMeter(clock, busy=False)   # a rank whose streams no record reads: bytes, in flight, the last completion
    CommMeter(clock, busy=False, last=False)   # nor its last completion (DDP's other ranks): bytes and in flight,
                                               # no mark at all (on a GPU, two CUDA events per operation fewer)

Busy is the union of the operations' launch-to-completion intervals, so two all-reduces in flight at once count
their overlap once (DDP's buckets overlap; each sharded stream's slices too).

Imports engine.training.timing.
"""

from __future__ import annotations

import threading

from engine.training.timing import Clock


class CommMeter:
    """Bytes, busy time (the union of its operations' launch-to-completion intervals: the time the stream was
    busy, however many operations overlapped) and operations in flight of one communication stream.
    Completions arrive on the
    backend's threads, hence the lock. Intervals are on the device's clock (engine/training/timing.py): on a
    GPU the launch is marked on the launching thread's stream and the completion on the stream its
    callback runs on (which waits for the operation); `take` counts those that have run, in the
    order they completed, and leaves the others to the next take, never waiting.

    `busy=False`: a meter whose busy time nobody reads (every rank but the first: only rank 0's step record
    says its streams, engine/run/report.py). It keeps no interval, and its take() says busy_ms None: one kept per
    operation and never taken grew a rank's memory by about a kilobyte a step (a sharded rank's 8 slices; 20 MB
    in 30,000 steps), without end. Its bytes are still counted (`bench broadcast` reads every rank's).
    `last=False` as well: nobody reads its last completion either (DDP; sharded's broadcast span reads it on every
    rank), so it marks nothing: on a GPU each mark is a CUDA event made and recorded, two per operation."""

    def __init__(self, clock: Clock | None = None, busy: bool = True, last: bool = True):
        self.clock = clock or Clock()
        self._lock = threading.Lock()
        self.bytes, self.in_flight = 0, 0
        self.busy = busy
        self.marks = busy or last   # False: started() returns None and finished() marks nothing
        self._spans: list = []   # (launch, completion) marks not counted yet, in completion order (busy only)
        self._until = None       # the latest completion counted so far
        self.last = None         # the latest completion's mark (sharded resets it at each broadcast; None unmarked)

    def started(self, nbytes: int):
        with self._lock:
            self.bytes += nbytes
            self.in_flight += 1
        return self.clock.mark() if self.marks else None

    def finished(self, t0) -> None:
        t1 = self.clock.mark() if self.marks else None
        with self._lock:
            self.in_flight -= 1
            if self.busy:
                self._spans.append((t0, t1))
            self.last = t1

    @property
    def kept(self) -> int:
        """The intervals waiting for the next take (none where `busy` is False)."""
        return len(self._spans)

    def take(self) -> dict:
        """{"bytes" since the last take, "busy_ms" (None where `busy` is False: not measured, not 0), "in_flight"}."""
        clock, busy_ms = self.clock, 0.0 if self.busy else None
        with self._lock:
            while self._spans and clock.done(self._spans[0][1]):
                t0, t1 = self._spans.pop(0)
                # the part of [t0, t1] after the latest completion counted: t1 - max(t0, until)
                overlap = max(0.0, clock.ms(t0, self._until)) if self._until is not None else 0.0
                busy_ms += max(0.0, clock.ms(t0, t1) - overlap)
                if self._until is None or clock.ms(self._until, t1) > 0:
                    self._until = t1
            out = {"bytes": self.bytes, "busy_ms": busy_ms, "in_flight": self.in_flight}
            self.bytes = 0
        return out


def stream_entry(stream: int, taken: dict, step_ms: float) -> dict:
    """A step record's `streams` entry from a meter's take(): its busy time as a fraction of the step."""
    busy = min(taken["busy_ms"] / step_ms, 1.0) if step_ms > 0 else 0.0
    return {"stream": stream, "bytes": taken["bytes"], "busy_ms": round(taken["busy_ms"], 3),
            "busy_fraction": round(busy, 4), "in_flight": taken["in_flight"]}
