"""The planners: per-layer policies for one stage so its modelled peak fits the capacity, and the
refusal (PlanError, naming the smallest capacity that fits) when none does.

    made = plan(costs, capacity_bytes=..., base_bytes=..., in_flight=2, link_bytes_per_ms=...,
                planner="ratio", pinned={"block0.mlp": "swap"})   # a Plan, or raises PlanError

A pure function of measured per-layer costs (cost.py models them; see docs/memory.md, "The
planners"). Layers are ordered by swap cost / recompute cost; the first ones swap while the summed
swap time stays under the stage's forward+backward time, then, while the stage still does not fit
its capacity, the next ones recompute; the rest keep. (Should every layer be changed and the stage
still not fit, the last swapped layers recompute instead.) "reverse" takes the opposite order;
"exhaustive" tries every assignment of up to EXHAUSTIVE_MAX_LAYERS layers and keeps the cheapest
under the model that fits. "ratio" is the default (the best across link rates in `trainyard bench
memory`). ActivationPolicy (policy.py) calls `plan` after a measured step.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from engine.config import format_size
from engine.techniques.memory.cost import POLICIES, ActivationCost, estimate, extra_ms, swap_ms

PLANNERS = ("ratio", "reverse", "exhaustive")
EXHAUSTIVE_MAX_LAYERS = 9    # 3^9 = 19683 assignments, well under a second


class PlanError(RuntimeError):
    """The stage does not fit its capacity even with every layer recomputed, nor with every one swapped."""

    refusal = True   # a restart would meet it again: the run ends (engine/runtime/refusal.py)

    def __init__(self, message: str, min_capacity_bytes: int):
        super().__init__(message)
        self.min_capacity_bytes = min_capacity_bytes


@dataclass
class Plan:
    """One stage's policies, as a planner chose them, with what the model says they hold."""

    policies: dict[str, str]     # every layer of the stage
    estimate_bytes: int          # modelled peak under these policies
    capacity_bytes: int
    planner: str
    budget_ms: float             # the stage's forward+backward time per micro-batch
    note: str = ""


def plan(costs: list[ActivationCost], *, capacity_bytes: int, base_bytes: int, in_flight: int,
         link_bytes_per_ms: float, planner: str = "ratio", pinned: dict[str, str] | None = None) -> Plan:
    """Policies for the layers of one stage (`pinned` ones fixed) so the modelled peak fits the capacity.

    Raises PlanError naming the smallest capacity that fits when even recomputing every free layer
    does not."""
    if planner not in PLANNERS:
        raise ValueError(f"planner must be one of {', '.join(PLANNERS)}, got {planner!r}")
    pinned = dict(pinned or {})
    free = [c for c in costs if c.name not in pinned]
    budget = sum(c.fwd_ms + c.bwd_ms for c in costs)

    def est(policies: dict[str, str]) -> int:
        return estimate(costs, policies, base_bytes, in_flight, link_bytes_per_ms)

    def made(policies: dict[str, str], how: str, note: str = "") -> Plan:
        return Plan(policies=policies, estimate_bytes=est(policies), capacity_bytes=capacity_bytes,
                    planner=how, budget_ms=budget, note=note)

    keep = {c.name: pinned.get(c.name, "keep") for c in costs}
    # the least a stage can hold: every free layer recomputed (it holds only inputs), or every one
    # swapped (it holds nothing between forward and backward, but two layers come back at a time)
    floors = [{**keep, **{c.name: "recompute" for c in free}}, {**keep, **{c.name: "swap" for c in free}}]
    need = min(est(f) for f in floors)
    if need > capacity_bytes:
        why = " with the operator's set-policy choices" if pinned else ""
        raise PlanError(f"the layers {costs[0].name}..{costs[-1].name} need {format_size(need)} ({need} bytes) even "
                        f"with every layer recomputed or every layer swapped{why}, more than the capacity of "
                        f"{format_size(capacity_bytes)} ({capacity_bytes} bytes): the "
                        f"smallest capacity that fits is {format_size(round_up_mib(need))} "
                        f"(device.memory = \"{round_up_mib(need) // 2**20}MiB\")", round_up_mib(need))
    if est(keep) <= capacity_bytes:
        return made(keep, planner)
    how = planner
    if planner == "exhaustive" and len(free) <= EXHAUSTIVE_MAX_LAYERS:
        policies, note = _exhaustive(costs, free, keep, est, capacity_bytes, budget, link_bytes_per_ms), ""
    elif planner == "exhaustive":
        policies, note = _greedy(free, keep, floors, est, capacity_bytes, budget, link_bytes_per_ms, reverse=False)
        how, note = "ratio", (f"{len(free)} layers: more than {EXHAUSTIVE_MAX_LAYERS} for an exhaustive search, "
                              f"planned by ratio" + (f"; {note}" if note else ""))
    else:
        policies, note = _greedy(free, keep, floors, est, capacity_bytes, budget, link_bytes_per_ms,
                                 reverse=planner == "reverse")
    # never a plan the model says is slower than a uniform one that fits: all-recompute, all-swap
    def cost(p: dict[str, str]) -> float:
        return extra_ms(costs, p, budget, link_bytes_per_ms)
    for name, uniform in zip(("recompute", "swap"), floors):
        if est(uniform) <= capacity_bytes and cost(uniform) < cost(policies):
            note = (f"every layer on {name}: modelled {cost(uniform):.2f} ms extra per micro-batch against "
                    f"{cost(policies):.2f} ms for the {how} plan")
            policies = uniform
    return made(policies, how, note)


