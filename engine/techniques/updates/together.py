"""Layers' device updates in one launch: after backward, with every update on the device, each layer's
optimizer is ready at once, and one multi-tensor launch steps them all (engine/training/optim.py
step_together) where one launch per layer did (the host's cost per launch counts where the model is small
beside the device, as on a GPU).

    step_device_together(updates)   # each `u.joins`; called by the updater (updater.py run_device_ready)
"""

from __future__ import annotations

import torch

from engine.training.optim import step, step_together


@torch.no_grad()
def step_device_together(updates: list) -> None:
    """Device updates (layer.py LayerUpdate) that each `join`, their gradients final: one launch where their
    optimizers allow, each other one on its own, then their gradients freed or zeroed. A layer's device time
    is the launch's, shared by its elements (AdamW's work is per element): what the update planner reads."""
    t0 = updates[0].clock.mark()
    left = set(map(id, step_together([u.optimizer for u in updates])))
    for u in updates:
        if id(u.optimizer) in left:
            step(u.optimizer)
        u.grads_done()
    t1 = updates[0].clock.mark()
    total = sum(u.elements for u in updates)
    for u in updates:
        u.device_marks(t0, t1, u.elements / total)
