"""The sharded strategy's backward: each bucket of an owner's consecutive slices goes to its owner once
backward has made its gradients (across hosts through the owner's relay on this host, which adds this host's
parts first), and the owner adds what it receives, in sender order. Part of ShardedStrategy (strategy.py).

Imports torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GradientReduce:
    """ShardedStrategy's gradient path (a mixin: the buckets, buffers, groups and tiers are the strategy's)."""

    def _grad_ready(self, buckets: list[int]):
        def hook(param) -> None:
            if self._accumulating:   # a micro-step before the last: the gradient stays here
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
        if self._reduce_t0 is None:
            self._reduce_t0 = self.times.mark()
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
        # across hosts, to the owner's relay on this host (on the owner's own host, that is the owner)
        dst = s.owner if self.tiers is None else self.tiers.relay_on(self.tiers.host, s.owner)
        self._sends.append(dist.isend(buffer, dst=dst, group=self.topo.compute, tag=i))

    def _relay_loop(self) -> None:
        while (i := self._relay_queue.get()) is not None:
            try:
                for work in self._recvs.get(i, ()):
                    work.wait()
                s = self.buckets[i]
                total = self.grad_flat[s.owner][s.start:s.stop]
                self._sum_into(total, [self.incoming[i][q] for q in sorted(self.incoming[i])])
                self._sends.append(dist.isend(total, dst=s.owner, group=self.topo.compute, tag=i))
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
