"""Parameter server (technique 5): servers own layers, workers push gradients and pull weights.

    [parallel]
    strategy = "param_server"

    [parallel.param_server]
    servers = 2          # ranks 0..1
    workers = 4          # ranks 2..5
    sync = "soft"        # or "bsp", "asp", "ssp" (engine/techniques/ps_sync.py says what each does)

Ranks below `servers` are servers; each owns whole layers, assigned so that every
server holds about the same parameter bytes, with their optimizer state. A worker,
every iteration, asks each layer's server for its weights before that layer's forward
and sends the layer's gradient to it as soon as that layer's backward completes.

Transport: torch.distributed point-to-point on one two-rank process group per
(server, worker) pair and per (server 0, server) pair. A worker that dies closes only
its own links: the servers see it at once, say so, and go on with the others. Nothing
in this mode uses a collective over every rank after the start, because any worker may
be gone. Server 0 is the coordinator: it holds the hub, counts the global step,
applies commands, logs the telemetry and decides when the run ends.

A worker process runs under a small supervisor (`supervise`) that the elastic agent
sees as the rank: a worker that dies is reported and the rest of the run goes on,
where the agent would otherwise restart everything. A server that dies ends the
worker group; the agent restarts it from the last checkpoint (`parallel.max_restarts`).

Here: spec.py (what it is before it is built, torch-free, on the config's floor: SPEC, its StrategySpec;
ParamServerConfig, its table; its checks), links.py (the two-rank groups, the message kinds and flags, Link),
setup.py (the layers' owners and what every rank builds alike: Setup, from the run's build_rank), server.py (a
server rank: PSServer), coordinator.py (server 0: Coordinator, and run_server, where every server rank starts;
it drives the run core as the step loop does, engine/runtime/run_core.py), losses.py
(the step records' loss), worker.py (a worker rank: PSWorker, SlowMachine, supervise). Within it links <- setup
<- server <- coordinator and links, setup <- worker: a server and a worker never import each other. It may
import engine.runtime (the ground: topology, checkpoint, control, lifecycle, run_core), engine.techniques.ps_sync (the
sync rules), engine.models (params_by_layer, the layer grouping), engine.training.loss, engine.training.optim,
engine.training.data and engine.telemetry.outlets; nothing imports it back but engine.run.worker_entry
(worker_main: run_server, supervise) and tests. This file imports spec.py when loaded and the rest when first
asked for (`from engine.strategies.param_server import run_server`), so that reading the registry loads no
torch.
"""

from __future__ import annotations

from engine.strategies.param_server.spec import SPEC, ParamServerConfig
from engine.strategies.specs.spec import late_exports

__all__ = ["SPEC", "ParamServerConfig", "ParamServerError", "assign_layers", "layer_params", "run_server",
           "supervise"]

LATER = {"run_server": "coordinator", "supervise": "worker",   # a name -> its module here, imported late
         **dict.fromkeys(("ParamServerError", "assign_layers", "layer_params"), "setup")}

__getattr__ = late_exports(__name__, LATER)   # a torch-heavy export, imported when first asked for
