"""What a strategy is before it is built: StrategySpec, torch-free, so the config, its checks and the launcher
know every strategy without importing one. Each strategy's package holds its own in `spec.py`
(engine/strategies/NAME/spec.py: its StrategySpec, its settings table and its checks); the registry lists them
(registry.py). A strategy's code is named in `module:function` strings that only the floors above resolve
(resolve, called by make_strategy, worker_main and the fork server's preload).

    spec = STRATEGIES[cfg.parallel.strategy]
    parts, words = spec.split(cfg)              # the global batch's equal parts: 4, "parallel.world_size = 4"
    strategy = resolve(spec.builder)(cfg, model, topo, device, loss_fn)

Imports nothing of the engine: a strategy's spec.py imports it, and engine.config.declare, when loaded.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable

COMMANDS = ("pause", "resume", "stop", "checkpoint", "set-placement")   # what an operator can do in every mode

Check = Callable[[Any], "str | None"]   # a Config -> a message, or None (engine/config/rules.py)


def every_rank(cfg) -> tuple[int, str]:
    """The data-parallel split: every rank of the world takes an equal share of the global batch."""
    world = cfg.parallel.world_size
    return world, f"parallel.world_size = {world}"


def resized(cfg, world: int):
    """The config at another world size: one host count of a range of hosts."""
    return replace(cfg, parallel=replace(cfg.parallel, world_size=world))


def same_commands(cfg) -> tuple[str, ...]:
    return COMMANDS


def none_declined(cfg) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class StrategySpec:
    """One strategy: its name (`parallel.strategy`), its settings (the table `[parallel.NAME]`, handed to it
    whole), what it refuses, who shares the data, and where its code is."""

    name: str
    about: str            # its line in `parallel.strategy`'s docs
    settings: type        # its table's dataclass of setting()s (engine/config/declare.py): a field of ParallelConfig
    # the per-rank figures it reports besides every run's (engine/telemetry/figures.py: Figure), in the log's rank
    # entries and the boundary's exchange; the hello carries them to the console (engine/strategies/specs/figures.py)
    figures: tuple = ()
    docs: str = ""        # its page, for the same line
    # who shares the data: the equal parts one global batch is cut into and how a message names them
    split: Callable[[Any], tuple[int, str]] = every_rank
    per_rank: bool = True   # a part per rank (false: every rank takes the whole batch, its parts micro-batches
                            # in flight: a pipeline's stage 0 takes the inputs, its last stage the labels)
    holder: str = "every rank"   # who holds every layer, for the capacity's refusal (engine/run/checks.py)
    stages: str = ""        # "module:function(cfg, model, world) -> [[layer, ...], ...]": ranks hold stages
    commands: Callable[[Any], tuple[str, ...]] = same_commands   # the operator commands it takes (the hello's)
    # its commands this config turns off, each with why: the hub's answer to one (the hello's `declined`)
    declined: Callable[[Any], dict[str, str]] = none_declined
    # its rules across keys, in order (engine/config/rules.py runs them): within its own table, whichever strategy
    table_checks: tuple[Check, ...] = ()   # is chosen (every table is checked); where it is chosen, before the
    checks: tuple[Check, ...] = ()         # batch's split is checked,
    checks_after_batch: tuple[Check, ...] = ()   # and after it (a problem here is reported once the batch splits)
    # keys it cannot take, each with why (the rule that owns the key phrases the refusal): "optim.clip_grad_norm"
    refuses: dict[str, str] = field(default_factory=dict)
    # the emulate.kill_at moments it owns, each a check that the config has that moment (kill_has_its_moment)
    moments: dict[str, Check] = field(default_factory=dict)
    # with a range of hosts (cluster.min_nnodes < nnodes; engine/config/rules.py: every_host_count_holds)
    in_host_range: Check | None = None   # what it refuses of the range itself, before every count is checked
    at_world: Callable[[Any, int], Any] = resized   # the config at one count's world size
    builder: str = ""       # "module:function(cfg, model, topo, device, loss_fn) -> Strategy" (make_strategy)
    # a strategy with loops of its own instead of the step loop (engine/run/worker_entry.py: worker_main)
    loops: str = ""         # "module:function(job, topo, stop, build_rank)": a rank of the run's group
    apart: str = ""         # "module:function(job, build_rank)": a rank outside the group, whose death the
    apart_from: Callable[[Any], int] | None = None   # run outlives; ranks from apart_from(cfg) up run it


def late_exports(package: str, later: dict[str, str]) -> Callable[[str], Any]:
    """A package's module `__getattr__` (PEP 562): each name of `later` is imported from its module there
    ({name: module}) when first asked for, so that a strategy's package loads no torch until its code is used.

        __getattr__ = late_exports(__name__, {"ShardedStrategy": "strategy"})   # engine/strategies/sharded/
    """
    def __getattr__(name: str) -> Any:
        if name not in later:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{later[name]}"), name)
    return __getattr__


def resolve(path: str) -> Any:
    """'engine.strategies.ddp:build' -> that function, imported now (never on the config's floor)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
