"""Technique 4's pipeline: each rank runs one stage (a run of consecutive layers) of the model.

- stage.py: PipelineStage (the strategy): the wire, the step through the schedule, checkpoints;
  schedule.py: the layout's checks and the schedule's order, pure functions.
- rebalancing.py: the operator's rebalance, the check at the boundary, the migration's report, as events.
- migration.py: the live move of layers between stages during a step; tied.py: a weight tied across stages.

Imports engine.strategies.base and ddp (the layer grouping), engine.techniques (partition, rebalance, hybrid),
engine.runtime's ground, engine.models, engine.config. Never engine.run.
"""

from engine.strategies.pipeline.schedule import (
    SCHEDULES, check_stages, configured_stages, schedule_ops, split_micro, uniform_stages)
from engine.strategies.pipeline.stage import HEADER_LEN, PipelineStage

__all__ = ["HEADER_LEN", "SCHEDULES", "PipelineStage", "check_stages", "configured_stages", "schedule_ops",
           "split_micro", "uniform_stages"]
