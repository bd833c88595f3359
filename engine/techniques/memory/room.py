"""What a pipeline's stages can hold, as the rebalancer asks it: a layout is only chosen when every stage's
layers fit its capacity with every free layer recomputed (the least the planner falls back to), by the cost
model (cost.py).

    room = policy.room(stage.layer_static_bytes())     # every rank: its capacity, in-flight micro-batches,
                                                        # its layers' measured costs and device bytes
    floors = Floors(names, rooms)                       # the last stage, from every rank's Room
    floors.fits(stage, a, b)                            # layers names[a:b] on that stage: within its capacity?

A stage of layers a..b-1 holds, with each free layer recomputed (an operator's set-policy choice stays):
its own bytes besides layers (`extra_bytes`), the layers' weights, gradients and device optimizer state,
`in_flight - 1` micro-batches of every layer's resident bytes, and the one micro-batch walking its backward
(activation_peak's walk, without swap prefetches: a floor of recompute). Every (a, b) is O(1) after an
O(layers) pass per a: a check deciding 64 stages of 203 layers took 1.5 s with the floors against 0.4 s
without (this 2-core machine), on the last stage, once a check.
Imports only cost.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.techniques.memory.cost import ActivationCost, resident_bytes


@dataclass
class Room:
    """One stage's memory as the rebalancer sees it (sent to the last stage at a check)."""

    capacity_bytes: int
    in_flight: int                     # micro-batches whose activations the stage holds at once
    extra_bytes: int                   # held besides its layers: the loss's saved tensors, other state
    costs: dict[str, ActivationCost] = field(default_factory=dict)   # measured, of the layers it runs
    static: dict[str, int] = field(default_factory=dict)              # device bytes that travel with a layer
    pinned: dict[str, str] = field(default_factory=dict)              # the operator's set-policy choices


class Floors:
    """The modelled least bytes of any contiguous run of layers on any stage (see the module docstring).
    A layer never measured counts only its static bytes."""

    def __init__(self, names: list[str], rooms: list[Room]):
        costs: dict[str, ActivationCost] = {}
        static: dict[str, int] = {}
        pinned: dict[str, str] = {}
        for room in rooms:
            costs.update(room.costs)
            static.update(room.static)
            pinned.update(room.pinned)
        self.rooms = rooms
        policies = [pinned.get(name, "recompute") for name in names]
        self.resident, self.own, self.shared = [], [], []
        for k, name in enumerate(names):
            cost, policy = costs.get(name), policies[k]
            after = policies[k + 1] if k + 1 < len(names) else "keep"
            self.resident.append(resident_bytes(cost, policy, after) if cost else 0)
            self.own.append(cost.act_bytes if cost and policy != "keep" else 0)
            # as a stage's last layer: what it shares with the next one stays (no next layer there frees it)
            self.shared.append(resident_bytes(cost, policy, "keep") - self.resident[-1] if cost else 0)
        self.res_sum = _prefix(self.resident)
        self.static_sum = _prefix([static.get(name, 0) for name in names])
        self._tops: dict[int, list[int]] = {}

    def floor(self, stage: int, a: int, b: int) -> int:
        """Bytes the stage would hold at least with layers a..b-1."""
        room = self.rooms[stage]
        if b <= a:
            return room.extra_bytes
        last = self.res_sum[b] - self.res_sum[a] + self.shared[b - 1]   # held through layer b-1's forward
        total = last
        walk = max(total, self._top(a)[b - 1] - self.res_sum[a], last + self.own[b - 1])
        return room.extra_bytes + self.static_sum[b] - self.static_sum[a] + (room.in_flight - 1) * total + walk

    def fits(self, stage: int, a: int, b: int) -> bool:
        return self.floor(stage, a, b) <= self.rooms[stage].capacity_bytes

    def _top(self, a: int) -> list[int]:
        """top[b]: the most the backward walk holds at layers a..b-1 but the stage's last, res_sum[k+1] + own[k]."""
        top = self._tops.get(a)
        if top is None:
            top, best = [0] * (len(self.own) + 1), self.res_sum[a]
            for k in range(a, len(self.own)):
                best = max(best, self.res_sum[k + 1] + self.own[k])
                top[k + 1] = best
            self._tops[a] = top
        return top


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
