"""The strategies' registry (engine/strategies/specs/) agrees with what it describes: every strategy is one
package (its spec.py, its code), has its table, its code is where its strings say, it says the commands its
strategy takes, and the config reads it without torch."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys

from engine.config import ParallelConfig, config_from_dict
from engine.strategies.specs import COMMANDS, STRATEGIES, resolve


def test_every_strategy_has_its_table_and_is_a_choice():
    tables = {f.name: f.default_factory for f in dataclasses.fields(ParallelConfig) if f.metadata["kind"] == "table"}
    choices = next(f for f in dataclasses.fields(ParallelConfig) if f.name == "strategy").metadata["choices"]
    assert list(tables) == list(STRATEGIES) == list(choices)
    assert tables == {name: spec.settings for name, spec in STRATEGIES.items()}
    cfg = config_from_dict({})
    assert all(isinstance(getattr(cfg.parallel, name), spec.settings) for name, spec in STRATEGIES.items())


def test_every_strategy_is_one_package():
    """Its spec and settings in its package's spec.py, its code (builder or loops) in the same package, which
    exports them: engine/strategies/NAME/."""
    for spec in STRATEGIES.values():
        package = f"engine.strategies.{spec.name}"
        assert any(value is spec for value in vars(importlib.import_module(f"{package}.spec")).values()), spec.name
        assert spec.settings.__module__ == f"{package}.spec", spec.name
        for path in (spec.builder, spec.loops, spec.apart, spec.stages):
            assert not path or path.startswith(f"{package}:"), f"{spec.name}: {path}"


def test_every_string_names_code_that_exists():
    for spec in STRATEGIES.values():
        assert bool(spec.builder) != bool(spec.loops), f"{spec.name}: built for the step loop, or loops of its own"
        for path in (spec.builder, spec.loops, spec.apart, spec.stages):
            assert not path or callable(resolve(path)), f"{spec.name}: {path}"
        assert not spec.apart or spec.apart_from is not None


def test_the_hellos_commands_are_the_strategys_spec_and_the_loops_own():
    """The spec is where a strategy's commands come from: the hello's capabilities are its, then the loop's own
    (the step loop's set-policy), and a command its config turns off is declined with why (the hub's answer)."""
    from types import SimpleNamespace
    from engine.runtime.lifecycle import hello
    topo = SimpleNamespace(world_size=2, hosts=lambda: [0, 0], backend="gloo")
    device = SimpleNamespace(name="cpu", simulated=True, rank_names=None, note="")

    def said(overrides: dict, loop=()) -> dict:
        return hello(config_from_dict({"parallel": overrides}), topo, device, ["fc0"], {}, ["fc0"], loop)

    assert said({})["capabilities"] == list(COMMANDS) and said({})["declined"] == {}
    assert said({"strategy": "sharded"}, ["set-policy"])["capabilities"] == list(COMMANDS) + ["set-policy"]
    assert said({"strategy": "param_server", "world_size": 2})["capabilities"] == [
        "pause", "resume", "stop", "checkpoint", "set-sync"]
    off = said({"strategy": "pipeline", "pipeline": {"rebalance": "off"}}, ["set-policy"])
    assert off["capabilities"] == list(COMMANDS) + ["set-policy"]
    assert off["declined"] == {"rebalance": 'rebalancing is off in this run (parallel.pipeline.rebalance = "off")'}
    on = said({"strategy": "pipeline", "pipeline": {"rebalance": "manual"}}, ["set-policy"])
    assert on["capabilities"] == list(COMMANDS) + ["rebalance", "set-policy"] and on["declined"] == {}


def test_the_config_reads_the_registry_without_torch():
    """And each strategy's package imports its torch half only when first asked for it."""
    code = ("import sys, importlib, engine.config, engine.strategies.specs as s; engine.config.config_from_dict({}); "
            "[importlib.import_module(f'engine.strategies.{name}') for name in s.STRATEGIES]; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_no_module_outside_the_strategies_branches_on_a_strategys_name():
    """issue 56: the run, the telemetry, the console and the config ask a strategy's spec (its commands, its
    split, its checks...), never compare a strategy's name: a comparison with a name in quotes, or membership
    in a literal holding one, outside engine/strategies/ (the strategies' own packages), engine/bench/ and
    engine/plan/ (the memory each built-in strategy's layouts hold, on paper: docs/plan.md)."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    names = set(STRATEGIES)
    found = []
    for folder in ("engine", "console", "widgets", "demo"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(("engine/strategies/", "engine/bench/", "engine/plan/")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Compare):
                    continue
                for side in [node.left, *node.comparators]:
                    literals = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    if any(isinstance(x, ast.Constant) and x.value in names for x in literals):
                        found.append(f"{rel}:{node.lineno}")
    assert found == []
