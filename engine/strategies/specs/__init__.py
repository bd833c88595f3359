"""Every strategy's description, torch-free (spec.py: StrategySpec), in one registry: the config's choices
and checks, make_strategy and worker_main look a strategy up here instead of naming it.

    from engine.strategies.specs import STRATEGIES
    spec = STRATEGIES[cfg.parallel.strategy]     # its split, checks, refusals, commands, builder, loops

A fifth strategy: a module here with its StrategySpec, one line below. It sits on the config's floor
(tests/test_layout.py: FLOORS): it imports nothing of the engine when loaded, only spec.py and its own
modules; a check imports engine.config.declare when it runs.
"""

from engine.strategies.specs.ddp import DDP
from engine.strategies.specs.param_server import PARAM_SERVER
from engine.strategies.specs.pipeline import PIPELINE
from engine.strategies.specs.sharded import SHARDED
from engine.strategies.specs.spec import COMMANDS, StrategySpec, resolve

STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for spec in (DDP, SHARDED, PIPELINE, PARAM_SERVER)}

__all__ = ["COMMANDS", "STRATEGIES", "StrategySpec", "resolve"]
