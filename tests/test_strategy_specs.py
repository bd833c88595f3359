"""The strategies' registry (engine/strategies/specs/) agrees with what it describes: every strategy has its
table, its code is where its strings say, it says the commands its strategy takes, and the config reads it
without torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from engine.config import ParallelConfig, config_from_dict
from engine.strategies.specs import COMMANDS, STRATEGIES, resolve


def test_every_strategy_has_its_table_and_is_a_choice():
    tables = [f.name for f in dataclasses.fields(ParallelConfig) if f.metadata["kind"] == "table"]
    choices = next(f for f in dataclasses.fields(ParallelConfig) if f.name == "strategy").metadata["choices"]
    assert tables == list(STRATEGIES) == list(choices)


def test_every_string_names_code_that_exists():
    for spec in STRATEGIES.values():
        assert bool(spec.builder) != bool(spec.loops), f"{spec.name}: built for the step loop, or loops of its own"
        for path in (spec.builder, spec.loops, spec.apart, spec.stages):
            assert not path or callable(resolve(path)), f"{spec.name}: {path}"
        assert not spec.apart or spec.apart_from is not None


def test_the_commands_are_the_strategies_own():
    from engine.strategies.ddp import DDPStrategy
    from engine.strategies.param_server.setup import COMMANDS as PS_COMMANDS
    from engine.strategies.sharded import ShardedStrategy
    cfg = config_from_dict({})
    assert STRATEGIES["ddp"].commands(cfg) == DDPStrategy.commands == COMMANDS
    assert STRATEGIES["sharded"].commands(cfg) == ShardedStrategy.commands == COMMANDS
    assert STRATEGIES["param_server"].commands(cfg) == PS_COMMANDS
    pipe = {"parallel": {"strategy": "pipeline", "pipeline": {"rebalance": "off"}}}
    assert STRATEGIES["pipeline"].commands(config_from_dict(pipe)) == COMMANDS
    pipe["parallel"]["pipeline"]["rebalance"] = "manual"
    assert STRATEGIES["pipeline"].commands(config_from_dict(pipe)) == COMMANDS + ("rebalance",)


def test_the_config_reads_the_registry_without_torch():
    code = "import sys, engine.config, engine.strategies.specs; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
