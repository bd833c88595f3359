"""An evaluation through the pipeline (issue 57): each replica reads its share of the test samples, its stage 0
runs them through its layers and sends the activations on, chunk by chunk, as the forward schedule does, and its
last stage counts the correct predictions against the labels it reads itself; the counts are summed over every
rank. No stage gathers another's weights, so no rank ever holds a model it does not train.

    accuracy = evaluate(stage, ds, precision, limit)   # every rank; the same figure on each

The figure is test_accuracy's (engine/training/loss.py): the share of the first `limit` test samples' counted
targets that the argmax gets right, as training computes (bf16 under autocast). Messages are migration.py's blobs
(a tensor of any shape and dtype), point to point on the replica's pipeline group, on a tag of their own.

Imports torch.distributed and the pipeline's migration messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.strategies.pipeline.migration import recv_blob, send_blob
from engine.training.loss import IGNORE
from engine.training.precision import compute_in

EVAL_TAG = 7   # the schedule's are 0 and 1, a migration's 2, 3 and 6, tied weights' 4 and 5
CHUNK = 1024   # test samples a stage runs at once (test_accuracy's)


@torch.no_grad()
def evaluate(st, ds, precision, limit: int) -> float | None:
    """The test accuracy over every replica's share (None without a test split, or for targets that are not
    classes); every rank of the run calls it and gets it."""
    if ds.x_test is None or len(ds.x_test) == 0 or ds.y_test.is_floating_point():
        return None
    st.sync()   # host updates, and sharded replicas' broadcasts, have landed
    n = len(ds.x_test) if limit <= 0 else min(limit, len(ds.x_test))
    replicas, dev = st.grid.replicas, st.device.torch_device
    lo, hi = n * st.replica // replicas, n * (st.replica + 1) // replicas
    counts = torch.zeros(2, dtype=torch.float64, device=dev)
    st.model.eval()
    try:
        for a in range(lo, hi, CHUNK):
            b = min(a + CHUNK, hi)
            if st.is_first:
                h = ds.x_test[a:b].to(dev)
            else:
                h, _ = recv_blob(st.prev, EVAL_TAG, st.group, dev)
                h = h.to(dev)
            with compute_in(precision, dev):
                for layer in st.model.layers[st.start:st.end]:
                    h = layer(h)
            if not st.is_last:
                works, _ = send_blob(h, st.next, EVAL_TAG, st.group, dev)
                for work, _t in works:
                    work.wait()
                continue
            y = ds.y_test[a:b].to(dev)
            keep = y != IGNORE
            counts[0] += ((h.argmax(dim=-1) == y) & keep).sum()
            counts[1] += keep.sum()
    finally:
        st.model.train()
    dist.all_reduce(counts, group=st.topo.compute)   # the last stages' counts, on every rank
    correct, total = (int(v) for v in counts.tolist())
    return correct / total if total else None
