"""The measuring step: per layer, per micro-batch, its forward and backward time and the bytes of its
input, turned into the ActivationCosts the planners take.

    measure = Measure(Clock(device))                      # ActivationPolicy.before_step, a plan due
    t0 = measure.clock.mark(); ...                        # before each layer's forward, in that step
    measure.forward_ran(name, t0, link_wait_s, args)      # after it
    measure.time_backward(name, out, args, swapper)       # hooks timing that layer's backward
    costs = measure.costs(owned, policy, known, ledger)   # ActivationPolicy.after_step

Times are marks of the one per-layer timer (engine/training/timing.py LayerSpans, on the device's clock:
CUDA events on a GPU, where a layer's kernels run after its Python returns), read in `costs` once the
step's work has run. They leave out
the waits for the link (a layer's own time is what recompute costs): the host's, and on a GPU the
compute stream's, marked by the swapper (`device_waits`). The bytes a layer saves
are the ledger's count (`activations_by_layer`, `shared_bytes`), read back in `costs`. Imports torch,
engine.training.timing and cost.py only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.techniques.memory.cost import ActivationCost
from engine.training.timing import Clock, LayerSpans, tensors


@dataclass
class Measure:
    """One measured step's marks, by layer name, through the one per-layer timer (LayerSpans); `costs`
    reads them."""

    clock: Clock = field(default_factory=Clock)
    calls: dict = field(default_factory=dict)
    in_bytes: dict = field(default_factory=dict)
    spans: LayerSpans = field(init=False)

    def __post_init__(self):
        self.spans = LayerSpans(self.clock)

    def forward_ran(self, name: str, t0, link_wait_s: float, args) -> None:
        """After one forward of `name` that began at mark `t0` and waited `link_wait_s` for the link."""
        self.calls[name] = self.calls.get(name, 0) + 1
        self.spans.forward(name, t0, link_wait_s)
        self.in_bytes[name] = max(self.in_bytes.get(name, 0),
                                  sum(t.numel() * t.element_size() for t in tensors(args)))

    def time_backward(self, name: str, out: torch.Tensor, args, swapper) -> None:
        """Hooks timing `name`'s backward: from its output's gradient to its first input's, less any wait for
        a swapped storage to come back (the host's, and the compute stream's marked by the swapper)."""
        inputs = [t for t in tensors(args) if t.requires_grad]
        if inputs:   # no input gradient to time it by: costs takes twice the forward
            waits = (lambda: (swapper.waited_s, swapper.device_waits or ())) if swapper is not None else None
            self.spans.backward_from(name, out, until=inputs[0], waits=waits)

    def passes(self) -> int:
        """Forward passes in the measured step (micro-batches): the most calls of any layer."""
        return max(self.calls.values(), default=1)

    def costs(self, owned: list[str], policy: dict[str, str], known: dict[str, ActivationCost],
              ledger) -> list[ActivationCost]:
        """The per-micro-batch costs of the `owned` layers that ran, each also recorded in `known`. A
        recomputed layer's activations are not seen in its forward: its last known cost stands in."""
        by_layer, shared = ledger.activations_by_layer, ledger.shared_bytes
        fwd_ms, bwd_ms, _, bwd_seen = self.spans.read()
        costs = []
        for k, name in enumerate(owned):
            calls = self.calls.get(name, 0)
            if not calls:
                continue
            fwd = fwd_ms[name] / calls
            seen = bwd_seen.get(name, 0)
            bwd = bwd_ms[name] / seen if seen else 2 * fwd   # no input gradient to time it by
            last = known.get(name)
            if policy[name] == "recompute" and last is not None:
                act = last.act_bytes   # a recomputed layer's activations are not seen in forward
                fwd = min(fwd, last.fwd_ms) if last.fwd_ms else fwd
            else:
                act = by_layer.get(name, 0) // calls
            if policy[name] == "recompute" and last is not None:
                shared_next = last.shared_next
            else:
                shared_next = shared.get((name, owned[k + 1]), 0) // calls if k + 1 < len(owned) else 0
            cost = ActivationCost(name, act, self.in_bytes.get(name, 0), fwd, bwd, min(shared_next, act))
            known[name] = cost
            costs.append(cost)
        return costs
