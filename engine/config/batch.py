"""The global batch and the training loop, checked before any worker starts (CROSS_CHECKS rules of
engine/config/check.py): the batch splits over ranks, micro-batches and micro-steps (`data.accumulate`); the
schedule ends at or below its peak; clipping only where one global norm exists. How each strategy splits the
batch and what it refuses is its spec's (engine/strategies/specs/: split, per_rank, refuses). Imports
engine.config.settings and declare, and that registry."""

from __future__ import annotations

from engine.config.declare import show
from engine.config.settings import Config
from engine.strategies.specs import STRATEGIES


def near_multiples(n: int, k: int) -> str:
    """The multiples of k on either side of n, for a message's example."""
    return " or ".join(str(m) for m in (n // k * k, (n // k + 1) * k) if m > 0)


def batch_splits_over_ranks(cfg: Config) -> str | None:
    """Data parallel: `data.batch_size` is divisible by `parallel.world_size` (every rank gets the same
    share); pipeline: by `parallel.pipeline.micro_batches`."""
    batch, n, spec = cfg.data.batch_size, cfg.data.accumulate, STRATEGIES[cfg.parallel.strategy]
    ranks, words = spec.split(cfg)
    if not spec.per_rank and n > 1:   # its parts are micro-batches in flight: it accumulates over them
        return (f"data.accumulate = {n}: not available with parallel.strategy = {show(spec.name)}, which "
                f"accumulates over {words} (set data.accumulate = 1)")
    if n == 1 and batch % ranks:
        return f"data.batch_size = {batch}: must be divisible by {words} (e.g. {near_multiples(batch, ranks)})"
    if batch % (ranks * n):
        return (f"data.batch_size = {batch}: must be divisible by data.accumulate = {n} x {words} = {ranks * n} "
                f"(e.g. {near_multiples(batch, ranks * n)})")
    return None


def schedule_ends_low(cfg: Config) -> str | None:
    """`optim.min_lr` is at most `optim.lr`; the parameter server does not clip (its windows update each layer
    before the whole model's gradient norm exists)."""
    o = cfg.optim
    if o.lr_schedule != "constant" and o.min_lr > o.lr:
        return f"optim.min_lr = {o.min_lr:g}: must be at most optim.lr = {o.lr:g}"
    spec = STRATEGIES[cfg.parallel.strategy]
    if "optim.clip_grad_norm" in spec.refuses and o.clip_grad_norm > 0:
        return (f"optim.clip_grad_norm = {o.clip_grad_norm:g}: not available with parallel.strategy = "
                f"{show(spec.name)} yet ({spec.refuses['optim.clip_grad_norm']}); set it to 0")
    return None
