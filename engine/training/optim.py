"""Optimizers from `[optim]`: SGD with momentum, AdamW; fused kernels where torch has them; the learning rate of
each step.

    opt = make_optimizer(cfg.optim, params)     # kernel "auto": fused, else foreach
    lr = lr_at(cfg.optim, step, cfg.run.steps)  # the schedule: a pure function of the step

A fused step is one kernel over all of a layer's tensors: on an H100's host, AdamW over 100M fp32
parameters took 110 ms fused against 716 ms with foreach (single thread). Host updates
(engine/techniques/updates/updater.py) run far beside backward only at that speed. The device side uses the same
kernel, so an update gives the same values wherever it runs.
"""

from __future__ import annotations

import math

import torch

from engine.config import OptimConfig

_CLASSES = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def make_optimizer(cfg: OptimConfig, params, kernel: str | None = None) -> torch.optim.Optimizer:
    """`kernel` overrides `cfg.kernel` (benchmarks compare them)."""
    if cfg.name not in _CLASSES:
        raise ValueError(f"optim.name = {cfg.name!r}: must be one of 'sgd', 'adamw'")
    kernel = kernel or cfg.kernel
    params = list(params)
    if cfg.name == "sgd":
        settings = dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    else:
        settings = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    cls = _CLASSES[cfg.name]
    if kernel in ("auto", "fused"):
        try:
            return cls(params, fused=True, **settings)
        except (RuntimeError, ValueError) as e:   # this torch has no fused kernel for these tensors
            if kernel == "fused":
                raise ValueError(f"optim.kernel = \"fused\": torch {torch.__version__} has no fused {cfg.name} "
                                 f"for these parameters ({e}); use \"auto\" or \"foreach\"") from None
    return cls(params, foreach=True, **settings)


def lr_at(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """The learning rate of step `step` (from 0) of a run of `total_steps`: `warmup_steps` of linear warmup
    (step s: lr x (s + 1) / warmup), then `lr_schedule` from `lr` at the first step after the warmup down to
    `min_lr` at the run's last step (`constant`: `lr` throughout). The same number on every rank and after a
    resume, as it depends on nothing else."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - 1 - cfg.warmup_steps))
    if cfg.lr_schedule == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1.0 - progress)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
