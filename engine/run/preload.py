"""What every worker imports of the engine, loaded once in the launcher's fork server (launch.py) beside torch
(engine/processes/forkserver.py: TORCH), so that a worker starts as a fork of a process that has it all: the
launcher and what it imports, every strategy in the registry (engine/strategies/specs/) with all its package
exports, and the outlets. Imported by name (engine.run.PRELOAD), by nothing else."""

import importlib

import engine.run.launch  # noqa: F401  (the workers' entry point and all it imports)
import engine.telemetry.outlets  # noqa: F401
from engine.strategies.specs import STRATEGIES

for _spec in STRATEGIES.values():   # its package, where its builder or loops are; most of its exports load late
    _package = importlib.import_module((_spec.builder or _spec.loops).partition(":")[0])
    for _name in getattr(_package, "__all__", ()):
        getattr(_package, _name)
