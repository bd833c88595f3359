"""torch's own stages x replicas, the baseline of `trainyard bench pipeline --replicas`: each replica runs
torch.distributed.pipelining's Schedule1F1B over the stages, and each stage's module is wrapped in torch's
DistributedDataParallel over that stage's replicas, as torchtitan composes pipeline and data parallel.

    pipe = TorchPipelineDDP(topo, model, stage_layers, grid, micro_batches=4, optim={"name": "sgd", "lr": 0.01})
    pipe.step(x, y)      # x, y: this replica's share of the global batch, on every stage
    pipe.close()         # gives its process groups back

Ranks sit where trainyard's pipeline puts them (engine/strategies/pipeline/grid.py, the one place that owns
which rank holds which stage of which replica), so the two engines cross the same links. torch's stage runs
every micro-batch's backward but the last under DDP's no_sync, and the last with the all-reduce (its
backward_maybe_with_nosync), so a stage's gradients cross its replicas once a step; Schedule1F1B's
scale_grads divides by the micro-batches and DDP averages over the replicas: the global batch's mean.
With one replica there is no DDP (nothing to average). The first step infers the shapes (warm up first).
"""

from __future__ import annotations

import torch


class TorchPipelineDDP:
    def __init__(self, topo, model, stage_layers: list[list[str]], grid, micro_batches: int, optim: dict):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        from torch.nn.parallel import DistributedDataParallel

        from engine.bench.torch_pipeline import _Stage
        from engine.config import OptimConfig
        from engine.runtime import compat
        from engine.training.loss import cross_entropy
        from engine.training.optim import make_optimizer

        if len(stage_layers) != grid.stages:
            raise ValueError(f"{len(stage_layers)} stages for a grid of {grid.stages}")
        self.topo, self.stage, self.replica = topo, grid.stage_of(topo.rank), grid.replica_of(topo.rank)
        # every rank makes every group, in the same order (Topology.subgroups)
        pipeline = topo.subgroups([grid.pipeline(p) for p in range(grid.replicas)])
        replicas = topo.subgroups([grid.group_of(s) for s in range(grid.stages)]) if grid.replicas > 1 else None
        self.groups = [g for g in (pipeline, replicas) if g is not None]
        self.module = _Stage(model, stage_layers[self.stage])
        self.optimizer = make_optimizer(OptimConfig(**optim), list(self.module.parameters()))
        wrapped = (self.module if replicas is None
                   else DistributedDataParallel(self.module, process_group=replicas))
        stage = PipelineStage(wrapped, stage_index=self.stage, num_stages=grid.stages, device=torch.device("cpu"),
                              group=pipeline)
        self.schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=cross_entropy, scale_grads=True)
        # torch < 2.10's step has no return_outputs (an unknown keyword would reach the stage's forward)
        self.no_outputs = ({"return_outputs": False} if compat.accepts(self.schedule.step, "return_outputs")
                           else {})
        self.micro_batches = micro_batches
        self.first, self.last = self.stage == 0, self.stage == grid.stages - 1

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One optimizer step on this replica's share; its loss on the last stage (None elsewhere)."""
        if x.shape[0] % self.micro_batches:
            raise ValueError(f"a share of {x.shape[0]} does not split into {self.micro_batches} micro-batches")
        self.optimizer.zero_grad(set_to_none=True)
        losses: list = []
        self.schedule.step(*((x,) if self.first else ()), target=y if self.last else None,
                           losses=losses if self.last else None, **self.no_outputs)
        self.optimizer.step()
        return torch.stack(losses).mean().item() if self.last else None

    def close(self) -> None:
        self.topo.release(self.groups)
