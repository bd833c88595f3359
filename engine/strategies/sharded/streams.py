"""The sharded strategy's communication: a meter per stream (bytes, busy time, operations in flight), and
across hosts the two-level sum and broadcast (Tiers: one relay per host, each byte crosses once).

    meter = StreamMeter(clock); t0 = meter.started(nbytes); ...; meter.finished(t0); meter.take()
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from engine.runtime.devices import tensor_bytes
from engine.strategies.sharded.plan import Slice
from engine.timing import Clock


# --- stream meters ----------------------------------------------------------------------

class StreamMeter:
    """Bytes, busy time (the union of its operations' launch-to-completion intervals) and
    operations in flight of one communication stream. Completions arrive on the
    backend's threads, hence the lock. Intervals are on the device's clock (engine/timing.py): on a
    GPU the launch is marked on the launching thread's stream and the completion on the stream its
    callback runs on (which waits for the operation); `take` counts those that have run, in the
    order they completed, and leaves the others to the next take, never waiting."""

    def __init__(self, clock: Clock | None = None):
        self.clock = clock or Clock()
        self._lock = threading.Lock()
        self.bytes, self.in_flight = 0, 0
        self._spans: list = []   # (launch, completion) marks not counted yet, in completion order
        self._until = None       # the latest completion counted so far
        self.last = None         # the latest completion's mark (the strategy resets it at each broadcast)

    def started(self, nbytes: int):
        with self._lock:
            self.bytes += nbytes
            self.in_flight += 1
        return self.clock.mark()

    def finished(self, t0) -> None:
        t1 = self.clock.mark()
        with self._lock:
            self.in_flight -= 1
            self._spans.append((t0, t1))
            self.last = t1

    def take(self) -> dict:
        clock, busy_ms = self.clock, 0.0
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


# --- across hosts: two levels -----------------------------------------------------------

class Tiers:
    """The two-level sum and broadcast of a run on several hosts of `k` ranks each (host h holds ranks
    h*k .. h*k+k-1). `within[s]` is this host's group on stream s; `across[s]` the group of the ranks
    with this rank's local index on every host."""

    def __init__(self, rank: int, k: int, within: list, across: list, timeout_s: float):
        self.rank, self.k, self.timeout_s = rank, k, timeout_s
        self.host, self.local = divmod(rank, k)
        self.within, self.across = within, across
        self.queues = [queue.Queue() for _ in within]
        self.threads = [threading.Thread(target=self._issue, args=(st,), daemon=True, name=f"tier-stream{st}")
                        for st in range(len(within))]
        for thread in self.threads:
            thread.start()

    def same_host(self, rank: int) -> bool:
        return rank // self.k == self.host

    def relay_on(self, host: int, owner: int) -> int:
        """The rank on `host` that stands for `owner` there: the one with the owner's local index."""
        return host * self.k + owner % self.k

    def host_ranks(self) -> range:
        return range(self.host * self.k, self.host * self.k + self.k)

    def relayed(self, world: int) -> list[int]:
        """The owners on other hosts this rank relays for."""
        return [o for o in range(world) if not self.same_host(o) and o % self.k == self.local]

    def send(self, index: int, s: "Slice", buffer: torch.Tensor, meter) -> "TierSlot":
        """Start slice `index` across hosts (on this rank's peer group, when it carries the slice), and queue
        its broadcast within the host on the stream's thread."""
        slot = TierSlot(index, self.timeout_s)
        if s.owner % self.k == self.local:
            slot.works.append(dist.broadcast(buffer, src=s.owner, group=self.across[s.stream], async_op=True))
        self.queues[s.stream].put((slot, s, buffer, meter))
        return slot

    def _issue(self, stream: int) -> None:
        while (item := self.queues[stream].get()) is not None:
            slot, s, buffer, meter = item
            try:
                src = self.relay_on(self.host, s.owner)
                if src == self.rank and s.owner != self.rank:
                    slot.works[0].wait()   # a relay passes the slice on once it has arrived
                t0 = meter.started(tensor_bytes(buffer))
                work = dist.broadcast(buffer, src=src, group=self.within[stream], async_op=True)
                work.get_future().then(lambda _fut, m=meter, t=t0: m.finished(t))
                slot.works.append(work)
            except BaseException as e:   # the main thread raises it where it waits for the slice
                slot.error = e
            slot.ready.set()

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        for thread in self.threads:
            thread.join(timeout=5)


class TierSlot:
    """A slice in flight on two levels: what `wait()` waits for, as a gloo work would."""

    def __init__(self, index: int, timeout_s: float):
        self.index, self.timeout_s, self.works, self.error = index, timeout_s, [], None
        self.ready = threading.Event()

    def wait(self) -> None:
        if not self.ready.wait(timeout=self.timeout_s):
            raise RuntimeError(f"slice {self.index} was not passed on within its host in {self.timeout_s:g} s")
        if self.error is not None:
            raise RuntimeError(str(self.error)) from self.error
        for work in self.works:
            work.wait()
