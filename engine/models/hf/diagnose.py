"""Why the layers made of a Hugging Face model compute another function than its forward: the first place
they part, in words (engine/models/hf/check.py raises it with the model's name).

    cause = diagnose(model, anatomy, layers, ids)

The model's own forward runs with each block wrapped, recording what it was handed and what it returned;
the layers are then run block by block from the same hidden states, and the first disagreement is named.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.hf.anatomy import Anatomy


class _Wrap(nn.Module):
    def __init__(self, block: nn.Module, index: int, log: dict):
        super().__init__()
        self.block, self.index, self.log = block, index, log

    def forward(self, hidden, *args, **kwargs):
        out = self.block(hidden, *args, **kwargs)
        self.log[self.index] = (hidden, args, kwargs, out)
        return out


def record(model: nn.Module, anatomy: Anatomy, ids: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Every block's (hidden in, args, kwargs, output) in the model's own forward on `ids`, and the logits."""
    log: dict = {}
    parent_path, _, attr = anatomy.blocks_path.rpartition(".")
    parent = anatomy.runner.get_submodule(parent_path) if parent_path else anatomy.runner
    original = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList([_Wrap(b, i, log) for i, b in enumerate(original)]))
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        setattr(parent, attr, original)
    return log, logits


def differences(a, b, path: str = "") -> list[str]:
    """Where two argument structures differ (tensors by value, shape and dtype; other values by ==)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype
                and a.device == b.device and torch.equal(a, b))
        return [] if same else [path or "the value"]
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}" if path else str(k))]
    try:
        return [] if type(a) is type(b) and a == b else [path or "the value"]
    except Exception:   # a value that does not compare (an object of the model's): the same object or not
        return [] if a is b else [path or "the value"]


def _names(args_kwargs_path: str) -> str:
    """`[1].attention_mask` -> `attention_mask`; `[0][2]` -> `positional argument 3`."""
    part = args_kwargs_path[3:] if args_kwargs_path.startswith("[1]") else args_kwargs_path
    if args_kwargs_path.startswith("[0]["):
        index = int(args_kwargs_path[4:].split("]")[0])
        return f"positional argument {index + 2}" + args_kwargs_path[4:].split("]", 1)[1]
    return part.lstrip(".")


@torch.no_grad()
def diagnose(model: nn.Module, anatomy: Anatomy, layers, ids: torch.Tensor) -> str:
    log, logits = record(model, anatomy, ids)
    other_log, _ = record(model, anatomy, (ids + 1) % logits.shape[-1])   # other tokens, the same shape
    embed, blocks = layers.layers[0], list(layers.layers[1:1 + anatomy.n_blocks])
    hidden = embed(ids)
    if not torch.equal(hidden, log[0][0]):
        return ("what the model does before its first block (embeddings, positions, scales) differs from "
                "its runner's forward up to the first block")
    for i, block in enumerate(blocks):
        _, args, kwargs, out = log[i]
        moved = differences((args, kwargs), (other_log[i][1], other_log[i][2]))
        if moved:
            return (f"block {i}'s argument {_names(moved[0])} depends on the token ids (trainyard computes a "
                    f"block's arguments from the input's shape alone)")
        mine = block.arguments(log[i][0])
        differ = differences((args, kwargs), mine)
        if differ:
            return f"block {i} is handed another {_names(differ[0])} than the model's forward hands it"
        got = block(log[i][0])
        want = out[0] if isinstance(out, tuple) else out
        if not torch.equal(got, want):
            return f"block {i}'s output differs though it is handed the same arguments"
    return ("the part after the blocks (final norm, output projection, the logits' caps and scales) differs "
            "from the model's")
