"""An evaluation: the test accuracy, the validation loss and its perplexity over the first `data.eval_samples`
samples of the test split (a tokens run's val.bin), computed as training computes (bf16 under autocast), from
counts that add up across ranks, so that every strategy's figure equals one worker's.

    counts = share_counts(model, ds, device, precision, loss_fn, lo, hi, chunk)   # samples [lo, hi), summed
    counts += chunk_counts(out, y, loss_fn)      # one chunk's, where the output is made elsewhere (a pipeline)
    figures(counts, loss_fn)                     # {"test_accuracy", "val_loss", "perplexity"}
    share(n, index, shares)                      # [lo, hi) of share `index`: every sample once

The loss is the sum over every counted target divided by their count (not a mean of the ranks' means): each
chunk's mean loss (the run's own loss function) times its counted targets (`counted`), summed in float64 with the
counts, over every share. The accuracy: the argmax right over the counted class targets (none for a user's
regression). The perplexity: exp of the validation loss, for the cross entropy only.

Imports engine.training.loss and engine.training.precision.
"""

from __future__ import annotations

import math

import torch

from engine.training.loss import IGNORE, counted, cross_entropy
from engine.training.precision import compute_in

FIELDS = ("correct", "classified", "loss_sum", "loss_count")   # the counts, in this order


def share(n: int, index: int, shares: int) -> tuple[int, int]:
    return n * index // shares, n * (index + 1) // shares


def samples(ds, limit: int) -> int:
    """The test samples an evaluation reads: the first `limit` (0: all), none without a test split."""
    if ds.x_test is None or len(ds.x_test) == 0:
        return 0
    return len(ds.x_test) if limit <= 0 else min(limit, len(ds.x_test))


@torch.no_grad()
def chunk_counts(out: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
    """One chunk's counts (FIELDS, float64, on the output's device)."""
    counts = torch.zeros(len(FIELDS), dtype=torch.float64, device=out.device)
    n = counted(y, loss_fn)
    if n:
        counts[2] = loss_fn(out, y).double() * n
        counts[3] = n
    if not y.is_floating_point():
        keep = y != IGNORE
        counts[0] = ((out.argmax(dim=-1) == y) & keep).sum()
        counts[1] = keep.sum()
    return counts


@torch.no_grad()
def share_counts(model, ds, device: torch.device, precision, loss_fn, lo: int, hi: int, chunk: int) -> torch.Tensor:
    """The counts of samples [lo, hi) of the test split, `chunk` samples at a time (at most a rank's training
    share: what fits in training fits here, without gradients)."""
    counts = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
    model.eval()
    try:
        for a in range(lo, hi, max(1, chunk)):
            b = min(a + max(1, chunk), hi)
            x, y = ds.x_test[a:b].to(device), ds.y_test[a:b].to(device)
            with compute_in(precision, device):
                out = model(x)
            counts += chunk_counts(out, y, loss_fn)
    finally:
        model.train()
    return counts


def figures(counts: torch.Tensor, loss_fn) -> dict:
    """What the eval event and the summary say: None where nothing was counted."""
    correct, classified, loss_sum, n = counts.tolist()
    val_loss = loss_sum / n if n else None
    perplexity = None
    if val_loss is not None and loss_fn is cross_entropy and math.isfinite(val_loss):
        perplexity = math.exp(val_loss) if val_loss < 700 else None   # past a float64: not said
    return {"test_accuracy": correct / classified if classified else None, "val_loss": val_loss,
            "perplexity": perplexity}


NONE = {"test_accuracy": None, "val_loss": None, "perplexity": None}   # no test split
