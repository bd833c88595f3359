"""Optimizers from `[optim]`: SGD with momentum, AdamW."""

from __future__ import annotations

import torch

from engine.config import OptimConfig


def make_optimizer(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    raise ValueError(f"optim.name = {cfg.name!r}: must be one of 'sgd', 'adamw'")
