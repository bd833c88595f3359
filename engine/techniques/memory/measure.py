"""The measuring step: per layer, per micro-batch, its forward and backward time and the bytes of its
input, turned into the ActivationCosts the planners take.

    measure = Measure(Clock(device))                      # ActivationPolicy.before_step, a plan due
    t0 = measure.clock.mark(); ...                        # before each layer's forward, in that step
    measure.forward_ran(name, t0, link_wait_s, args)      # after it
    measure.time_backward(name, out, args, swapper)       # hooks timing that layer's backward
    costs = measure.costs(owned, policy, known, ledger)   # ActivationPolicy.after_step

Times are marks of the device's clock (engine/training/timing.py: CUDA events on a GPU, where a layer's
kernels run after its Python returns), read in `costs` once the step's work has run. They leave out
the waits for the link (a layer's own time is what recompute costs): the host's, and on a GPU the
compute stream's, marked by the swapper (`device_waits`). The bytes a layer saves
are the ledger's count (`activations_by_layer`, `shared_bytes`), read back in `costs`. Imports torch,
engine.training.timing and cost.py only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.techniques.memory.cost import ActivationCost
from engine.training.timing import Clock


def tensors(value) -> list[torch.Tensor]:
    """The tensors in a layer's arguments or output (nested in tuples and lists)."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors(item)]
    return []


@dataclass
class Measure:
    """One measured step's marks, by layer name; `costs` reads them."""

    clock: Clock = field(default_factory=Clock)
    calls: dict = field(default_factory=dict)
    fwd: list = field(default_factory=list)      # (name, mark before, mark after, host's link wait in s,
                                                 #  the device's waits for the link: (mark, mark), ...)
    bwd: list = field(default_factory=list)      # the same for each backward timed
    in_bytes: dict = field(default_factory=dict)

    def forward_ran(self, name: str, t0, link_wait_s: float, args) -> None:
        """After one forward of `name` that began at mark `t0` and waited `link_wait_s` for the link."""
        self.calls[name] = self.calls.get(name, 0) + 1
        self.fwd.append((name, t0, self.clock.mark(), link_wait_s, ()))
        self.in_bytes[name] = max(self.in_bytes.get(name, 0),
                                  sum(t.numel() * t.element_size() for t in tensors(args)))

    def time_backward(self, name: str, out: torch.Tensor, args, swapper) -> None:
        """Hooks timing `name`'s backward: from its output's gradient to its first input's."""
        started = []

        def waited() -> tuple[float, int]:   # the host's waits (s), and how many device waits so far
            if swapper is None:
                return 0.0, 0
            return swapper.waited_s, len(swapper.device_waits or ())
        out.register_hook(lambda grad: started.append((self.clock.mark(), waited())))
        inputs = [t for t in tensors(args) if t.requires_grad]

        def ended(grad):   # minus any wait for a swapped storage to come back
            if started:
                t0, (w0, d0) = started.pop()
                w1, d1 = waited()
                stalls = swapper.device_waits[d0:d1] if d1 > d0 else ()
                self.bwd.append((name, t0, self.clock.mark(), w1 - w0, tuple(stalls)))
        if inputs:
            inputs[0].register_hook(ended)

    def _sums(self, marks: list) -> tuple[dict, dict]:
        ms, seen = {}, {}
        for name, a, b, wait_s, stalls in marks:
            stalled = sum(self.clock.ms(s0, s1) for s0, s1 in stalls)
            ms[name] = ms.get(name, 0.0) + max(0.0, self.clock.ms(a, b) - wait_s * 1000 - stalled)
            seen[name] = seen.get(name, 0) + 1
        return ms, seen

    def passes(self) -> int:
        """Forward passes in the measured step (micro-batches): the most calls of any layer."""
        return max(self.calls.values(), default=1)

    def costs(self, owned: list[str], policy: dict[str, str], known: dict[str, ActivationCost],
              ledger) -> list[ActivationCost]:
        """The per-micro-batch costs of the `owned` layers that ran, each also recorded in `known`. A
        recomputed layer's activations are not seen in its forward: its last known cost stands in."""
        by_layer, shared = ledger.activations_by_layer, ledger.shared_bytes
        self.clock.settle()
        fwd_ms, _ = self._sums(self.fwd)
        bwd_ms, bwd_seen = self._sums(self.bwd)
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
