"""Technique 4's pipeline: each rank runs one stage (a run of consecutive layers) of the model.

- stage.py: PipelineStage (the strategy): the step through the schedule, with two collaborators that own their
  state: wire.py (StageWire: its messages to the neighbours) and checkpoint.py (StageCheckpoint: its files, the
  layout it resumes in); schedule.py: the layout's checks and the schedule's order, pure functions.
- The balance: partition.py (the exact split, pure), stage_times.py (measured stage times, the threshold),
  rebalance.py (the layer clock and the decision); rebalancing.py: the operator's rebalance, the check at the
  boundary, the migration's report, as events.
- migration.py: the live move of layers between stages during a step; tied.py: a weight tied across stages.
- Here: `build` and `stages_of`, what its spec (engine/strategies/specs/pipeline.py) names.

Imports engine.strategies.base, engine.models (the layer grouping, compile), engine.techniques (updates, the
memory policy's room), engine.training, engine.runtime's ground, engine.telemetry.outlets (a rebalance's
refusal, in the hub's words), engine.config. Never engine.run.
"""

from engine.strategies.pipeline.schedule import (
    SCHEDULES, check_stages, configured_stages, schedule_ops, split_micro, uniform_stages)
from engine.strategies.pipeline.stage import PipelineStage
from engine.strategies.pipeline.wire import HEADER_LEN

__all__ = ["HEADER_LEN", "SCHEDULES", "PipelineStage", "build", "check_stages", "configured_stages", "schedule_ops",
           "split_micro", "stages_of", "uniform_stages"]


def build(cfg, model, topo, device, loss_fn) -> PipelineStage:
    """`parallel.strategy = "pipeline"` from a Config (its spec's builder: engine/strategies/specs/pipeline.py)."""
    return PipelineStage(model, stages_of(cfg, model, topo.world_size), topo, device, cfg.optim, cfg.parallel.pipeline,
                         update_cfg=cfg.update, loss_fn=loss_fn)


def stages_of(cfg, model, world: int) -> list[list[str]] | str:
    """The layer names each of `world` stages holds, as [parallel.pipeline] partition says (the launcher's
    capacity check asks it too, engine/run/checks.py)."""
    return configured_stages(model, cfg.parallel.pipeline.partition, world)
