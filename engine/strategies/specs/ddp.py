"""`parallel.strategy = "ddp"`: torch DistributedDataParallel (engine/strategies/ddp.py). Imports spec.py."""

from engine.strategies.specs.spec import StrategySpec

DDP = StrategySpec(
    name="ddp",
    about="torch DistributedDataParallel, the baseline",
    builder="engine.strategies.ddp:build",
)
