"""The factory that applies the configured strategy to a model; what the step loop (engine/run/worker.py) asks
of it is the contract in base.py (Strategy).

    strategy = make_strategy(cfg, model, topo, device)
    loss = strategy.train_step(x, y)            # one optimizer step on this rank's share of the batch

A strategy is applied to a model (a LayerList), never written into it, by the builder its spec names (the
registry, engine/strategies/specs/, lists each strategy's package, engine/strategies/NAME/: its spec.py and its
`build`; a fifth strategy is one such package and one line there). A strategy with loops of its own (the
parameter server) has no builder: its spec's `loops` are run by worker_main (engine/run/worker_entry.py)
instead of the step loop.
"""

from __future__ import annotations

from engine.config import Config
from engine.models import LayerList
from engine.training.loss import cross_entropy
from engine.runtime.topology import Topology
from engine.strategies.base import Strategy
from engine.strategies.specs import STRATEGIES, resolve


def make_strategy(cfg: Config, model: LayerList, topo: Topology, device, loss_fn=cross_entropy) -> Strategy:
    spec = STRATEGIES[cfg.parallel.strategy]   # each strategy gets its own table whole ([parallel.pipeline], ...)
    if not spec.builder:
        raise ValueError(f"parallel.strategy = {spec.name!r} runs loops of its own (worker_main), not the step loop")
    return resolve(spec.builder)(cfg, model, topo, device, loss_fn)
