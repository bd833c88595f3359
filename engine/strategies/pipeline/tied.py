"""Tied weights across pipeline stages: one weight that layers on different stages hold, updated once.

    tied = StageTies(model, group, rank)     # from LayerList.ties; every stage builds the same
    tied.sum_grads(stage_of, pending)        # after the step's last backward (and a migration's gradients)
    updater.end_backward()
    tied.return_weights(stage_of, updater, pending)
    tied.not_owned_keys(stage_of)            # state keys this stage leaves to the owner's checkpoint file

A weight that two layers hold (an input embedding tied to the output head, GPT-2's default) is one parameter
in every process, as each holds the whole LayerList; but a stage updates only its own layers. The first
holder's stage (in forward order) owns it, as Megatron's embedding group does:
- after the step's last backward, every other stage holding it sends the gradient it accumulated to the owner
  and forgets it; the owner adds them and updates the weight once, with its layer's update;
- the owner then sends the new weight back (after that layer's update has landed, a host one included), and
  the others copy it in, so every stage starts the next step with the same value.
The stages are those of the layout at the step's end (`stage_of`, after a migration), so the pairs follow the
layers as they move. A stage that holds every holder of a weight exchanges nothing. Messages are point to
point on the pipeline's group, on tags of their own; sends are non-blocking, kept in `pending` until the
step's end, and receives blocking, after this stage's own sends: no cycle, so no deadlock.
Imports torch only (and engine.runtime.checkpoint's key names).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.runtime.checkpoint import tied_keys

GRAD_TAG, WEIGHT_TAG = 4, 5   # the pipeline's are 0 and 1, a migration's 2 and 3


class StageTies:
    def __init__(self, model, group, rank: int):
        self.model, self.group, self.rank = model, group, rank
        # (first holder's index, every holder's index, the parameter, its state keys)
        self.ties = [(model.index(tie[0][0]), sorted({model.index(layer) for layer, _ in tie}),
                      model.layer(tie[0][0]).get_parameter(tie[0][1]), keys)
                     for tie, keys in zip(getattr(model, "ties", []), tied_keys(model))]

    def __bool__(self) -> bool:
        return bool(self.ties)

    def _stages(self, stage_of: dict[str, int], layers: list[int]) -> list[int]:
        return sorted({stage_of[self.model.names[i]] for i in layers})

    def _peers(self, stage_of: dict[str, int]):
        """Each tie this rank takes part in: its owner layer, the parameter, the owning stage, the others."""
        for owner, holders, p, _ in self.ties:
            stages = self._stages(stage_of, holders)
            if len(stages) > 1 and self.rank in stages:
                owner_stage = stage_of[self.model.names[owner]]
                yield owner, p, owner_stage, [s for s in stages if s != owner_stage]

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def sum_grads(self, stage_of: dict[str, int], pending: list) -> int:
        """The owners receive the other holders' gradients and add them; the bytes this rank sent."""
        sent = 0
        for _, p, owner_stage, others in self._peers(stage_of):
            if self.rank == owner_stage:
                for s in others:
                    got = torch.empty_like(p)
                    dist.recv(got, self._peer(s), group=self.group, tag=GRAD_TAG)
                    p.grad = got if p.grad is None else p.grad.add_(got)
            else:
                grad = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().contiguous()
                pending.append((dist.isend(grad, self._peer(owner_stage), group=self.group, tag=GRAD_TAG), grad))
                sent += grad.numel() * grad.element_size()
                p.grad = None   # the owner updates it
        return sent

    def return_weights(self, stage_of: dict[str, int], updater, pending: list) -> int:
        """The owners send the updated weights; the others copy them in. The bytes this rank sent."""
        sent = 0
        for owner, p, owner_stage, others in self._peers(stage_of):
            if self.rank == owner_stage:
                updater.wait_layer(owner)   # a host update of it lands first
                weight = p.detach().clone()
                for s in others:
                    pending.append((dist.isend(weight, self._peer(s), group=self.group, tag=WEIGHT_TAG), weight))
                    sent += weight.numel() * weight.element_size()
            else:
                got = torch.empty_like(p)
                dist.recv(got, self._peer(owner_stage), group=self.group, tag=WEIGHT_TAG)
                with torch.no_grad():
                    p.copy_(got)
        return sent

    def not_owned_keys(self, stage_of: dict[str, int]) -> set[str]:
        """The state keys of tied weights whose owner is another stage: written once, by the owner (under bf16
        only the owner has the fp32 master)."""
        return {key for owner, _, _, keys in self.ties if stage_of[self.model.names[owner]] != self.rank
                for key in keys}
