"""The training loop's one decision per step: the global gradient norm from every rank's partial sums, and whether
the step is clipped, skipped or stands, the same on every rank.

    guard = StepGuard(cfg.optim)                # off when clip_grad_norm = 0 and skip_nonfinite = false
    decision = guard.decide(parts, group)       # parts: this rank's sums of squares (fp64), one per update
    decision.coef                               # the gradient's factor when clipped (torch's clip_grad_norm_)

Each parameter is counted once: a rank passes the sums of the updates it runs (engine/techniques/updates/layer.py
`grad_sq`), and `group` sums them over the ranks that hold different parameters: sharded's owners, a pipeline's
stages. ddp's ranks hold the same reduced gradients, so each decides alone (group None) and all decide alike.

How the updates keep early while the norm is unknown (engine/techniques/updates/updater.py): `clip_mode = "speculate"`
runs each layer's update as soon as its gradient is ready, keeping a copy of what it changes; the decision
then undoes (skip) or redoes with the clipped gradient (clip). `wait` holds the updates until the decision.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from engine.config import OptimConfig

EPS = 1e-6   # torch.nn.utils.clip_grad_norm_'s: coef = max_norm / (norm + 1e-6)


@dataclasses.dataclass
class GuardDecision:
    grad_norm: float | None = None   # None when no guard is on (nothing computed)
    clipped: bool = False
    skipped: bool = False
    coef: float = 1.0
    redone_layers: int = 0           # speculative updates undone or redone

    def fields(self) -> dict:
        """The step record's: grad_norm (None when not finite or not computed), clipped, skipped, redone_layers."""
        norm = self.grad_norm if self.grad_norm is not None and math.isfinite(self.grad_norm) else None
        return {"grad_norm": norm, "clipped": self.clipped, "skipped": self.skipped,
                "redone_layers": self.redone_layers}


class StepGuard:
    def __init__(self, cfg: OptimConfig, mode: str | None = None):
        self.clip = cfg.clip_grad_norm
        self.skip = cfg.skip_nonfinite
        self.on = self.clip > 0 or self.skip
        self.mode = mode or cfg.clip_mode

    def decide(self, parts: list[torch.Tensor], group=None, device: torch.device | None = None) -> GuardDecision:
        """From this rank's partial sums of squares, summed over `group`: the same GuardDecision on every rank."""
        if not self.on:
            return GuardDecision()
        if parts:
            total = torch.stack([p.to(torch.float64) for p in parts]).sum()
        else:
            total = torch.zeros((), dtype=torch.float64, device=device)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
        norm = math.sqrt(float(total))   # nan and inf stay so
        if not math.isfinite(norm):
            return GuardDecision(grad_norm=norm, skipped=self.skip)
        coef = self.clip / (norm + EPS) if self.clip > 0 else 1.0
        if coef < 1.0:
            return GuardDecision(grad_norm=norm, clipped=True, coef=coef)
        return GuardDecision(grad_norm=norm)
