"""What every worker imports, loaded once in the launcher's fork server (launch.py), so that a worker starts as a
fork of a process that has it all: torch (1.4 s a process on this CPU), torch._dynamo (1.4 s more: torch's
optimizers import it on their first construction) and the engine. Imported by nothing else."""

import torch
import torch._dynamo  # noqa: F401  (torch.optim.Optimizer.__init__ imports it; here once, not per worker)
import torch.distributed  # noqa: F401

import engine.runtime.launch  # noqa: F401  (the workers' entry point and all it imports)
import engine.strategies.ddp  # noqa: F401
import engine.strategies.pipeline  # noqa: F401
import engine.strategies.sharded  # noqa: F401
import engine.strategies.param_server  # noqa: F401
import engine.telemetry.outlets  # noqa: F401
