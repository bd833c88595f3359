"""`parallel.strategy = "ddp"`: torch DistributedDataParallel, the baseline every technique is measured against.

- spec.py: what it is before it is built, torch-free, on the config's floor: SPEC (its StrategySpec) and
  DdpConfig (its table `[parallel.ddp]`).
- strategy.py: DDPStrategy, the strategy itself.
- Here: `build`, what its spec's builder names.

Imports its spec.py when loaded and nothing else: DDPStrategy and what strategy.py holds are imported when first
asked for (`from engine.strategies.ddp import DDPStrategy`), so that reading the registry loads no torch.
strategy.py imports engine.config, engine.training, engine.models, engine.runtime (the ground),
engine.techniques.updates and engine.strategies.base (the contract).
"""

from __future__ import annotations

import importlib

from engine.strategies.ddp.spec import SPEC, DdpConfig

__all__ = ["SPEC", "DDPStrategy", "DdpConfig", "UNUSED_PARAMETERS", "build"]

LATER = {"DDPStrategy": "strategy", "UNUSED_PARAMETERS": "strategy"}   # a name -> its module here, imported late


def __getattr__(name: str):
    """A torch-heavy export, imported when first asked for (PEP 562)."""
    if name not in LATER:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{LATER[name]}"), name)


def build(cfg, model, topo, device, loss_fn):
    """`parallel.strategy = "ddp"` from a Config: a DDPStrategy (its spec's builder, spec.py)."""
    from engine.strategies.ddp.strategy import DDPStrategy
    from engine.training.precision import reduce_dtype
    return DDPStrategy(model, cfg.optim, topo, device, cfg.parallel.ddp, update_cfg=cfg.update, loss_fn=loss_fn,
                       reduce_dtype=reduce_dtype(cfg.precision), accumulate=cfg.data.accumulate)
