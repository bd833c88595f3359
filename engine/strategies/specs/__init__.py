"""Every strategy's description, torch-free, in one registry: the config's choices, tables and checks,
make_strategy, worker_main and the fork server's preload look a strategy up here instead of naming it.

    from engine.strategies.specs import STRATEGIES
    spec = STRATEGIES[cfg.parallel.strategy]     # its settings, split, checks, refusals, commands, builder, loops

- spec.py: StrategySpec (what a strategy is before it is built) and its helpers (COMMANDS, resolve).
- registry.py: STRATEGIES, one line per strategy. Each strategy's StrategySpec lives in its own package
  (engine/strategies/NAME/spec.py, with its settings table and its checks).

A fifth strategy: a package engine/strategies/NAME/ (its spec.py and its code), one line in registry.py. The specs
sit on the config's floor (tests/test_layout.py: FLOORS): they import spec.py and engine.config.declare, never
torch. This file imports spec.py when loaded and the registry when STRATEGIES is first asked for (PEP 562), so
that a strategy's spec.py, which imports spec.py, can be imported first (the registry imports it back).
"""

from engine.strategies.specs.spec import COMMANDS, StrategySpec, resolve

__all__ = ["COMMANDS", "STRATEGIES", "StrategySpec", "resolve"]


def __getattr__(name: str):
    """STRATEGIES, from registry.py when first asked for."""
    if name != "STRATEGIES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from engine.strategies.specs.registry import STRATEGIES
    return STRATEGIES
