"""`parallel.strategy = "pipeline"`: technique 4, described before it is built: its StrategySpec (SPEC),
its settings table `[parallel.pipeline]` (PipelineConfig) and its checks. Every rank takes the whole global
batch, cut into micro-batches; a rank holds a stage. Torch-free, on the config's floor: imports
engine.config.declare, engine.telemetry.figures (its figures: FIGURES) and
engine.strategies.specs.spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config.declare import setting, show
from engine.strategies.specs.spec import COMMANDS, StrategySpec
from engine.telemetry.figures import STAGES, ms, nbytes, own_ms


@dataclass
class PipelineConfig:
    """`strategy = "pipeline"`: one stage of consecutive layers per worker, micro-batches in flight, layers
    migrating between stages while training runs (docs/pipeline.md)."""

    micro_batches: int = setting(4, "Micro-batches per global batch (the batch must divide by it).",
                                 min=1, max=4096)
    schedule: str = setting("1f1b", "`1f1b` (one forward, one backward, after a warm-up) or `gpipe` (all "
                                    "forwards, then all backwards).", choices=("1f1b", "gpipe"))
    partition: Any = setting("uniform", "The layout at the start: `uniform` (the same number of layer clusters "
                                        "per stage), `balanced` (the last stage times every layer on the first "
                                        "micro-batch and splits the model time-optimally), or a list of "
                                        "stages, each a list of layer names: "
                                        "`[[\"fc0\", \"act0\"], [\"fc1\", \"head\"]]`. A stage is contiguous "
                                        "and never cuts a Block. A run resumed from a pipeline's checkpoint of as "
                                        "many stages continues in its layout; from any other, this decides it "
                                        "(docs/checkpoints.md).", kind="partition")
    rebalance: str = setting("auto", "`auto` (every `rebalance_check_every` steps the last stage compares stage "
                                     "times and, past `imbalance_threshold`, moves layers between stages while "
                                     "training runs), `manual` (only on the `rebalance` command, console key "
                                     "`r`) or `off` (the layout never changes; the command is refused).",
                             choices=("auto", "manual", "off"))
    imbalance_threshold: float = setting(0.25, "How far apart the slowest and fastest stage may be before a "
                                               "rebalance, and how much faster a new layout's slowest stage must "
                                               "be to be taken: above 1 in milliseconds, from 0 to 1 a fraction "
                                               "of the mean stage time.", min=0.0)
    rebalance_check_every: int = setting(10, "With `rebalance = \"auto\"`: steps between checks (the stage times "
                                             "are the mean over those steps).", min=1, max=1_000_000)
    stages: int = setting(0, "Stages of one replica of the pipeline. 0: one per worker, one replica (the stage "
                             "count follows the world). S: the world is S x R workers, each stage held by R "
                             "replicas, each replica taking its share of every global batch in its own "
                             "micro-batches (docs/pipeline.md, Replicas).", min=0, max=4096)
    data: str = setting("ddp", "With replicas (`stages` below the world size): how a stage's replicas combine "
                               "their gradients. `ddp`: an all-reduce within the stage's group. `sharded`: each layer's "
                               "update has one owner in the group, which alone keeps its optimizer state; gradients "
                               "are summed onto it and its update goes out in slices over the `[parallel.sharded]` "
                               "streams, each layer's next forward waiting only for its own (docs/pipeline.md, "
                               "Replicas). With one replica both are the plain pipeline.",
                        choices=("ddp", "sharded"))
    order: str = setting("auto", "With replicas: which ranks hold a stage, and which a replica's pipeline. "
                                 "`stage`: a stage's replicas are neighbouring ranks (rank = stage x R + replica), "
                                 "so on one host, and only a boundary's activations cross between hosts; "
                                 "`replica`: a replica's stages are neighbouring ranks (rank = replica x S + stage); "
                                 "`auto`: `stage` (a stage's all-reduce carries its whole gradients every step, a "
                                 "boundary one micro-batch's activations).", choices=("auto", "stage", "replica"))


def stage_count(cfg) -> int:
    """The stages of one replica: `stages`, or (0) one per worker."""
    return cfg.parallel.pipeline.stages or cfg.parallel.world_size


def replica_count(cfg) -> int:
    """The replicas of every stage: the world over the stages (checked whole by stages_divide_the_world)."""
    return max(1, cfg.parallel.world_size // stage_count(cfg))


def micro_batches(cfg) -> tuple[int, str]:
    """Each replica's share of the batch, cut into its micro-batches."""
    m, r = cfg.parallel.pipeline.micro_batches, replica_count(cfg)
    if r == 1:
        return m, f"parallel.pipeline.micro_batches = {m}"
    return m * r, f"parallel.pipeline.micro_batches = {m} x {r} replicas"


