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

from engine.strategies.ddp.spec import SPEC, DdpConfig
from engine.strategies.specs.spec import late_exports

__all__ = ["SPEC", "DDPStrategy", "DdpConfig", "UNUSED_PARAMETERS", "build"]

LATER = {"DDPStrategy": "strategy", "UNUSED_PARAMETERS": "strategy"}   # a name -> its module here, imported late

__getattr__ = late_exports(__name__, LATER)   # a torch-heavy export, imported when first asked for


def build(cfg, model, topo, device, loss_fn):
    """`parallel.strategy = "ddp"` from a Config: a DDPStrategy (its spec's builder, spec.py)."""
    from engine.strategies.ddp.strategy import DDPStrategy
    from engine.training.precision import reduce_dtype
    return DDPStrategy(model, cfg.optim, topo, device, cfg.parallel.ddp, update_cfg=cfg.update, loss_fn=loss_fn,
                       reduce_dtype=reduce_dtype(cfg.precision), accumulate=cfg.data.accumulate)
