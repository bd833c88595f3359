"""The factory that applies the configured data-parallel or pipeline strategy to a model; what the step loop
(engine/run/worker.py) asks of it is the contract in base.py (Strategy).

    strategy = make_strategy(cfg, model, topo, device)
    loss = strategy.train_step(x, y)            # one optimizer step on this rank's share of the batch

A strategy is applied to a model (a LayerList), never written into it. The parameter server runs its
own loops (engine/strategies/param_server/) and is not made here.
"""

from __future__ import annotations


from engine.config import Config
from engine.models import LayerList
from engine.training.loss import cross_entropy
from engine.training.precision import reduce_dtype
from engine.runtime.topology import Topology
from engine.strategies.base import Strategy
from engine.strategies.ddp import DDPStrategy
from engine.strategies.pipeline import PipelineStage, configured_stages
from engine.strategies.sharded import ShardedStrategy


def make_strategy(cfg: Config, model: LayerList, topo: Topology, device, loss_fn=cross_entropy) -> Strategy:
    p = cfg.parallel   # each strategy gets its own table whole ([parallel.pipeline], ...)
    if p.strategy == "pipeline":
        stages = configured_stages(model, p.pipeline.partition, topo.world_size)
        return PipelineStage(model, stages, topo, device, cfg.optim, p.pipeline, update_cfg=cfg.update,
                             loss_fn=loss_fn)
    if p.strategy == "sharded":
        return ShardedStrategy(model, cfg.optim, topo, device, p.sharded, seed=cfg.run.seed, update_cfg=cfg.update,
                               loss_fn=loss_fn, reduce_dtype=reduce_dtype(cfg.precision),
                               accumulate=cfg.data.accumulate)
    return DDPStrategy(model, cfg.optim, topo, device, p.ddp, update_cfg=cfg.update, loss_fn=loss_fn,
                       reduce_dtype=reduce_dtype(cfg.precision), accumulate=cfg.data.accumulate)
