"""An evaluation through the pipeline (issue 57): each replica reads its share of the test samples, its stage 0
runs them through its layers and sends the activations on, chunk by chunk, as the forward schedule does, and its
last stage counts them against the labels it reads itself; the counts are summed over every rank. No stage's
weights travel to another.

    figures = evaluate(stage, ds, precision, limit, chunk)   # every rank; the same figures on each

The figures are engine/training/evaluation.py's (the test accuracy, the validation loss over every counted target
and its perplexity), as training computes them (bf16 under autocast). Messages are migration.py's blobs (a tensor
of any shape and dtype), point to point on the replica's pipeline group, on a tag of their own.

Imports torch.distributed and the pipeline's migration messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.strategies.pipeline.migration import recv_blob, send_blob
import engine.training.evaluation as evaluation
from engine.training.precision import compute_in

EVAL_TAG = 7   # the schedule's are 0 and 1, a migration's 2, 3 and 6, tied weights' 4 and 5


@torch.no_grad()
def evaluate(st, ds, precision, limit: int, chunk: int) -> dict:
    """The evaluation's figures over every replica's share; every rank of the run calls it and gets them."""
    n = evaluation.samples(ds, limit)
    if not n:
        return dict(evaluation.NONE)
    st.sync()   # host updates, and sharded replicas' broadcasts, have landed
    dev = st.device.torch_device
    lo, hi = evaluation.share(n, st.replica, st.grid.replicas)
    counts = torch.zeros(len(evaluation.FIELDS), dtype=torch.float64, device=dev)
    st.model.eval()
    try:
        for a in range(lo, hi, max(1, chunk)):
            b = min(a + max(1, chunk), hi)
            h = ds.x_test[a:b].to(dev) if st.is_first else recv_blob(st.prev, EVAL_TAG, st.group, dev)[0].to(dev)
            with compute_in(precision, dev):
                for layer in st.model.layers[st.start:st.end]:
                    h = layer(h)
            if st.is_last:
                counts += evaluation.chunk_counts(h, ds.y_test[a:b].to(dev), st.loss_fn)
            else:
                works, _ = send_blob(h, st.next, EVAL_TAG, st.group, dev)
                for work, _t in works:
                    work.wait()
    finally:
        st.model.train()
    dist.all_reduce(counts, group=st.topo.compute)   # the last stages' counts, on every rank
    return evaluation.figures(counts, st.loss_fn)
