"""The parallel strategies: how a model's training is spread over ranks. Each is applied to a model (a
LayerList), never written into it, and the step loop reaches it through one contract (base.py: Strategy, every
call the loop makes, with defaults; interface.py: make_strategy).

- ddp.py: torch DistributedDataParallel, the baseline (and the loss and layer grouping the others share).
- sharded/: techniques 1 and 2, sharded ownership with a multi-stream sliced broadcast and the forward
  gated per layer (plan.py, streams.py, strategy.py).
- pipeline/: technique 4's pipeline: stage, schedule, rebalancing (as events), migration, tied weights, through
  engine.techniques' partition and rebalance decision.
- param_server/: technique 5: servers, workers and their links, with its own loops (the coordinator shares the
  operator's commands and the run's end with the step loop: engine/runtime/lifecycle.py).

Imports: engine.config, engine.models, engine.training.data, engine.training.loss, engine.training.optim, engine.runtime (the ground),
engine.techniques, and (the parameter server's coordinator) engine.telemetry.outlets. Never engine.run: the
run hands the parameter server its rank setup (build_rank).
"""
