"""The training loss, and how a share of the global batch weighs in it, so that every strategy equals one worker.

    loss = weighted(loss_fn, out, y, counted(y, loss_fn) / total * shares)   # one share's part

The default loss is cross entropy over classes (B, C) or next tokens (B, T, V), **averaged over the counted
targets of the whole global batch**: a target of IGNORE (-100, as Hugging Face and torch use) counts for
nothing. Each strategy computes its share's loss as a mean over the share's own counted targets, and weighs
it by `counted(share) / counted(global batch)`, times the number of shares its gradients are averaged over
(ddp's and sharded's all-reduce average over the ranks; a parameter server's bsp window averages over the
workers; a pipeline sums its micro-batches). So the gradient is that of one mean over the global batch's
counted tokens whatever the shares hold, as Megatron and torchtitan divide by the globally reduced count.
Where every share counts the same (no IGNORE targets), each weight is exactly 1 (or micro / global), as
before. The global count is the data's (engine/training/data.py `global_count`): every rank reads it from the step's
global batch, without a collective.

A user's loss (`engine.train(..., loss_fn=f)`): `f(output, target)` returns the mean over the share's
samples, and a share counts its samples (len(target)). It must be picklable (a module-level function): the
workers load it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Classification (B, C) and next-token (B, T, V) losses alike: the mean over targets not IGNORE."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


def counted(targets: torch.Tensor, loss_fn=cross_entropy) -> int:
    """How many targets `loss_fn`'s mean over `targets` is taken over."""
    if loss_fn is cross_entropy and not targets.is_floating_point():
        return int((targets != IGNORE).sum())
    return len(targets)


def weighted(loss_fn, out: torch.Tensor, targets: torch.Tensor, weight: float) -> torch.Tensor:
    """`loss_fn(out, targets) * weight`; a share with nothing counted (weight 0) gives a zero loss that still
    reaches every parameter (its gradients are zero, not missing), where the mean itself would be 0/0."""
    if weight == 0:
        return out.sum() * 0.0
    loss = loss_fn(out, targets)
    return loss if weight == 1 else loss * weight


def share_weight(local: int, total: int, shares: int) -> float:
    """The weight of a share holding `local` of the global batch's `total` counted targets, in a mean that
    averages `shares` shares: exactly 1 when every share holds total / shares."""
    if total <= 0:
        raise ValueError("the global batch has no counted target (every label is -100): nothing to learn from")
    return 1.0 if local * shares == total else local * shares / total


def share_loss(loss_fn, out: torch.Tensor, y: torch.Tensor, total: int | None, shares: int,
               micro: int = 1) -> torch.Tensor:
    """One share's part of the global batch's mean loss, every strategy's: its `y` of the global batch's
    `total` counted targets, in a mean over `shares` shares. `total` None: every share holds as many (no
    label is IGNORE), so each weighs 1 and each of its `micro` micro-steps (data.accumulate) 1 / micro."""
    weight = 1.0 / micro if total is None else share_weight(counted(y, loss_fn), total, shares)
    return weighted(loss_fn, out, y, weight)


def step_value(losses: list[torch.Tensor]) -> float:
    """The step's loss, its micro-steps' parts summed, as a float: reading it waits for the step's work. One
    micro-step: its own value, with no addition to launch (`sum` adds it to 0 first)."""
    return float(losses[0]) if len(losses) == 1 else float(sum(losses))
