"""Optimizers from `[optim]`: SGD with momentum, AdamW; fused kernels where torch has them.

    opt = make_optimizer(cfg.optim, params)     # kernel "auto": fused, else foreach

A fused step is one kernel over all of a layer's tensors: on an H100's host, AdamW over 100M fp32
parameters took 110 ms fused against 716 ms with foreach (single thread). Host updates
(engine/techniques/hybrid.py) run far beside backward only at that speed. The device side uses the same
kernel, so an update gives the same values wherever it runs.
"""

from __future__ import annotations

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
