"""The sharded strategy's backward: each bucket of an owner's consecutive slices goes to its owner once
backward has made its gradients (across hosts through the owner's relay on this host, which adds this host's
parts first), and the owner adds what it receives, in sender order. ShardedStrategy's collaborator
(strategy.py): it owns the buckets and their state.

    reduce = GradientReduce(plan, params, owners, offsets, grad_flat, topo, tiers, times, reduce_dtype)
    reduce.begin_step()         # before the step's forward: counts reset, the others' parts awaited
    reduce.accumulating = True  # a micro-step before the last: gradients stay here
    reduce.finish()             # after backward: every bucket sent, this rank's shard summed

Imports torch.distributed and the sharded plan (buckets).
"""

from __future__ import annotations

import bisect
import queue
import threading

import torch
import torch.distributed as dist

from engine.strategies.sharded.plan import reduce_buckets


class GradientReduce:
    """The gradient path: the buckets, the gradients each still waits for, the buffers the others' parts land
    in, the sends and receives in flight and the relay thread are its own; the flat gradient buffers, the
    groups, the tiers and the step's clock are the strategy's."""

    def __init__(self, plan, params: list, owners: list[int], offsets: list[int], grad_flat: list[torch.Tensor],
                 topo, tiers, times, reduce_dtype: torch.dtype):
        self.grad_flat, self.topo, self.tiers, self.times = grad_flat, topo, tiers, times
        self.world, self.rank = topo.world_size, topo.rank
        self.reduce_dtype = reduce_dtype   # bf16 gradients travel as bf16 and are summed in this dtype
        self.accumulating = False   # a micro-step before the last: gradients go to their owners after the last
        self.buckets = reduce_buckets(plan, self.world, params[0].element_size() if params else 4)
        starts = [[b.start for b in self.buckets if b.owner == o] for o in range(self.world)]
        ids = [[i for i, b in enumerate(self.buckets) if b.owner == o] for o in range(self.world)]
        buckets_of = []   # each parameter's buckets: its gradient completes its part of each
        for p, owner, off in zip(params, owners, offsets):
            first = max(bisect.bisect_right(starts[owner], off) - 1, 0)
            last = bisect.bisect_left(starts[owner], off + p.numel())
            buckets_of.append([ids[owner][j] for j in range(first, last) if self.buckets[ids[owner][j]].stop > off])
        self._expected = [0] * len(self.buckets)
        for found in buckets_of:
            for i in found:
                self._expected[i] += 1
        self._remaining = list(self._expected)
        self._sent: set[int] = set()
        self._sends: list = []
        self._recvs: dict[int, list] = {}
        relayed_owners = set(tiers.relayed(self.world)) if tiers else set()
        self.relayed = [i for i, b in enumerate(self.buckets) if b.owner in relayed_owners]
        self.t0 = None   # this step's first send: the reduce's span runs from it to the last sum
        # a relay sums and sends on a thread of its own, each bucket as soon as its parts are in, while
        # backward goes on with earlier layers
        self._relay_queue: queue.Queue = queue.Queue()
        self._relay_done = threading.Event()
        self._relay_left, self._relay_error = 0, None
        self._relay_thread = None
        if self.relayed:
            self._relay_thread = threading.Thread(target=self._relay_loop, daemon=True, name="sharded-relay")
            self._relay_thread.start()
        # bucket -> {sender: buffer}: this rank's own buckets, then those it relays
        relayed = set(self.relayed)
        dtype, dev = grad_flat[0].dtype, grad_flat[0].device
        self.incoming = {i: {q: torch.empty(b.numel, dtype=dtype, device=dev) for q in self._senders(b.owner)}
                         for i, b in enumerate(self.buckets) if b.owner == self.rank or i in relayed}
        # NCCL matches one pair's messages in the order they are posted, whatever their tags: every pair's buckets
        # go, and are received, in one order, the highest first (backward makes the last layers' gradients
        # first); a bucket ready early waits for those before it in that order. {destination: [bucket]}: those
        # this rank sends from backward, and the sums it relays (to their owners on other hosts)
        self._direct_to: dict[int, list[int]] = {}
        self._relay_to: dict[int, list[int]] = {}
        for i in reversed(range(len(self.buckets))):
            b = self.buckets[i]
            if i in relayed:
                self._relay_to.setdefault(b.owner, []).append(i)
            elif b.owner != self.rank:
                self._direct_to.setdefault(self._first_hop(b.owner), []).append(i)
        self._ready: dict[int, torch.Tensor] = {}         # bucket -> buffer, ready to go, not yet sent
        self._relay_ready: dict[int, torch.Tensor] = {}
        self._next: dict[int, int] = {}                    # destination -> its next bucket's place in its order
        self._relay_next: dict[int, int] = {}
        for p, found in zip(params, buckets_of):
            p.register_post_accumulate_grad_hook(self._grad_ready(found))

    def begin_step(self) -> None:
        """Before the step's forward: every bucket waits for all its gradients again, and the others' parts of
        this rank's buckets (and those it relays) are awaited."""
        self._remaining, self._sent, self.t0 = list(self._expected), set(), None
        self._relay_left, self._relay_error = len(self.relayed), None
        self._relay_done.clear()
        self._ready, self._relay_ready = {}, {}
        self._next, self._relay_next = dict.fromkeys(self._direct_to, 0), dict.fromkeys(self._relay_to, 0)
        # posted in each pair's one order (the highest bucket first), as the senders send them
        self._recvs = {i: [dist.irecv(buffer, src=q, group=self.topo.compute, tag=i)
                           for q, buffer in self.incoming[i].items()]
                       for i in sorted(self.incoming, reverse=True)}

    def finish(self) -> None:
        """After backward: the buckets whose gradients never all came go now; then this rank's shard is summed."""
        for i in reversed(range(len(self.buckets))):
            if i not in self._sent:
                self._reduce(i)
        self._sum_onto_owner()

    def close(self) -> None:
        if self._relay_thread is not None:
            self._relay_queue.put(None)
            self._relay_thread.join(timeout=5)

    def _grad_ready(self, buckets: list[int]):
        def hook(param) -> None:
            if self.accumulating:   # a micro-step before the last: the gradient stays here
                return
            for i in buckets:
                self._remaining[i] -= 1
                if self._remaining[i] == 0:
                    self._reduce(i)
        return hook

    def _senders(self, owner: int) -> list[int]:
        """Who sends `owner`'s gradients to this rank (this rank being the owner or its relay)."""
        if self.tiers is None:
            return [q for q in range(self.world) if q != self.rank]
        t = self.tiers
        local = [q for q in t.host_ranks() if q != self.rank]
        return local + ([t.relay_on(h, owner) for h in range(self.world // t.k) if h != t.host]
                        if owner == self.rank else [])

    def _reduce(self, i: int) -> None:
        """Bucket `i`'s gradients are complete here: to its owner (or its relay), tagged with the bucket."""
        if self.t0 is None:
            self.t0 = self.times.mark()
        self._sent.add(i)
        s = self.buckets[i]
        buffer = self.grad_flat[s.owner][s.start:s.stop]
        if buffer.dtype == self.reduce_dtype:   # the mean, as DDP's hook divides before it sums
            buffer.div_(self.world)             # (a wider sum divides once, at the owner: _sum_into)
        if i in self.incoming and s.owner != self.rank:
            self._relay_queue.put(i)   # the relay thread adds this host's parts and sends the sum
            return
        if s.owner == self.rank:
            return
        dst = self._first_hop(s.owner)
        self._ready[i] = buffer
        self._flush(self._direct_to[dst], self._next, self._ready, dst)

    def _first_hop(self, owner: int) -> int:
        """Where this rank sends `owner`'s buckets: across hosts, to the owner's relay on this host (on the owner's
        own host, that is the owner)."""
        return owner if self.tiers is None else self.tiers.relay_on(self.tiers.host, owner)

    def _flush(self, order: list[int], at: dict[int, int], ready: dict[int, torch.Tensor], dst: int) -> None:
        """Send `dst`'s buckets in its one order, from where it stands, as far as they are ready."""
        k = at[dst]
        while k < len(order) and order[k] in ready:
            i = order[k]
            self._sends.append(dist.isend(ready.pop(i), dst=dst, group=self.topo.compute, tag=i))
            k += 1
        at[dst] = k

    def _relay_loop(self) -> None:
        while (i := self._relay_queue.get()) is not None:
            try:
                for work in self._recvs.get(i, ()):
                    work.wait()
                s = self.buckets[i]
                total = self.grad_flat[s.owner][s.start:s.stop]
                self._sum_into(total, [self.incoming[i][q] for q in sorted(self.incoming[i])])
                self._relay_ready[i] = total
                self._flush(self._relay_to[s.owner], self._relay_next, self._relay_ready, s.owner)
            except BaseException as e:   # raised on the main thread, in _sum_onto_owner
                self._relay_error = e
            finally:
                self._relay_left -= 1
                if self._relay_left == 0:
                    self._relay_done.set()

    def _sum_onto_owner(self) -> None:
        """Wait for the relay thread to have sent this host's sums across; then for the others' parts of this
        rank's shard, and add them (in sender order); then for this rank's sends."""
        if self.relayed:
            if not self._relay_done.wait(timeout=self.topo.timeout_s):
                raise RuntimeError(f"the gradient sums this rank relays were not sent within "
                                   f"{self.topo.timeout_s:g} s")
            if self._relay_error is not None:
                raise RuntimeError(f"relaying gradients to another host failed: {self._relay_error}") \
                    from self._relay_error
        mine = self.grad_flat[self.rank]
        for i, parts in self.incoming.items():
            s = self.buckets[i]
            if s.owner != self.rank:
                continue
            for work in self._recvs.get(i, ()):
                work.wait()
            self._sum_into(mine[s.start:s.stop], [parts[q] for q in sorted(parts)], owner=True)
        for work in self._sends:
            work.wait()
        self._sends, self._recvs = [], {}

    def _sum_into(self, target: torch.Tensor, parts: list[torch.Tensor], owner: bool = False) -> None:
        """Add `parts` to `target` in sender order: in place in their own dtype, or (bf16 gradients under
        precision.reduce = "fp32") widened, summed, divided by the world at the owner, and stored back."""
        if target.dtype == self.reduce_dtype:
            for part in parts:
                target.add_(part)
            return
        total = target.to(self.reduce_dtype)
        for part in parts:
            total.add_(part)
        if owner:
            total.div_(self.world)
        target.copy_(total)
