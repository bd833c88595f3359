"""The memory ledger's count of gradients that their updates free once used (LayerUpdates' `release_grads`, as the
plain loop's `zero_grad(set_to_none=True)`), for a strategy whose gradients are no views into its buffers: the
ledger's `refresh` at a step's end finds them gone, so the strategy says when they were alive.

    FreedGradients    a world of one's ddp: each counted from when it is made to its release
    (a pipeline stage's count as held all step: MemoryLedger.count_as_held)

Imports engine.runtime.ledger.
"""

from __future__ import annotations

from engine.runtime.ledger import MemoryLedger, tensor_bytes


class FreedGradients:
    """Freed gradients on the ledger from when they are made to their release (a world of one's ddp).

        grads = FreedGradients(ledger)
        grads.begin(params)       # a step's start: gradients kept from the last step (a guarded or skipped
                                  # update's) are in refresh's count already
        grads.made(params)        # after a backward: the gradients made since, onto the ledger
        LayerUpdates(..., release_grads=grads.released)   # off it, as each update frees its layer's
    """

    def __init__(self, ledger: MemoryLedger):
        self.ledger = ledger
        self.held: dict[int, int] = {}   # the gradients alive now that the ledger counts: bytes by parameter id

    def begin(self, params) -> None:
        self.held = {id(p): 0 for p in params if p.grad is not None}

    def made(self, params) -> None:
        held, nbytes = self.held, 0
        for p in params:
            if p.grad is not None and id(p) not in held:
                held[id(p)] = size = tensor_bytes(p.grad)
                nbytes += size
        if nbytes:
            ledger = self.ledger
            if ledger.peak_before_grads is None:
                ledger.peak_before_grads = ledger.peak_bytes
            ledger.add("gradients", nbytes)

    def uncounted(self, params) -> int:
        """The bytes of the gradients alive that the ledger does not count yet."""
        held = self.held
        return sum(tensor_bytes(p.grad) for p in params if p.grad is not None and id(p) not in held)

    def released(self, params) -> None:
        held = self.held
        self.ledger.add("gradients", -sum(held.pop(id(p), 0) for p in params))

