"""The scheduling techniques a strategy applies, each with its planner, apart from the strategies'
communication.

- hybrid.py + layer_update.py + update_plan.py: technique 3, each layer's optimizer update on the
  device or the host, planned from a measured trial (update_plan.py: the cost model, exact planner).
- memory/: technique 4's per-layer activation policy (keep / swap to host / recompute), the host
  link and the planners.
- partition.py, rebalance.py, migration.py, tied.py: technique 4's pipeline balance: the exact split, the
  timing and the decision, the live move of layers between stages, a weight tied across stages.
- ps_sync.py: technique 5's sync rules (soft windows, bsp, asp, ssp, staleness scaling).

Imports: engine.config, engine.optim and engine.runtime's lower modules (devices, profiler,
topology, checkpoint, emulate). Never a strategy, engine.runtime.worker or engine.runtime.launch.
"""
