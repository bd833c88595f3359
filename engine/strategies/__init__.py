"""The parallel strategies: how a model's training is spread over ranks. Each is applied to a model (a
LayerList), never written into it, and the step loop reaches it through one contract (base.py: Strategy, every
call the loop makes, with defaults; interface.py: make_strategy).

- specs/: every strategy described before it is built, torch-free, in one registry (STRATEGIES): its name,
  who shares the data, its checks and refusals, its commands, and its builder or loops as "module:function"
  strings. It sits on the config's floor (engine.config reads it), so this __init__ imports nothing.
- ddp.py: torch DistributedDataParallel, the baseline. Each strategy's module or package exports `build`, what
  its spec's `builder` names (the pipeline also `stages_of`).
- sharded/: techniques 1 and 2, sharded ownership with a multi-stream sliced broadcast and the forward
  gated per layer (plan.py, streams.py, strategy.py).
- pipeline/: technique 4's pipeline: stage, schedule, its partition and rebalance decision, rebalancing (as
  events), migration, tied weights.
- param_server/: technique 5: servers, workers and their links, with its own loops (the coordinator shares the
  operator's commands and the run's end with the step loop: engine/runtime/lifecycle.py).

Imports (specs/ aside: nothing of the engine when loaded): engine.config, engine.models, engine.training.data,
engine.training.loss, engine.training.optim, engine.runtime (the ground), engine.techniques, and (the parameter
server's coordinator) engine.telemetry.outlets. Never engine.run: the run hands the parameter server its rank
setup (build_rank).
"""
