"""The cost model: what a stage holds and how much time it loses under given per-layer policies.

    costs = [ActivationCost("block0.attn", act_bytes=..., in_bytes=..., fwd_ms=..., bwd_ms=...), ...]
    peak = estimate(costs, {"block0.attn": "swap", ...}, base_bytes, in_flight, link_bytes_per_ms)
    lost = extra_ms(costs, policies, budget_ms, link_bytes_per_ms)

Pure functions of measured per-layer costs (measure.py makes the ActivationCosts from a measured step;
planner.py searches policies with them; docs/memory.md, "The model"). Swapping a layer costs its
activation bytes over the link rate, recomputing it its forward time. Imports nothing of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("keep", "swap", "recompute")


@dataclass
class ActivationCost:
    """One layer, per micro-batch: bytes it saves for backward, bytes of its input, times in ms."""

    name: str
    act_bytes: int
    in_bytes: int
    fwd_ms: float
    bwd_ms: float
    shared_next: int = 0   # of act_bytes, what the next layer saves too (a ReLU's output, the next Linear's input)


def resident_bytes(cost: ActivationCost, policy: str, next_policy: str = "keep") -> int:
    """What a layer holds on the device per micro-batch between its forward and its backward. Storage
    it shares with the next layer stays on the device while either of the two keeps it."""
    shared = cost.shared_next if next_policy == "keep" else 0
    return {"keep": cost.act_bytes, "swap": shared, "recompute": cost.in_bytes + shared}[policy]


def _residents(costs: list[ActivationCost], policies: dict[str, str]) -> list[int]:
    following = [policies[c.name] for c in costs[1:]] + ["keep"]
    return [resident_bytes(c, policies[c.name], nxt) for c, nxt in zip(costs, following)]


def activation_peak(costs: list[ActivationCost], policies: dict[str, str], link_bytes_per_ms: float,
                    in_flight: int) -> int:
    """Modelled peak of the stage's activation bytes, walking one micro-batch's backward while the other
    `in_flight - 1` hold everything they keep. At the turn from forward to backward every layer's
    resident bytes are held, plus the swap copies the link has not finished (`swaps_pending`). During
    layer j's backward the layers before it still hold theirs, and j's own activations are back: rerun
    (recompute) or fetched (swap), with the nearest earlier swap layer's prefetched beside them."""
    res = _residents(costs, policies)
    total = sum(res)
    peak = total + swaps_pending(costs, policies, link_bytes_per_ms)
    held, earlier_swap = 0, None
    for c, r in zip(costs, res):
        held += r
        own = c.act_bytes if policies[c.name] != "keep" else 0
        prefetched = earlier_swap.act_bytes if earlier_swap is not None else 0
        peak = max(peak, held + own + prefetched)
        if policies[c.name] == "swap":
            earlier_swap = c
    return int((in_flight - 1) * total + peak)


def swaps_pending(costs: list[ActivationCost], policies: dict[str, str], link_bytes_per_ms: float) -> int:
    """Bytes still on their way to the host when the forward ends: the link copies in order, each swap
    layer's storages from the end of that layer's forward."""
    now = link_free = 0.0
    landed_at = []
    for c in costs:
        now += c.fwd_ms
        if policies[c.name] == "swap" and c.act_bytes:
            link_free = max(link_free, now) + c.act_bytes / link_bytes_per_ms
            landed_at.append((link_free, c.act_bytes))
    return sum(nbytes for t, nbytes in landed_at if t > now)


def estimate(costs: list[ActivationCost], policies: dict[str, str], base_bytes: int, in_flight: int,
             link_bytes_per_ms: float) -> int:
    """Modelled peak: what the stage holds besides layer activations, plus the activations' peak."""
    return base_bytes + activation_peak(costs, policies, link_bytes_per_ms, in_flight)


def swap_ms(cost: ActivationCost, link_bytes_per_ms: float) -> float:
    return cost.act_bytes / link_bytes_per_ms


def extra_ms(costs: list[ActivationCost], policies: dict[str, str], budget_ms: float,
             link_bytes_per_ms: float) -> float:
    """The modelled time policies add to a micro-batch: recomputed forwards, plus swap time beyond
    what the stage's own forward and backward hide."""
    recompute = sum(c.fwd_ms for c in costs if policies[c.name] == "recompute")
    swapped = sum(swap_ms(c, link_bytes_per_ms) for c in costs if policies[c.name] == "swap")
    return recompute + max(0.0, swapped - budget_ms)
