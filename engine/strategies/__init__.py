"""The parallel strategies: how a model's training is spread over ranks. Each is applied to a model (a
LayerList), never written into it, and the step loop reaches it through one small interface
(interface.py: Strategy, make_strategy).

- ddp.py: torch DistributedDataParallel, the baseline (and the loss and layer grouping the others share).
- sharded/: techniques 1 and 2, sharded ownership with a multi-stream sliced broadcast and the forward
  gated per layer (plan.py, streams.py, strategy.py).
- pipeline.py: technique 4's pipeline: stages, 1F1B / GPipe micro-batches, live rebalancing through
  engine.techniques (partition, rebalance, migration).
- param_server/: technique 5: servers, workers and their links, with its own loops.

Imports: engine.config, engine.models, engine.data, engine.optim, engine.runtime's lower modules
(devices, topology, checkpoint, profiler, control, rank), engine.techniques, and (the parameter
server's coordinator, which runs its own loop) engine.telemetry.outlets. Never engine.runtime.worker
or engine.runtime.launch (they import the strategies).
"""
