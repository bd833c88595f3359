"""Benchmarks: `trainyard bench NAME [--json]`. Each runs its variants side by side in one
invocation and prints ratios; absolute times on a shared machine are noise, ratios are the figures.

    trainyard bench telemetry            # throughput with 0, 1 and 10 consoles attached
"""

from __future__ import annotations

import importlib

BENCHES = {"telemetry": "engine.bench.telemetry"}


def run(name: str, argv: list[str]) -> int:
    module = importlib.import_module(BENCHES[name])
    return module.main(argv)
