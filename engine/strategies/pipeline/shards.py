"""Stages x replicas with `data = "sharded"`: within a stage's group of replicas, each layer's update has one owner
(techniques 1 and 2 inside technique 4).

    shards = StageShards(stage, settings)        # every rank, after the stage's groups exist
    shards.mine(start, end)                      # the layers whose updates this replica runs
    seconds = shards.reduce(start, end)          # after backward: each layer's gradients summed onto its owner
    shards.broadcast(start, end, updater)        # after the update: each owner's layers out, sliced, on streams
    (next step: a layer's forward waits only for the slices carrying its parameters: the gate)
    routes = shards.migrate(old, new)            # a migration: who owns each layer after it, and who before

The owner is a replica of the stage (0..R-1), the same for every parameter of a layer, so a layer's update, its
optimizer state and its fp32 masters live on one rank of the group: a stage's optimizer state is spread over its
replicas, one copy. Owners are planned greedily in forward order, each layer to the replica with the fewest
parameter bytes so far (ties: the lowest). A migration keeps the owner of every layer that stays; an arriving
layer goes to the least-loaded replica of its new stage, and its optimizer state travels owner to owner
(migration.py: one copy, not one per replica); its weights go to every replica. The slices are planned from the
layout at each change (the cutover of a migration): each owner's layers in forward order, a layer bigger than
the stage's bytes over `parallel.sharded.slices` cut in pieces, every piece to the least-loaded of
`parallel.sharded.streams` stream groups (one process group per stream per stage: on a GPU each its own NCCL
communicator and CUDA stream).

Gradients go to their owner on the stage's group, bucket by bucket as the step's last backward makes them (one
owner and dtype a bucket: replicas.py Overlap), and the rest after it, one reduce per owner and dtype (the sum,
then divided by the replicas: the mean over the replicas' shares, as ddp's average); a non-owner forgets them.
The step guard's norm then runs over the world (each parameter's gradient is on its owner only). A host-placed
layer's slices go out once its update has landed. A weight tied across stages is settled (its slices waited
for) before the pipeline returns it to the other holders (tied.py).

Imports torch.distributed, replicas.py's Overlap and the sharded strategy's plan (`cut`, `plan_owners`: pure
functions).
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from engine.runtime.devices import tensor_bytes
from engine.strategies.pipeline.replicas import Overlap
from engine.strategies.sharded.plan import cut, plan_owners


class _Piece:
    """One broadcast: elements [a, b) of layer `layer`'s flattened parameters, from its owner, on a stream."""
    __slots__ = ("layer", "a", "b", "stream", "work", "buffer")

    def __init__(self, layer: int, a: int, b: int, stream: int):
        self.layer, self.a, self.b, self.stream = layer, a, b, stream
        self.work = self.buffer = None


