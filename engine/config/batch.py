"""The global batch and the training loop, checked before any worker starts (CROSS_CHECKS rules of
engine/config/check.py): the batch splits over ranks, micro-batches and micro-steps (`data.accumulate`); the
schedule ends at or below its peak; clipping only where one global norm exists. Imports only
engine.config.settings."""

from __future__ import annotations

from engine.config.settings import Config


def near_multiples(n: int, k: int) -> str:
    """The multiples of k on either side of n, for a message's example."""
    return " or ".join(str(m) for m in (n // k * k, (n // k + 1) * k) if m > 0)


def batch_splits_over_ranks(cfg: Config) -> str | None:
    """Data parallel: `data.batch_size` is divisible by `parallel.world_size` (every rank gets the same
    share); pipeline: by `parallel.pipeline.micro_batches`, and a partition list has `world_size` stages."""
    batch, world = cfg.data.batch_size, cfg.parallel.world_size
    p, pipe = cfg.parallel, cfg.parallel.pipeline
    n = cfg.data.accumulate
    if p.strategy == "pipeline":
        if n > 1:
            return (f"data.accumulate = {n}: not available with parallel.strategy = \"pipeline\", which "
                    f"accumulates over parallel.pipeline.micro_batches = {pipe.micro_batches} (set data.accumulate = 1)")
        if batch % pipe.micro_batches:
            return (f"data.batch_size = {batch}: must be divisible by parallel.pipeline.micro_batches = "
                    f"{pipe.micro_batches} (e.g. {near_multiples(batch, pipe.micro_batches)})")
        if isinstance(pipe.partition, list) and len(pipe.partition) != world:
            return (f"parallel.pipeline.partition lists {len(pipe.partition)} stages but parallel.world_size = {world} "
                    f"(one stage per worker)")
        return None
    if p.strategy == "param_server":
        ranks, words = p.param_server.workers, f"parallel.param_server.workers = {p.param_server.workers}"
    else:
        ranks, words = world, f"parallel.world_size = {world}"
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
    if cfg.parallel.strategy == "param_server" and o.clip_grad_norm > 0:
        return (f"optim.clip_grad_norm = {o.clip_grad_norm:g}: not available with parallel.strategy = "
                f"\"param_server\" yet (its servers update each layer as its window closes, before the whole "
                f"model's gradient norm is known); set it to 0")
    return None
