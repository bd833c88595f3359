"""The sharded plan: who owns which parameters and how each owner's buffer is cut into slices and given
to streams. Pure functions of the model's shape and the seed, the same on every rank.

    owners = assign_owners(sizes, world)        # interleaved, balanced by bytes
    layer_owners = plan_owners(stages, layer_sizes, replicas)   # a pipeline's sharded replicas: whole layers
    plan = plan_slices(spans, slices, streams, "balanced", seed)
    buckets = reduce_buckets(plan, world, itemsize)   # the slices, merged up to 1 MiB: the gradients' messages
"""

from __future__ import annotations

import random
from dataclasses import dataclass


# --- the plan: pure functions of the model's shape, the same on every rank ---------------

@dataclass(frozen=True)
class Slice:
    """One broadcast: elements [start, stop) of `owner`'s flat buffer, sent on `stream`."""
    owner: int
    start: int
    stop: int
    stream: int
    layers: tuple[int, ...]   # the layers whose parameters it carries

    @property
    def numel(self) -> int:
        return self.stop - self.start


def assign_owners(sizes: list[int], world: int) -> list[int]:
    """Owner of each parameter (given in forward-use order), interleaved: each goes to the rank with the
    fewest bytes so far (ties: the lowest). Every owner's parameters run through the whole forward, so
    every owner's slices go out at once, in forward-use order, and each link carries traffic both ways
    (owners in contiguous runs sent rank 0's half first, then rank 1's: one direction idled, and the
    broadcast took twice the line rate over a 1 Gbit/s link). Off the ideal share by less than one
    parameter; equal sizes go round robin."""
    load, owners = [0] * world, []
    for size in sizes:
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += size
        owners.append(rank)
    return owners


def plan_owners(stages: list[list[int]], sizes: dict[int, int], replicas: int,
                keep: dict[int, int] | None = None) -> dict[int, int]:
    """A pipeline's sharded replicas (engine/strategies/pipeline/shards.py): each layer's owner among its stage's
    `replicas`, stage by stage (`stages`: each stage's layer indices). A layer in `keep` (the caller passes the
    layers that stay in their stage) keeps its owner; every other layer with parameters goes to the replica with
    the fewest bytes so far, in forward order (ties: the lowest). A layer without parameters (size 0) has none."""
    keep = keep or {}
    owners: dict[int, int] = {}
    for layers in stages:
        load = [0] * replicas
        for i in layers:
            if i in keep and sizes.get(i, 0):
                owners[i] = keep[i]
                load[keep[i]] += sizes[i]
        for i in layers:
            if i not in owners and sizes.get(i, 0):
                owners[i] = min(range(replicas), key=lambda r: (load[r], r))
                load[owners[i]] += sizes[i]
    return owners


def cut(numel: int, pieces: int) -> list[tuple[int, int]]:
    """[start, stop) of `pieces` contiguous, nearly equal ranges of `numel` elements (empty ones left out)."""
    bounds = [numel * i // pieces for i in range(pieces + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def plan_slices(spans: list[list[tuple[int, int, int]]], slices: int, streams: int, assignment: str,
                seed: int) -> list[Slice]:
    """Every owner's buffer cut into `slices`, given to streams, in forward-use order (the order the next
    forward needs them, every owner's interleaved). A slice's update goes out as one broadcast, and its gradients
    travel to the owner in a bucket of whole slices (reduce_buckets) once backward has made them.

    spans[owner] lists (start, stop, layer) of each parameter's elements in that owner's buffer.
    balanced: each slice goes to the owner's stream (owner_streams) with the fewest bytes so far (round
    robin for equal slices); random: a seeded choice, identical on every rank.
    """
    found = []
    for owner, owner_spans in enumerate(spans):
        numel = max((stop for _, stop, _ in owner_spans), default=0)
        for start, stop in cut(numel, slices):
            layers = tuple(sorted({layer for a, b, layer in owner_spans if a < stop and b > start}))
            found.append((min(layers), owner, start, stop, layers))
    found.sort()
    rng, load, plan = random.Random(seed), [0] * streams, []
    world = len(spans)
    for _, owner, start, stop, layers in found:
        if assignment == "random":
            stream = rng.randrange(streams)
        else:
            stream = min(owner_streams(owner, world, streams), key=lambda st: (load[st], st))
        load[stream] += stop - start
        plan.append(Slice(owner, start, stop, stream, layers))
    return plan


def owner_streams(owner: int, world: int, streams: int) -> list[int]:
    """The streams `balanced` gives an owner's slices: its own, so that while any owner has slices left its
    streams carry them (a stream runs its broadcasts one after another: one shared by two owners would
    send one owner's slice, then the other's, and each direction of a link would idle in turn)."""
    own = [st for st in range(streams) if st % world == owner % world] if streams >= world else []
    return own or [owner % streams]


REDUCE_BUCKET_BYTES = 1 << 20   # a gradient message carries at least this much, as DDP's first bucket does


@dataclass(frozen=True)
class Bucket:
    """Elements [start, stop) of `owner`'s flat gradient buffer: one message to the owner in backward."""
    owner: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def reduce_buckets(plan: list[Slice], world: int, itemsize: int,
                   min_bytes: int = REDUCE_BUCKET_BYTES) -> list[Bucket]:
    """The units the gradients travel to their owners in: each owner's slices, in buffer order, merged until a
    unit holds `min_bytes` (a small model's slices would otherwise cost a message each, about 20% of a step in
    the tests' tiny models; the bench's 2.6 MB slices stay one each). Owner by owner."""
    out = []
    for owner in range(world):
        start = stop = None
        for a, b in sorted((s.start, s.stop) for s in plan if s.owner == owner):
            start, stop = (a if start is None else start), b
            if (stop - start) * itemsize >= min_bytes:
                out.append(Bucket(owner, start, stop))
                start = None
        if start is not None:
            out.append(Bucket(owner, start, stop))
    return out
