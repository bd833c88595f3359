"""Stages x replicas (grid.py): the process groups a stage's rank needs, and what its replicas do together.

    replicas = Replicas(grid, topo)      # every rank, at the same point: makes every group
    replicas.pipeline                    # this replica's pipeline group (its stages, in order), or the world
    replicas.arm(params)                 # before the step's last backward: its gradients are final as made
    seconds = replicas.average(params)   # after backward: the stage's gradients averaged over its replicas
    replicas.loss(table_losses)          # the step's loss: the replicas' last stages' mean

Each replica takes its share of every global batch; its last stage weighs each micro-batch's loss by its
counted targets over the global batch's, times the replicas (engine/training/loss.py share_loss), so the
mean over the replicas of their gradients, which `average` takes (one all-reduce per dtype on the stage's
group, as DDP's), is the global batch's. A gradient no replica made stays None. With one replica nothing is
made and nothing travels.

The average overlaps the step's last backward, as DDP's buckets do: `arm` cuts the parameters whose gradients
that backward makes final into buckets of about BUCKET_BYTES (reverse order, one dtype each), and a hook on each
parameter's accumulated gradient starts a bucket's all-reduce (async) once all of its gradients are made and
every earlier bucket has started (the same order on every replica: a collective's order is its match). `average`
then waits for them, and all-reduces at once what was not armed or never made (a weight tied across stages,
whose gradient changes after backward; a migration step's layers, whose gradients arrive after it).

Imports torch.distributed.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


BUCKET_BYTES = 25 << 20   # DDP's default bucket_cap_mb


class Bucket:
    """Gradients that travel as one message: `params` (one dtype, and one `key`: the owner they go to)."""
    __slots__ = ("params", "key", "missing", "work", "flat")

    def __init__(self, params: list, key=None):
        self.params, self.key, self.missing, self.work, self.flat = params, key, len(params), None, None


class Overlap:
    """A step's last backward, overlapped with the gradients' exchange: `arm` cuts the parameters it makes final
    into buckets (reverse order, one dtype and key each, about BUCKET_BYTES), a hook on each parameter's
    accumulated gradient counts them, and `start(bucket)` (an async collective: the flat gradients in
    `bucket.flat`, its work returned) runs once a bucket is whole and every earlier one has started: the same
    order on every rank of the group, a collective's match. `drain` starts what was never whole (a gradient never
    made: zeros) and returns the buckets, each to be waited for."""

    def __init__(self, start):
        self.start = start
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        self._started = 0
        self._hooked: set[int] = set()

    def arm(self, params, key=lambda p: None) -> None:
        buckets: list[Bucket] = []
        current: dict = {}   # (dtype, key) -> (params, bytes)
        for p in reversed([p for p in params if p.requires_grad]):
            k = (p.dtype, key(p))
            held, size = current.get(k, ([], 0))
            held.append(p)
            size += p.numel() * p.element_size()
            current[k] = (held, size)
            if size >= BUCKET_BYTES:
                buckets.append(Bucket(held, k[1]))
                del current[k]
            if id(p) not in self._hooked:
                self._hooked.add(id(p))
                p.register_post_accumulate_grad_hook(self._made)
        buckets += [Bucket(held, k[1]) for k, (held, _) in current.items()]
        self._buckets, self._started = buckets, 0
        self._bucket_of = {id(p): b for b in buckets for p in b.params}

    def _made(self, p) -> None:
        bucket = self._bucket_of.pop(id(p), None)
        if bucket is None:
            return
        bucket.missing -= 1
        while self._started < len(self._buckets) and self._buckets[self._started].missing == 0:
            self._launch(self._buckets[self._started])
            self._started += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.flat = _flatten_dense_tensors([p.grad for p in bucket.params])
        bucket.work = self.start(bucket)

    def drain(self) -> list[Bucket]:
        buckets, self._buckets, self._bucket_of = self._buckets, [], {}
        for bucket in buckets:
            if bucket.work is None:
                for p in bucket.params:
                    if p.grad is None:   # never made on this rank: zeros, the same shapes on every rank
                        p.grad = torch.zeros_like(p)
                self._launch(bucket)
        return buckets


class Replicas:
    def __init__(self, grid, topo):
        self.grid, self.count = grid, grid.replicas
        many = grid.replicas > 1
        self.pipeline = topo.subgroups([grid.pipeline(p) for p in range(grid.replicas)]) if many else topo.compute
        self.stage_group = topo.subgroups([grid.group_of(s) for s in range(grid.stages)]) if many else None
        self.loss_ranks = grid.group_of(grid.stages - 1)   # every replica's last stage: whose losses make the step's
        self.overlap = Overlap(lambda b: dist.all_reduce(b.flat, group=self.stage_group, async_op=True))

    def arm(self, params) -> None:
        """Before the step's last backward: `params` (this stage's, a tied weight's left out) get their final
        gradients from it; their average starts bucket by bucket as backward makes them."""
        if self.stage_group is not None:
            self.overlap.arm(params)

    def average(self, params) -> float | None:
        """The gradients of `params` (this stage's) averaged over the stage's replicas; its seconds (None: one
        replica, nothing to do): the armed buckets waited for, the rest all-reduced now."""
        if self.stage_group is None:
            return None
        t0 = time.perf_counter()
        buckets = self.overlap.drain()
        armed = {id(p) for b in buckets for p in b.params}
        by_dtype: dict = {}
        for p in params:
            if p.grad is not None and id(p) not in armed:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.stage_group)
            flat /= self.count
            for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(averaged)
        for bucket in buckets:
            bucket.work.wait()
            bucket.flat /= self.count
            grads = [p.grad for p in bucket.params]
            for grad, averaged in zip(grads, _unflatten_dense_tensors(bucket.flat, grads)):
                grad.copy_(averaged)
        return time.perf_counter() - t0

    def loss(self, losses: list[float]) -> float:
        """The step's loss from every rank's (the exchange's column, as numbers): each replica's last stage's is
        its share's part of the global mean, times the replicas; their mean is the global batch's."""
        return sum(losses[r] for r in self.loss_ranks) / len(self.loss_ranks)
