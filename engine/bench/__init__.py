"""Benchmarks: `trainyard bench NAME [--json]`. Each runs its variants side by side in one
invocation and prints ratios; absolute times on a shared machine are noise, ratios are the figures.

    trainyard bench telemetry            # throughput with 0, 1 and 10 consoles attached
    trainyard bench console              # the console's CPU and key-to-run delay, 64 ranks x 200 layers
    trainyard bench broadcast            # sharded + sliced multi-stream broadcast + gated forward vs DDP
    trainyard bench hybrid               # each layer's update on the device or the host: planners vs fixed
    trainyard bench pipeline             # a skewed 4-stage pipeline rebalanced live vs best static and torch's
    trainyard bench memory               # per-layer keep/swap/recompute at 50% of keep's peak vs full recompute
    trainyard bench ps                   # parameter server: soft sync vs bsp, asp, ssp with a 3x slower worker
    trainyard bench checkpoint           # a 100M-parameter checkpoint written at 4 ranks, loaded at 2: times, RSS
    trainyard bench step                 # a user's Llama: trainyard's step against the plain loop, eager and compiled

Imports anything in engine (a bench drives the whole engine, or one technique alone); nothing in
engine imports a bench but the CLI.
"""

from __future__ import annotations

import importlib

BENCHES = {"telemetry": "engine.bench.telemetry", "console": "console.bench", "broadcast": "engine.bench.broadcast",
           "hybrid": "engine.bench.hybrid", "pipeline": "engine.bench.pipeline",
           "memory": "engine.bench.memory", "ps": "engine.bench.ps", "checkpoint": "engine.bench.checkpoint",
           "step": "engine.bench.step"}


def run(name: str, argv: list[str]) -> int:
    """Run bench `name`. It owns what it starts (engine/processes/children.py): a SIGTERM, SIGINT or SIGHUP
    unwinds it through its own clean-ups (a DistPool's ranks killed, a child run stopped, a folder removed)
    before it ends by that signal."""
    import engine.run  # noqa: F401  (a bench's pool forks its ranks with the engine imported, as the launcher's)
    from engine.processes.children import ChildRuns
    module = importlib.import_module(BENCHES[name])
    with ChildRuns():
        return module.main(argv)