class StageShards:
    def __init__(self, stage, settings):
        self.stage, self.grid, self.topo = stage, stage.grid, stage.topo
        self.replicas, self.replica = stage.grid.replicas, stage.replica
        self.group = stage.replicas.stage_group
        self.slices, self.streams = settings.slices, settings.streams
        self.overlap_forward = settings.overlap_forward
        stage_lists = [self.grid.group_of(s) for s in range(self.grid.stages)]
        self.stream_groups = [stage.topo.subgroups(stage_lists) for _ in range(self.streams)]
        self.sizes = {i: sum(tensor_bytes(p) for p in ps) for i, ps in stage.owned.items()}
        self.owners = plan_owners(self._layouts(stage.stage_layers), self.sizes, self.replicas)
        self.pending: dict[int, list[_Piece]] = {}   # layer -> its pieces still in flight
        # the reduce overlaps the step's last backward, bucket by bucket (replicas.py Overlap), each to its owner
        self.overlap = Overlap(lambda b: dist.reduce(b.flat, dst=self.grid.rank(self.stage.rank, b.key),
                                                     group=self.group, async_op=True))
        self.gate_s = 0.0
        self._hooks = [layer.register_forward_pre_hook(self._gate(i)) for i, layer in enumerate(stage.model.layers)]

    def _layouts(self, stage_layers: list[list[str]]) -> list[list[int]]:
        index = self.stage.model.names.index
        return [[index(n) for n in names] for names in stage_layers]

    def owner_rank(self, stage: int, layer: int) -> int:
        """The global rank of `layer`'s owner in `stage`'s group."""
        return self.grid.rank(stage, self.owners[layer])

    def mine(self, start: int, end: int) -> dict[int, list]:
        """Each layer's parameters where this replica owns its update (else none)."""
        owned = self.stage.owned
        return {i: ps if start <= i < end and self.owners.get(i) == self.replica else [] for i, ps in owned.items()}

    def migrate(self, old: list[list[str]], new: list[list[str]]) -> dict[int, tuple[int, int]]:
        """The owners after `old` becomes `new` (staying layers keep theirs); returns, for every layer that
        changes stage, (its owner before, its owner after). Every rank computes the same."""
        before, after = self._layouts(old), self._layouts(new)
        stage_before = {i: s for s, layers in enumerate(before) for i in layers}
        keep = {i: o for i, o in self.owners.items()
                if any(i in layers and stage_before[i] == s for s, layers in enumerate(after))}
        owners = plan_owners(after, self.sizes, self.replicas, keep)
        routes = {i: (self.owners[i], owners[i]) for i in owners if i not in keep and i in self.owners}
        self.owners = owners
        return routes

    # --- gradients onto their owners -----------------------------------------------------------
    def arm(self, params) -> None:
        """Before the step's last backward: `params` (this stage's, a tied weight's left out) get their final
        gradients from it; each bucket of one owner's goes to it as soon as backward has made it."""
        owner = {id(p): self.owners[i] for i, ps in self.stage.owned.items() if i in self.owners for p in ps}
        self.overlap.arm(params, key=lambda p: owner[id(p)])

    def reduce(self, start: int, end: int) -> float:
        """Each layer's gradients (this stage's) summed onto its owner and divided by the replicas; a non-owner
        forgets them: the armed buckets waited for, the rest reduced now. The seconds it took."""
        t0 = time.perf_counter()
        owned = self.stage.owned
        buckets = self.overlap.drain()
        armed = {id(p) for b in buckets for p in b.params}
        for r in range(self.replicas):
            params = [p for i in range(start, end) if self.owners.get(i) == r for p in owned[i] if id(p) not in armed]
            by_dtype: dict = {}
            for p in params:
                if p.grad is None:   # no gradient here: zeros, so every replica sends the same shapes
                    p.grad = torch.zeros_like(p)
                by_dtype.setdefault(p.grad.dtype, []).append(p)
            dst = self.grid.rank(self.stage.rank, r)
            for ps in by_dtype.values():
                grads = [p.grad for p in ps]
                flat = _flatten_dense_tensors(grads)
                dist.reduce(flat, dst=dst, group=self.group)
                if r == self.replica:
                    flat /= self.replicas
                    for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
                        g.copy_(summed)
                else:
                    for p in ps:
                        p.grad = None
        for bucket in buckets:
            bucket.work.wait()
            if bucket.key == self.replica:
                bucket.flat /= self.replicas
                grads = [p.grad for p in bucket.params]
                for g, summed in zip(grads, _unflatten_dense_tensors(bucket.flat, grads)):
                    g.copy_(summed)
            else:
                for p in bucket.params:
                    p.grad = None
        return time.perf_counter() - t0

    # --- the owners' updates out, sliced, on streams --------------------------------------------
    def broadcast(self, start: int, end: int, updater) -> None:
        """Every layer of [start, end) from its owner to the stage's other replicas, a piece per broadcast, each on
        the least-loaded stream; the next forward of a layer waits for its pieces (`overlap_forward`), or the step
        waits for all of them."""
        self.sync()
        layers = [i for i in range(start, end) if i in self.owners]
        total = sum(self.sizes[i] for i in layers)
        piece_bytes = max(1, total // max(1, self.slices))
        load = [0] * self.streams
        for i in layers:
            if self.owners[i] == self.replica:
                updater.wait_layer(i)   # a host update lands before its weights leave
            params = self.stage.owned[i]
            dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))   # as torch.cat makes it
            flat = _flatten_dense_tensors([p.detach() for p in params]) if self.owners[i] == self.replica else \
                torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
            pieces = max(1, -(-self.sizes[i] // piece_bytes))
            src = self.owner_rank(self.stage.rank, i)
            for a, b in cut(flat.numel(), pieces):
                stream = min(range(self.streams), key=lambda s: (load[s], s))
                load[stream] += (b - a) * flat.element_size()
                piece = _Piece(i, a, b, stream)
                piece.buffer = flat
                piece.work = dist.broadcast(flat[a:b], src=src, group=self.stream_groups[stream], async_op=True)
                self.pending.setdefault(i, []).append(piece)
        if not self.overlap_forward:
            self.sync()

    def _gate(self, index: int):
        def hook(module, args) -> None:
            if index in self.pending:
                t0 = time.perf_counter()
                self.settle([index])
                self.gate_s += time.perf_counter() - t0
        return hook

    def settle(self, layers) -> None:
        """The pieces of `layers` have landed, copied into the parameters (a non-owner's)."""
        for i in layers:
            pieces = self.pending.pop(i, None)
            if not pieces:
                continue
            for piece in pieces:
                try:
                    piece.work.wait()
                except RuntimeError as e:
                    raise RuntimeError(f"broadcast of {self.stage.model.names[i]} from its owner (replica "
                                       f"{self.owners.get(i)} of stage {self.stage.rank}) failed: {e}") from e
            if self.owners.get(i) != self.replica:
                params = self.stage.owned[i]
                with torch.no_grad():
                    for p, v in zip(params, _unflatten_dense_tensors(pieces[0].buffer, params)):
                        p.copy_(v)

    def sync(self) -> None:
        """Every piece in flight has landed."""
        self.settle(list(self.pending))

    def take_gate_ms(self) -> float:
        ms, self.gate_s = self.gate_s * 1000, 0.0
        return ms

    def close(self) -> None:
        self.sync()
        for handle in self._hooks:
            handle.remove()
        self.topo.release(self.stream_groups)
