"""`parallel.strategy = "sharded"`: techniques 1 and 2 (engine/strategies/sharded/). Imports spec.py and,
when its check runs, engine.config.declare."""

from engine.strategies.specs.spec import StrategySpec


def has_broadcasts(cfg) -> str | None:
    """`emulate.kill_at = "broadcast"`: sharded's."""
    from engine.config.declare import show
    at, strategy = f"emulate.kill_at = {show(cfg.emulate.kill_at)}", cfg.parallel.strategy
    if strategy != "sharded":
        return f'{at}: needs parallel.strategy = "sharded", whose broadcast it is (got {show(strategy)})'
    return None


SHARDED = StrategySpec(
    name="sharded",
    about="every parameter has one owner rank that alone keeps its optimizer state and broadcasts its update "
          "in slices over several streams",
    docs="docs/sharded.md",
    moments={"broadcast": has_broadcasts},
    builder="engine.strategies.sharded:build",
)
