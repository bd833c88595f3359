"""`[parallel]`: what every strategy shares (which strategy, how many workers, the backend, timeouts,
restarts), and one table per strategy with its own keys, handed to that strategy whole:

    [parallel]
    strategy = "sharded"
    world_size = 4

    [parallel.sharded]
    streams = 4            # --set parallel.sharded.streams=4

A strategy's key written flat in `[parallel]` (the layout before 2026-11-26: `parallel.streams`) is still
accepted: check.py moves it into its table (MOVED) and the command says the new name in one line.
The strategies' names, their lines of docs and their tables come from their registry
(engine/strategies/specs/registry.py: STRATEGIES, torch-free): a strategy's table is declared in its package's
spec.py (its StrategySpec's `settings`) and becomes a field of ParallelConfig named as the strategy, so a new
strategy needs no edit here. Imports declare.py and that registry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.config.declare import setting, table
from engine.strategies.specs.registry import STRATEGIES


def a_table_per_strategy(cls: type) -> type:
    """`cls` with a field per strategy in the registry, named as it and holding its settings table whole
    (`[parallel.sharded]`: ShardedConfig, declared in engine/strategies/sharded/spec.py), after its own keys."""
    for spec in STRATEGIES.values():
        cls.__annotations__[spec.name] = spec.settings
        setattr(cls, spec.name, table(spec.settings))
    return cls


@dataclass
@a_table_per_strategy
class ParallelConfig:
    """How the workers share the training, and how they survive failures. Each strategy's own keys are in its
    table below (`[parallel.sharded]`, ...)."""

    strategy: str = setting("ddp", "Parallel strategy. " + " ".join(
        f"`{s.name}`: {s.about} ([parallel.{s.name}]{', ' + s.docs if s.docs else ''})." for s in STRATEGIES.values()),
        choices=tuple(STRATEGIES))   # engine/strategies/specs/: each one's description, torch-free
    world_size: int = setting(2, "Worker processes on this machine.", min=1, max=256)
    backend: str = setting("auto", "Collective backend: `auto` picks nccl when every worker has its own "
                                   "CUDA GPU, otherwise gloo on the CPU.", choices=("auto", "gloo", "nccl"))
    collective_timeout_s: float = setting(60.0, "Timeout of every collective: a dead peer becomes an "
                                                "error after this long, never a hang.", min=1.0)
    max_restarts: int = setting(3, "Times the launcher restarts the worker group from the last "
                                   "checkpoint after a worker dies.", min=0)
    shutdown_timeout_s: int = setting(5, "On Ctrl-C or SIGTERM, seconds workers get to write the final "
                                         "checkpoint before they are killed (torch 2.12 and later; before, torch waits "
                                         "its own 30 s and the run says so).", min=1)


# a strategy's key once written flat in [parallel] -> the table it lives in now: the keys of the four strategies
# there were when the tables came (2026-11-26); a strategy added since never had a flat name
ONCE_FLAT = ("ddp", "sharded", "pipeline", "param_server")
MOVED = {"parallel": {key.name: name for name in ONCE_FLAT for key in dataclasses.fields(STRATEGIES[name].settings)}}
