"""The sharded plan: who owns which parameters and how each owner's buffer is cut into slices and given
to streams. Pure functions of the model's shape and the seed, the same on every rank.

    owners = assign_owners(sizes, world)        # contiguous runs balanced by bytes, forward-use order
    plan = plan_slices(spans, slices, streams, "balanced", seed)
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
    """Owner of each parameter (given in forward-use order): `world` contiguous runs balanced by
    bytes. A parameter goes to the rank whose share of the total holds its midpoint."""
    total = sum(sizes)
    owners, before = [], 0
    for size in sizes:
        middle = before + size / 2
        owners.append(min(world - 1, int(middle * world / total)) if total else 0)
        before += size
    return owners


def cut(numel: int, pieces: int) -> list[tuple[int, int]]:
    """[start, stop) of `pieces` contiguous, nearly equal ranges of `numel` elements (empty ones left out)."""
    bounds = [numel * i // pieces for i in range(pieces + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def plan_slices(spans: list[list[tuple[int, int, int]]], slices: int, streams: int, assignment: str,
                seed: int) -> list[Slice]:
    """Every owner's buffer cut into `slices`, given to streams, in forward-use order.

    spans[owner] lists (start, stop, layer) of each parameter's elements in that owner's buffer.
    balanced: each slice goes to the stream with the fewest bytes so far (round robin for equal
    slices); random: a seeded choice, identical on every rank.
    """
    found = []
    for owner, owner_spans in enumerate(spans):
        numel = max((stop for _, stop, _ in owner_spans), default=0)
        for start, stop in cut(numel, slices):
            layers = tuple(sorted({layer for a, b, layer in owner_spans if a < stop and b > start}))
            found.append((min(layers), owner, start, stop, layers))
    found.sort()
    rng, load, plan = random.Random(seed), [0] * streams, []
    for _, owner, start, stop, layers in found:
        stream = rng.randrange(streams) if assignment == "random" else min(range(streams), key=load.__getitem__)
        load[stream] += stop - start
        plan.append(Slice(owner, start, stop, stream, layers))
    return plan
