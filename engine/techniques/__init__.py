"""The scheduling techniques a strategy applies, each with its planner, apart from the strategies'
communication.

- updates/: technique 3, every strategy's optimizer: each layer's update on the device or the host (fp32
  masters, host updates speculating ahead of the clipping decision), planned from a measured trial.
- memory/: technique 4's per-layer activation policy (keep / swap to host / recompute), the host
  link and the planners; memory_report.py: its figures for the exchange, its plans as events, its refusal.
- ps_sync.py: technique 5's sync rules (soft windows, bsp, asp, ssp, staleness scaling).
- step_guard.py: the global gradient norm: clip or skip, every rank alike.

Technique 4's pipeline balance (the exact split, the stage times, the decision) is the pipeline's own:
engine/strategies/pipeline/.

Imports: engine.config, engine.training.optim, engine.training.timing and engine.runtime (the ground). Never a strategy or
engine.run (tests/test_layout.py).
"""
