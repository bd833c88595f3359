"""`parallel.strategy = "pipeline"`: technique 4 (engine/strategies/pipeline/). Every rank takes the whole
global batch, cut into micro-batches; a rank holds a stage. Imports spec.py and, when its checks run,
engine.config.declare."""

from engine.strategies.specs.spec import COMMANDS, StrategySpec


def micro_batches(cfg) -> tuple[int, str]:
    m = cfg.parallel.pipeline.micro_batches
    return m, f"parallel.pipeline.micro_batches = {m}"


def one_stage_per_worker(cfg) -> str | None:
    """pipeline: a `parallel.pipeline.partition` list has `world_size` stages."""
    partition, world = cfg.parallel.pipeline.partition, cfg.parallel.world_size
    if isinstance(partition, list) and len(partition) != world:
        return (f"parallel.pipeline.partition lists {len(partition)} stages but parallel.world_size = {world} "
                f"(one stage per worker)")
    return None


def fixed_stages(cfg) -> str | None:
    """With a range of hosts the stage count follows the world: a partition list (a fixed count) is refused."""
    c, partition = cfg.cluster, cfg.parallel.pipeline.partition
    if isinstance(partition, list):
        return (f"parallel.pipeline.partition lists {len(partition)} stages: with a range of hosts "
                f"(cluster.min_nnodes = {c.min_nnodes} to nnodes = {c.nnodes}) the stage count follows the "
                f"world; use partition = \"uniform\" or \"balanced\"")
    return None


def has_migrations(cfg) -> str | None:
    """`emulate.kill_at = "migration"`: a pipeline that rebalances."""
    from engine.config.declare import show
    at, p = f"emulate.kill_at = {show(cfg.emulate.kill_at)}", cfg.parallel
    if p.strategy != "pipeline" or p.pipeline.rebalance == "off":
        return (f'{at}: needs parallel.strategy = "pipeline" with parallel.pipeline.rebalance = "auto" or "manual", '
                f'where layers migrate (got parallel.strategy = {show(p.strategy)}, parallel.pipeline.rebalance = '
                f'{show(p.pipeline.rebalance)})')
    return None


def commands(cfg) -> tuple[str, ...]:
    return COMMANDS + (("rebalance",) if cfg.parallel.pipeline.rebalance != "off" else ())


PIPELINE = StrategySpec(
    name="pipeline",
    about="one stage of consecutive layers per worker, micro-batches in flight",
    docs="docs/pipeline.md",
    split=micro_batches,
    per_rank=False,
    stages="engine.strategies.pipeline:stages_of",
    commands=commands,
    checks_after_batch=(one_stage_per_worker,),
    refuses={"emulate.slow_rank": "a pipeline's slow stage is emulate.slow_layer"},
    moments={"migration": has_migrations},
    in_host_range=fixed_stages,
    builder="engine.strategies.pipeline:build",
)
