"""`parallel.strategy = "ddp"`: torch DistributedDataParallel, the baseline, described before it is built: its
StrategySpec and its settings table `[parallel.ddp]` (DdpConfig). Torch-free, on the config's floor: imports
engine.config.declare, engine.telemetry.figures (its figures: FIGURES) and
engine.strategies.specs.spec."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.declare import setting
from engine.strategies.specs.spec import StrategySpec
from engine.telemetry.figures import own_ms


@dataclass
class DdpConfig:
    """`strategy = "ddp"`: torch DistributedDataParallel, the baseline."""

    find_unused_parameters: bool = setting(False, "torch DistributedDataParallel's own flag: set it for a model "
                                                  "that leaves some parameter without a gradient in some step (a "
                                                  "mixture of experts with a module per expert: a rank's share may "
                                                  "route no token to one). It costs a walk of the autograd graph "
                                                  "every step; `sharded` needs no flag (a gradient that never comes "
                                                  "counts as zero). Hugging Face models keep a block's experts in "
                                                  "one tensor and need neither.")


# its figures besides every run's (engine/strategies/ddp/strategy.py): after the last gradient, the
# all-reduce's tail and the updates
FIGURES = (own_ms("after_backward_ms"),)

SPEC = StrategySpec(
    name="ddp",
    about="torch DistributedDataParallel, the baseline",
    settings=DdpConfig,
    builder="engine.strategies.ddp:build",
    figures=FIGURES,
)
