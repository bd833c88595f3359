"""Technique 4's pipeline: each rank runs one stage (a run of consecutive layers) of the model.

- stage.py: PipelineStage (the strategy): the step through the schedule, with two collaborators that own their
  state: wire.py (StageWire: its messages to the neighbours) and checkpoint.py (StageCheckpoint: its files, the
  layout it resumes in); schedule.py: the layout's checks and the schedule's order, pure functions.
- The balance: partition.py (the exact split, pure), stage_times.py (measured stage times, the threshold),
  rebalance.py (the layer clock and the decision); rebalancing.py: the operator's rebalance, the check at the
  boundary, the migration's report, as events.
- migration.py: the live move of layers between stages during a step; tied.py: a weight tied across stages.
- spec.py: what it is before it is built, torch-free, on the config's floor: SPEC (its StrategySpec),
  PipelineConfig (its table `[parallel.pipeline]`), its checks.
- Here: `build` and `stages_of`, what its spec names.

Imports engine.strategies.base, engine.models (the layer grouping, compile), engine.techniques (updates, the
memory policy's room), engine.training, engine.runtime's ground, engine.telemetry.outlets (a rebalance's
refusal, in the hub's words), engine.config. Never engine.run. This file imports spec.py when loaded and the
rest when first asked for (`from engine.strategies.pipeline import PipelineStage`), so that reading the registry
loads no torch.
"""

from __future__ import annotations

from engine.strategies.pipeline.spec import SPEC, PipelineConfig
from engine.strategies.specs.spec import late_exports

__all__ = ["HEADER_LEN", "SPEC", "PipelineConfig", "SCHEDULES", "PipelineStage", "build", "check_stages",
           "configured_stages", "schedule_ops", "split_micro", "stages_of", "uniform_stages"]

LATER = {"HEADER_LEN": "wire", "PipelineStage": "stage",   # a name -> its module here, imported late
         **dict.fromkeys(("SCHEDULES", "check_stages", "configured_stages", "schedule_ops", "split_micro",
                          "uniform_stages"), "schedule")}

__getattr__ = late_exports(__name__, LATER)   # a torch-heavy export, imported when first asked for


def build(cfg, model, topo, device, loss_fn):
    """`parallel.strategy = "pipeline"` from a Config: this rank's PipelineStage (its spec's builder, spec.py),
    on its place in the grid of stages x replicas (grid.py)."""
    from engine.strategies.pipeline.grid import Grid
    from engine.strategies.pipeline.stage import PipelineStage
    p = cfg.parallel.pipeline
    grid = Grid.of(p.stages or topo.world_size, topo.world_size, p.order)
    return PipelineStage(model, stages_of(cfg, model, topo.world_size), topo, device, cfg.optim, p,
                         update_cfg=cfg.update, loss_fn=loss_fn, grid=grid,
                         sharded=cfg.parallel.sharded if p.data == "sharded" else None)


def stages_of(cfg, model, world: int) -> list[list[str]] | str:
    """The layer names each stage of one replica holds, as [parallel.pipeline] partition says, at a world of
    `world` workers (`stages` of them, or one per worker; the launcher's capacity check asks it too,
    engine/run/checks.py)."""
    from engine.strategies.pipeline.schedule import configured_stages
    return configured_stages(model, cfg.parallel.pipeline.partition, cfg.parallel.pipeline.stages or world)
