"""A Hugging Face decoder-only causal LM as a LayerList, taken as it is.

    from transformers import LlamaConfig, LlamaForCausalLM
    hf = LlamaForCausalLM(LlamaConfig(...))
    model = engine.layers(hf)          # embed, block0 .. blockN-1, norm, head
    engine.train(cfg, model=hf)        # the same, done for you; `hf` holds the final weights after

Two layouts are recognised, by the modules the model has:
- GPT-2: `transformer.wte`, `transformer.wpe`, `transformer.h`, `transformer.ln_f`, `lm_head`;
- Llama: `model.embed_tokens`, `model.layers`, `model.norm`, `model.rotary_emb`, `lm_head` (Llama, Mistral,
  Qwen2 and the others built the same way).

Each decoder block is one layer. A block computes what the model's own forward would hand it: the positions
(0 .. T-1), the rotary embeddings (Llama: each block holds its own copy of the parameter-free rotary module),
and the causal mask, made by transformers' `create_causal_mask` exactly as the model makes it, for unpadded
input. The layers are the model's own modules, not copies: training the LayerList trains the model, and a
tied input and output embedding (GPT-2's default, `tie_word_embeddings=True` elsewhere) stays one parameter
that `embed` and `head` both hold (LayerList.ties).

Before it returns, `layers` runs the model and the LayerList on the same few tokens and compares the logits:
a model whose forward does something the two layouts do not (an embedding scale, a soft cap, a different
mask) is refused by name rather than trained wrong.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from engine.models.layers import LayerList

GPT2_MODULES = ("transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head")
LLAMA_MODULES = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
CHECK_TOKENS = 8   # the forward compared against the model's own when the LayerList is made


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def _causal_mask(config, hidden: torch.Tensor):
    """The model's causal mask for unpadded input (positions 0 .. T-1: no packed sequences to find, which
    also lets the planners' shape-only forward on the meta device through)."""
    from transformers.masking_utils import create_causal_mask
    # the cache positionally: transformers 5.24 renamed it (past_key_values -> cache)
    return create_causal_mask(config, hidden, None, None, position_ids=None)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out


class GPT2Embed(nn.Module):
    """Token plus learned position embeddings, then dropout: GPT2Model's forward before its blocks."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(ids) + self.wpe(_positions(ids)))


class GPT2Layer(nn.Module):
    """One GPT2Block: a tensor in, the hidden states out, with the causal mask its model would give it."""

    def __init__(self, block: nn.Module, config):
        super().__init__()
        self.block, self.config = block, config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = _positions(hidden)
        mask = _causal_mask(self.config, hidden)
        return _hidden(self.block(hidden, None, mask, use_cache=False, position_ids=positions))   # (hidden, cache, mask)


class LlamaLayer(nn.Module):
    """One decoder layer of the Llama family, with the mask, positions and rotary embeddings its model's
    forward computes once and hands every layer (the rotary module has no parameters: each layer holds a
    copy, so a layer needs nothing from another stage)."""

    def __init__(self, block: nn.Module, rotary: nn.Module, config):
        super().__init__()
        self.block, self.rotary, self.config = block, rotary, config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = _positions(hidden)
        mask = _causal_mask(self.config, hidden)
        rotary = self.rotary(hidden, position_ids=positions)
        return _hidden(self.block(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions,
                                  use_cache=False))


def _layout(model: nn.Module) -> str:
    if all(_has(model, p) for p in GPT2_MODULES):
        return "gpt2"
    if all(_has(model, p) for p in LLAMA_MODULES):
        return "llama"
    raise ValueError(
        f"{type(model).__name__} is not a decoder-only causal LM of a layout trainyard knows: looked for "
        f"GPT-2's modules ({', '.join(GPT2_MODULES)}) and the Llama family's ({', '.join(LLAMA_MODULES)}). "
        f"Wrap your model's layers in an engine.LayerList yourself (docs/models.md)")


def layers(model: nn.Module, check: bool = True) -> LayerList:
    """`model`'s modules as a LayerList: embed, block0 .. blockN-1, norm, head (see the module's doc)."""
    if isinstance(model, LayerList):
        return model
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model must be an engine.LayerList or a Hugging Face causal LM (GPT-2 or Llama layout), "
                        f"got {type(model).__name__}; wrap your model's layers in an engine.LayerList (docs/models.md)")
    layout = _layout(model)
    config = model.config
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"{type(model).__name__} has cross-attention; trainyard takes decoder-only models")
    if layout == "gpt2":
        t = model.transformer
        items = [("embed", GPT2Embed(t.wte, t.wpe, t.drop))]
        items += [(f"block{i}", GPT2Layer(block, config)) for i, block in enumerate(t.h)]
        items += [("norm", t.ln_f), ("head", model.lm_head)]
    else:
        m = model.model
        items = [("embed", m.embed_tokens)]
        items += [(f"block{i}", LlamaLayer(block, copy.deepcopy(m.rotary_emb), config))
                  for i, block in enumerate(m.layers[:config.num_hidden_layers])]
        items += [("norm", m.norm), ("head", model.lm_head)]
    out = LayerList(items)
    if check:
        _check_same_logits(model, out)
    return out


@torch.no_grad()
def _check_same_logits(model: nn.Module, out: LayerList) -> None:
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type == "meta":   # built for its sizes only (the launcher's capacity check): nothing to run
        return
    vocab = model.config.vocab_size
    tokens = min(CHECK_TOKENS, getattr(model.config, "max_position_embeddings", None)
                 or getattr(model.config, "n_positions", CHECK_TOKENS))
    ids = torch.arange(tokens, device=device).remainder(vocab).unsqueeze(0)
    was_training = model.training
    model.eval()   # dropout off in both
    try:
        want = model(input_ids=ids, use_cache=False).logits
        got = out(ids)
    finally:
        model.train(was_training)
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-4):
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else float("nan")
        raise ValueError(
            f"{type(model).__name__} has the modules of the {'GPT-2' if isinstance(out.layers[1], GPT2Layer) else 'Llama'} "
            f"layout, but its forward computes something else (logits differ by up to {diff:.3g} on {tokens} "
            f"tokens): an embedding scale, a logit cap or a mask of its own. Wrap its layers in an "
            f"engine.LayerList yourself (docs/models.md)")


def from_files(config_path: str, weights: str = "", vocab_size: int | None = None) -> LayerList:
    """`[model] name = "hf"`: the causal LM a config.json describes (random weights, seeded by the caller), or
    the one a local save_pretrained folder holds; nothing is downloaded. A data vocabulary larger than the
    model's is refused: its ids would index past the embedding."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError('model.name = "hf" needs transformers: pip install -e ".[hf]"') from None
    if weights:
        model = AutoModelForCausalLM.from_pretrained(weights, config=_config(config_path) if config_path else None,
                                                     local_files_only=True)
    else:
        model = AutoModelForCausalLM.from_config(_config(config_path))
    if vocab_size and vocab_size > model.config.vocab_size:
        raise ValueError(f"the data's token ids go up to {vocab_size - 1}, past the model's vocab_size "
                         f"{model.config.vocab_size} ({config_path or weights})")
    return layers(model)


def _config(path: str):
    import json
    import os

    from transformers import AutoConfig
    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path, local_files_only=True)
    with open(path) as f:
        table = json.load(f)
    if "model_type" not in table:
        raise ValueError(f"model.hf_config = {path!r}: its JSON has no model_type (what transformers builds)")
    return AutoConfig.for_model(**table)
