"""The registry: every strategy, one line each, in the order the config lists them. A strategy is its package
(engine/strategies/NAME/, its spec.py: SPEC, its StrategySpec, with its settings table and checks, torch-free);
its spec.py named here makes it a `parallel.strategy` choice with its table `[parallel.NAME]`, runs its rules,
and is what make_strategy, worker_main and the fork server's preload find. Imports each strategy's spec.py (by
name: tests/test_layout.py counts a name as an import), nothing more (those packages' __init__ files, which run
first, load nothing else)."""

from __future__ import annotations

import importlib

from engine.strategies.specs.spec import StrategySpec

SPECS = (   # a strategy's spec.py, one line each
    "engine.strategies.ddp.spec",
    "engine.strategies.sharded.spec",
    "engine.strategies.pipeline.spec",
    "engine.strategies.param_server.spec",
)

STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for spec in (importlib.import_module(m).SPEC for m in SPECS)}
