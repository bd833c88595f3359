"""Technique 3 and every strategy's optimizer: each layer's update, on the device or the host, planned from
profiled times and memory so host updates overlap backward.

- updater.py: LayerUpdates, what a strategy steps: every layer's update dispatched as its gradients are final,
  the clipping guard over every rank (engine/techniques/step_guard.py); trial.py: PlacementTrial, its
  `trial`: the trial steps and the plan made from them; state.py: UpdateCheckpoint, its `checkpoint`: what a
  checkpoint holds of the updates.
- layer.py: one layer's update: its optimizer, its fp32 masters, its side (device or host), speculation;
  host.py: the threads that run host updates.
- cost.py + plan.py + search.py: the cost model, the exact planner and the searches (pure functions).
- report.py: a plan just made, as events (the update_plan record, update_profile.json).

Imports engine.config, engine.training.optim, engine.training.precision, engine.training.timing, engine.runtime (the ground) and
engine.techniques.step_guard.
"""
