"""The parallel strategies: how a model's training is spread over ranks. Each is applied to a model (a
LayerList), never written into it, and the step loop reaches it through one contract (base.py: Strategy, every
call the loop makes, with defaults; interface.py: make_strategy).

- specs/: every strategy described before it is built, torch-free, in one registry (registry.py: STRATEGIES, a
  line per strategy): its name, its settings table, who shares the data, its checks and refusals, its commands,
  and its builder or loops as "module:function" strings. It sits on the config's floor (engine.config reads it).
- A strategy is one package: engine/strategies/NAME/, its spec.py (its StrategySpec, settings table and checks,
  torch-free, on the config's floor) beside its code, its __init__ exporting `build` (what its spec's `builder`
  names; the pipeline's also `stages_of`) and loading its torch-heavy modules only when first asked for.
- ddp/: torch DistributedDataParallel, the baseline (strategy.py).
- sharded/: techniques 1 and 2, sharded ownership with a multi-stream sliced broadcast and the forward
  gated per layer (plan.py, streams.py, strategy.py).
- pipeline/: technique 4's pipeline: stage, schedule, its partition and rebalance decision, rebalancing (as
  events), migration, tied weights.
- param_server/: technique 5: servers, workers and their links, with its own loops (the coordinator shares the
  run core with the step loop: engine/runtime/run_core.py).

A fifth strategy: a package here (its spec.py and its code), one line in specs/registry.py.

This file imports nothing; a strategy's package imports its spec.py when loaded. Its code imports
engine.config, engine.models, engine.training.data, engine.training.loss, engine.training.optim, engine.runtime
(the ground), engine.techniques, and (the parameter server's coordinator) engine.telemetry.outlets. Never
engine.run: the run hands the parameter server its rank setup (build_rank).
"""
