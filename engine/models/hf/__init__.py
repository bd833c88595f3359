"""A Hugging Face decoder-only causal LM as a LayerList that computes the model's own function.

    from transformers import AutoConfig, AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("mistral", sliding_window=4096, ...))
    model = engine.layers(hf)               # embed, block0 .. blockN-1, norm, head; checked against hf's forward
    engine.train(cfg, model=hf)             # the same, done for you; `hf` holds the final weights after
    check_files("llama/config.json", "", seq_len=2048)   # `[model] name = "hf"`: the launcher's check

Each part runs the model's own code (engine/models/hf/parts.py): `embed` is the model's forward up to its first
block, each block is the model's own module handed what the model's forward hands it (its layer type's mask and
rotary table, ALiBi, positions: computed once per input shape and shared), `norm` the modules its forward
applies after the blocks, `head` the causal LM's forward after its base model (lm_head, logit caps and
scales). No family is named here: the parts are found from the modules and one traced forward
(engine/models/hf/anatomy.py), and what is not reproduced is refused by name before any worker starts.

The layers are the model's own modules, not copies: training the LayerList trains the model, and a tied input
and output embedding stays one parameter that `embed` and `head` both hold (LayerList.ties).

Before it returns, `layers` compares the LayerList with the model's own forward at the run's sequence length
and past every window, with logits large enough that a cap shows (engine/models/hf/check.py), and refuses a
sequence longer than the model's table of positions. Imports torch, and transformers when a model is built.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from engine.models.hf.anatomy import Anatomy, HFError, read_anatomy, text_config
from engine.models.hf.check import CheckReport, check_function
from engine.models.hf.inputs import BlockInputs
from engine.models.hf.parts import DecoderBlock, Embed, Head, after_blocks
from engine.models.layers import LayerList

__all__ = ["HFError", "CheckReport", "layers", "build_layers", "check_function", "check_files", "from_files"]


def build_layers(anatomy: Anatomy) -> LayerList:
    """The LayerList of the model `anatomy` describes, unchecked."""
    inputs = BlockInputs(anatomy)
    items = [("embed", Embed(anatomy))]
    items += [(f"block{i}", DecoderBlock(block, i, inputs, anatomy.as_tuple)) for i, block in enumerate(anatomy.blocks)]
    norm = after_blocks(anatomy)
    if norm is not None:
        items.append(("norm", norm))
    items.append(("head", Head(anatomy)))
    return LayerList(items)


def layers(model: nn.Module, check: bool = True, seq_len: int | None = None) -> LayerList:
    """`model`'s modules as a LayerList: embed, block0 .. blockN-1, norm, head (see the module's doc). With
    `check`, compared with the model's own forward at `seq_len` (and past its windows) first: HFError (a
    ValueError) names what differs, or that `seq_len` is past the model's positions."""
    if isinstance(model, LayerList):
        return model
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be an engine.LayerList or a Hugging Face causal LM, got "
                        f"{type(model).__name__}; wrap your model's layers in an engine.LayerList (docs/models.md)")
    anatomy = read_anatomy(model)
    out = build_layers(anatomy)
    if check:
        check_function(model, seq_len, anatomy)
    return out


def from_files(config_path: str, weights: str = "", vocab_size: int | None = None, check: bool = False) -> LayerList:
    """`[model] name = "hf"`: the causal LM a config.json describes (random weights, seeded by the caller), or
    the one a local save_pretrained folder holds; nothing is downloaded. A data vocabulary larger than the
    model's is refused: its ids would index past the embedding. The launcher checks the model before any
    worker starts (check_files); the workers build it unchecked."""
    AutoModelForCausalLM = _auto_model()
    if weights:
        model = AutoModelForCausalLM.from_pretrained(weights, config=_config(config_path) if config_path else None,
                                                     local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_config(_config(config_path))
    vocab = text_config(model.config).vocab_size
    if vocab_size and vocab_size > vocab:
        raise ValueError(f"the data's token ids go up to {vocab_size - 1}, past the model's vocab_size "
                         f"{vocab} ({config_path or weights})")
    return layers(model, check=check)


def check_files(config_path: str, weights: str = "", seq_len: int | None = None) -> CheckReport:
    """The launcher's check of a `[model] name = "hf"` model, before any worker starts: built on the meta
    device from its config (no memory, no weights read), refused by name where it is not reproduced, and
    compared with its own forward on a reduced copy (check_function)."""
    AutoModelForCausalLM = _auto_model()
    config = _config(config_path or weights)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:   # not a causal LM transformers knows
        raise HFError(f"{config_path or weights}: {e}") from None
    return check_function(model, seq_len)


def _auto_model():
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError('model.name = "hf" needs transformers: pip install -e ".[hf]"') from None
    return AutoModelForCausalLM


def _config(path: str):
    from transformers import AutoConfig
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path, local_files_only=True)
    with open(path) as f:
        table = json.load(f)
    if "model_type" not in table:
        raise ValueError(f"model.hf_config = {path!r}: its JSON has no model_type (what transformers builds)")
    return AutoConfig.for_model(**table)