def stages_divide_the_world(cfg) -> str | None:
    """pipeline: `stages` divides the world into whole replicas."""
    p = cfg.parallel.pipeline
    world = cfg.parallel.world_size
    if p.stages and (p.stages > world or world % p.stages):
        return (f"parallel.pipeline.stages = {p.stages}: must divide parallel.world_size = {world} into whole "
                f"replicas (e.g. {', '.join(str(d) for d in range(1, world + 1) if world % d == 0)})")
    return None


def stages_only_in_a_pipeline(cfg) -> str | None:
    """Whichever strategy: `parallel.pipeline.stages` is a pipeline's (a parameter server's stages are refused)."""
    p = cfg.parallel
    if p.pipeline.stages and p.strategy != "pipeline":
        return (f"parallel.pipeline.stages = {p.pipeline.stages}: only with parallel.strategy = \"pipeline\" (got "
                f"parallel.strategy = {show(p.strategy)})")
    return None


def one_stage_per_worker(cfg) -> str | None:
    """pipeline: a `parallel.pipeline.partition` list has a stage per worker of one replica."""
    partition, stages = cfg.parallel.pipeline.partition, stage_count(cfg)
    if isinstance(partition, list) and len(partition) != stages:
        said = (f"parallel.pipeline.stages = {stages}" if cfg.parallel.pipeline.stages else
                f"parallel.world_size = {stages} (one stage per worker)")
        return f"parallel.pipeline.partition lists {len(partition)} stages but {said}"
    return None


def fixed_stages(cfg) -> str | None:
    """With a range of hosts the stage count follows the world, unless `stages` fixes it (then the replicas
    follow, each host count checked for a whole number of them): a partition list needs a fixed count."""
    c, partition = cfg.cluster, cfg.parallel.pipeline.partition
    if isinstance(partition, list) and not cfg.parallel.pipeline.stages:
        return (f"parallel.pipeline.partition lists {len(partition)} stages: with a range of hosts "
                f"(cluster.min_nnodes = {c.min_nnodes} to nnodes = {c.nnodes}) the stage count follows the "
                f"world; use partition = \"uniform\" or \"balanced\", or fix it with parallel.pipeline.stages")
    return None


def has_migrations(cfg) -> str | None:
    """`emulate.kill_at = "migration"`: a pipeline that rebalances."""
    at, p = f"emulate.kill_at = {show(cfg.emulate.kill_at)}", cfg.parallel
    if p.strategy != "pipeline" or p.pipeline.rebalance == "off":
        return (f'{at}: needs parallel.strategy = "pipeline" with parallel.pipeline.rebalance = "auto" or "manual", '
                f'where layers migrate (got parallel.strategy = {show(p.strategy)}, parallel.pipeline.rebalance = '
                f'{show(p.pipeline.rebalance)})')
    return None


def commands(cfg) -> tuple[str, ...]:
    return COMMANDS + (("rebalance",) if cfg.parallel.pipeline.rebalance != "off" else ())


def declined(cfg) -> dict[str, str]:
    if cfg.parallel.pipeline.rebalance != "off":
        return {}
    return {"rebalance": 'rebalancing is off in this run (parallel.pipeline.rebalance = "off")'}


# its figures besides every run's (engine/strategies/pipeline/stage.py): a stage's traffic, its waits (on its
# line of the stages panel), its layers' moves
FIGURES = (
    nbytes("sent_bytes"),
    own_ms("recv_wait_ms", STAGES),
    nbytes("migration_bytes"),
    ms("migration_ms"),
    own_ms("replica_reduce_ms"),   # stages x replicas: a stage's gradients averaged over its replicas (sharded:
                                   # summed onto each layer's owner)
    ms("shard_gate_ms"),           # sharded replicas: the forward's waits for its layers' broadcasts
)

SPEC = StrategySpec(
    name="pipeline",
    about="one stage of consecutive layers per worker, micro-batches in flight",
    settings=PipelineConfig,
    docs="docs/pipeline.md",
    split=micro_batches,
    per_rank=False,
    stages="engine.strategies.pipeline:stages_of",
    commands=commands,
    declined=declined,
    table_checks=(stages_only_in_a_pipeline,),
    checks=(stages_divide_the_world,),
    checks_after_batch=(one_stage_per_worker,),
    refuses={"emulate.slow_rank": "a pipeline's slow stage is emulate.slow_layer"},
    moments={"migration": has_migrations},
    in_host_range=fixed_stages,
    builder="engine.strategies.pipeline:build",
    figures=FIGURES,
)
