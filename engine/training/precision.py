"""Which dtype each tensor has: `[precision] compute, params, reduce` (docs/precision.md).

    with compute_in(cfg.precision, device):      # every forward and backward of a step, every strategy
        loss = strategy.train_step(x, y)
    model.to(param_dtype(cfg.precision))         # the working weights every rank computes with
    reduce_dtype(cfg.precision)                  # the dtype gradients are summed in
    dtype_code(torch.bfloat16) -> 1; DTYPES[1] -> torch.bfloat16   # a pipeline header names its tensor's dtype

With `params = "bf16"` the working weights, their gradients and everything on a link that carries weights
or gradients are bf16; the fp32 master weights and the optimizer state live only where an update runs
(engine/techniques/updates/layer.py: the owner in sharded, the host for a host-placed layer; the server in
param_server), and the ledger counts the masters under `master`. `reduce = "fp32"` widens bf16
gradients to fp32 for the sum (the result is stored back as the bf16 gradient every update reads, on the
device or the host alike); `reduce = "bf16"` sums them as they are.

With `compute = "bf16"` a step runs under `torch.autocast(dtype=torch.bfloat16)`: matmuls and convolutions
in bf16, the loss and reductions in fp32 (autocast's own lists). The weights, their gradients, the optimizer
state and every reduction stay fp32, so updates and checkpoints are as in fp32. Autocast is thread-local:
the host executor's updates never see it. Recompute (torch.utils.checkpoint) replays a forward under the
autocast state it first ran in. `fp32` enters no context at all: fp32 runs are bit for bit as before.
Imports torch only.
"""

from __future__ import annotations

import contextlib

import torch

# the dtypes a tensor crossing a link may have, by code (a pipeline's header carries the code)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"a tensor of dtype {dtype} cannot cross a link; links carry {', '.join(map(str, DTYPES))}")
    return DTYPES.index(dtype)


def compute_in(precision, device: torch.device | str):
    """The context every forward and backward of a step runs in (a no-op for fp32)."""
    if precision.compute == "fp32":
        return contextlib.nullcontext()
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    return torch.autocast(device_type=kind, dtype=torch.bfloat16)


def param_dtype(precision) -> torch.dtype:
    """The working weights' dtype: what every rank computes with and every weight link carries."""
    return torch.bfloat16 if precision.params == "bf16" else torch.float32


def reduce_dtype(precision) -> torch.dtype:
    """The dtype gradients are summed in across ranks."""
    return torch.bfloat16 if precision.reduce == "bf16" else torch.float32
