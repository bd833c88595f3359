"""What every worker imports of the engine, loaded once in the launcher's fork server (launch.py) beside torch
(engine/processes/forkserver.py: TORCH), so that a worker starts as a fork of a process that has it all.
Imported by name (engine.run.PRELOAD), by nothing else."""

import engine.run.launch  # noqa: F401  (the workers' entry point and all it imports)
import engine.strategies.ddp  # noqa: F401
import engine.strategies.pipeline  # noqa: F401
import engine.strategies.sharded  # noqa: F401
import engine.strategies.param_server  # noqa: F401
import engine.telemetry.outlets  # noqa: F401
