"""The loss a parameter-server run's step records carry, from each worker's losses by iteration (StepLosses).

Imports nothing of the engine.
"""

from __future__ import annotations


class StepLosses:
    """Each worker's training loss by iteration, and the loss a step's record carries.

    Worker w's iteration i trains on its equal share of global batch i (setup.batch), and its loss arrives
    with its next pull. The record of step s (1-based: iteration s - 1) carries the mean of the losses of
    iteration s - 1 of every live worker, or, once step s + 1 has completed, of every worker that has
    done that iteration. In bsp every live worker has by then (its pull for iteration s, with the loss of
    s - 1, leaves before its gradients of iteration s, on the same link): the global batch's mean loss, as
    in every other strategy. In asp, ssp and soft a worker that has not reached iteration s - 1 by then
    (a slow one) is left out of that step's mean; the record's `ps.loss_workers` says how many are in it.
    """

    def __init__(self):
        self.by_iteration: dict[int, dict[int, float]] = {}

    def add(self, iteration: int, worker: int, loss: float) -> None:
        self.by_iteration.setdefault(iteration, {})[worker] = loss

    def of_step(self, step: int, live: set[int], global_step: int, final: bool = False) -> tuple[float, int] | None:
        """(mean loss, workers in it) of step `step`'s record, or None while it must wait."""
        got = self.by_iteration.get(step - 1, {})
        if not got or not (live <= set(got) or global_step > step or final):
            return None
        return sum(got.values()) / len(got), len(got)

    def forget_before(self, step: int) -> None:
        """Records up to `step` are written: drop the losses of their iterations."""
        for iteration in [i for i in self.by_iteration if i < step]:
            del self.by_iteration[iteration]