def order_by_ratio(free: list[ActivationCost], link_bytes_per_ms: float, reverse: bool = False) -> list[ActivationCost]:
    """Layers by swap cost over recompute cost, cheapest swap (relative to its recompute) first. Left out:
    layers that save nothing of their own and share nothing with the layer before (no policy changes
    what they hold); a layer that only saves what the one before saved (a Linear after a ReLU) is in,
    at no swap cost: the storage leaves the device only when neither of the two keeps it."""
    sharing = {b.name for a, b in zip(free, free[1:]) if a.shared_next}
    useful = [c for c in free if c.act_bytes > 0 or c.name in sharing]
    return sorted(useful, key=lambda c: (swap_ms(c, link_bytes_per_ms) / max(c.fwd_ms, 1e-6), c.name),
                  reverse=reverse)


def _greedy(free, keep, floors, est, capacity, budget, link, reverse: bool) -> tuple[dict[str, str], str]:
    policies = dict(keep)
    order = order_by_ratio(free, link, reverse)
    used = sum(swap_ms(c, link) for c in free if policies[c.name] == "swap")
    i = 0
    while i < len(order) and est(policies) > capacity and used + swap_ms(order[i], link) <= budget:
        policies[order[i].name] = "swap"
        used += swap_ms(order[i], link)
        i += 1
    while i < len(order) and est(policies) > capacity:
        policies[order[i].name] = "recompute"
        i += 1
    if est(policies) <= capacity:
        return policies, ""
    # every layer changed and still too big (swapped layers come back for their backward): the last
    # swapped ones recompute instead until it fits; where even that does not fit (layers whose
    # recompute holds as much as they save), everything swaps (plan() checked that one of the two
    # fits). Then layers that need not change any more go back to keep.
    while est(policies) > capacity and any(policies[c.name] == "swap" for c in order):
        last = max(k for k, c in enumerate(order) if policies[c.name] == "swap")
        policies[order[last].name] = "recompute"
    note = "every layer changed did not fit: swapped layers moved to recompute"
    if est(policies) > capacity:
        policies = dict(floors[1])
        note = "every layer changed did not fit: every layer swapped"
    for c in reversed(order):
        if policies[c.name] != "keep" and est({**policies, c.name: "keep"}) <= capacity:
            policies[c.name] = "keep"
    return policies, note


def _exhaustive(costs, free, keep, est, capacity, budget, link) -> dict[str, str]:
    """The assignment with the least modelled extra time (recomputed forwards plus swap time beyond the
    stage's own time) that fits; ties go to fewer bytes swapped, then to fewer changed layers."""
    best, best_key = None, None
    for choice in itertools.product(POLICIES, repeat=len(free)):
        policies = {**keep, **{c.name: p for c, p in zip(free, choice)}}
        if est(policies) > capacity:
            continue
        swapped = sum(c.act_bytes for c, p in zip(free, choice) if p == "swap")
        key = (extra_ms(costs, policies, budget, link), swapped, sum(p != "keep" for p in choice))
        if best_key is None or key < best_key:
            best, best_key = policies, key
    return best


def round_up_mib(n: int) -> int:
    """`n` bytes rounded up to a whole MiB, at least 1 MiB: the capacity a refusal names."""
    return max(1, math.ceil(n / 2**20)) * 2**20
