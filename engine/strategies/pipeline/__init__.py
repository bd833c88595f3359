"""Technique 4's pipeline: each rank runs one stage (a run of consecutive layers) of the model.

- stage.py: PipelineStage (the strategy): the step through the schedule; wire.py: its messages to the
  neighbours; checkpoint.py: its files; schedule.py: the layout's checks and the schedule's order, pure
  functions.
- rebalancing.py: the operator's rebalance, the check at the boundary, the migration's report, as events.
- migration.py: the live move of layers between stages during a step; tied.py: a weight tied across stages.

Imports engine.strategies.base and ddp (the layer grouping), engine.techniques (partition, rebalance, hybrid),
engine.runtime's ground, engine.telemetry.outlets (a rebalance's refusal, in the hub's words), engine.models,
engine.config. Never engine.run.
"""

from engine.strategies.pipeline.schedule import (
    SCHEDULES, check_stages, configured_stages, schedule_ops, split_micro, uniform_stages)
from engine.strategies.pipeline.stage import PipelineStage
from engine.strategies.pipeline.wire import HEADER_LEN

__all__ = ["HEADER_LEN", "SCHEDULES", "PipelineStage", "check_stages", "configured_stages", "schedule_ops",
           "split_micro", "uniform_stages"]
