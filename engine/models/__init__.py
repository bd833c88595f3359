"""Models: the LayerList API users build their own models with, and the built-in models.

    from engine.models import build_model, LayerList, Block
    ds = load_dataset(cfg.data, seed=cfg.run.seed)
    model = build_model(cfg.model, ds.meta, seed=cfg.run.seed)

build_model seeds torch before constructing, so every process (and every parallel
layout) that builds the same config starts from identical weights.

Models know nothing of parallelism: they import only torch and engine.config; strategies are applied
to them (engine/strategies/).
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.models.branchy import make_branchy
from engine.models.layers import Block, LayerList
from engine.models.mlp import make_mlp
from engine.models.transformer import make_transformer

__all__ = ["Block", "LayerList", "build_model", "make_branchy", "make_mlp", "make_transformer"]

# what each model needs from the data set's meta, and the kind of data that provides it
_NEEDS = {
    "mlp": (("input_dim", "num_classes"), "flat float features with integer labels (digits or synthetic)"),
    "transformer": (("vocab_size", "seq_len"), "text data (data.name = 'text')"),
    "branchy": (("image_shape", "num_classes"), "image data (digits, or synthetic with a square "
                                                "number of features)"),
}


def build_model(cfg: ModelConfig, meta: dict, seed: int) -> LayerList:
    if cfg.name == "user":
        raise ValueError('model.name = "user" names the model given to engine.train; a config file names a '
                         'built-in model or "hf"')
    if cfg.name == "hf":
        from engine.models.hf import from_files
        torch.manual_seed(seed)
        return from_files(cfg.hf_config, cfg.hf_weights, meta.get("vocab_size"))   # checked by the launcher
    if cfg.name not in _NEEDS:
        raise ValueError(f"unknown model {cfg.name!r}; built-in models are {sorted(_NEEDS)}")
    keys, kind = _NEEDS[cfg.name]
    missing = [k for k in keys if k not in meta]
    if missing:
        raise ValueError(f"model {cfg.name!r} needs {kind}: the data set's meta lacks {missing} "
                         f"(it has {sorted(meta)})")
    torch.manual_seed(seed)
    if cfg.name == "mlp":
        return make_mlp(meta["input_dim"], meta["num_classes"], hidden=cfg.hidden, depth=cfg.depth,
                        dropout=cfg.dropout)
    if cfg.name == "transformer":
        return make_transformer(meta["vocab_size"], meta["seq_len"], d_model=cfg.d_model,
                                heads=cfg.heads, depth=cfg.depth, dropout=cfg.dropout)
    return make_branchy(meta["image_shape"], meta["num_classes"], channels=cfg.channels,
                        depth=cfg.depth)
