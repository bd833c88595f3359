"""Stages x replicas (grid.py): the process groups a stage's rank needs, and what its replicas do together.

    replicas = Replicas(grid, topo)      # every rank, at the same point: makes every group
    replicas.pipeline                    # this replica's pipeline group (its stages, in order), or the world
    seconds = replicas.average(params)   # after backward: the stage's gradients averaged over its replicas
    replicas.loss(table_losses)          # the step's loss: the replicas' last stages' mean

Each replica takes its share of every global batch; its last stage weighs each micro-batch's loss by its
counted targets over the global batch's, times the replicas (engine/training/loss.py share_loss), so the
mean over the replicas of their gradients, which `average` takes (one all-reduce per dtype on the stage's
group, as DDP's), is the global batch's. A gradient no replica made stays None. With one replica nothing is
made and nothing travels.

Imports torch.distributed.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class Replicas:
    def __init__(self, grid, topo):
        self.grid, self.count = grid, grid.replicas
        many = grid.replicas > 1
        self.pipeline = topo.subgroups([grid.pipeline(p) for p in range(grid.replicas)]) if many else topo.compute
        self.stage_group = topo.subgroups([grid.group_of(s) for s in range(grid.stages)]) if many else None
        self.loss_ranks = grid.group_of(grid.stages - 1)   # every replica's last stage: whose losses make the step's

    def average(self, params) -> float | None:
        """The gradients of `params` (this stage's) averaged over the stage's replicas; its seconds (None: one
        replica, nothing to do)."""
        if self.stage_group is None:
            return None
        t0 = time.perf_counter()
        by_dtype: dict = {}
        for p in params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.stage_group)
            flat /= self.count
            for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(averaged)
        return time.perf_counter() - t0

    def loss(self, losses: torch.Tensor) -> float:
        """The step's loss from every rank's (the exchange's column): each replica's last stage's is its share's
        part of the global mean, times the replicas; their mean is the global batch's."""
        return float(losses[self.loss_ranks].mean())
