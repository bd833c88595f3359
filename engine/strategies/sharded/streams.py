"""The sharded strategy's communication across hosts: the two-level sum and broadcast (Tiers: one relay per
host, each byte crosses once). Each stream's meter is engine/runtime/meter.py's CommMeter.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from engine.runtime.devices import tensor_bytes
from engine.strategies.sharded.plan import Slice


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
