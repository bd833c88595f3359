"""Models the project did not define, as a user brings them, and token data.

    model = encoder_model(seed=0)      # torch's own nn.TransformerEncoderLayer blocks, wrapped by hand
    model = gpt2_model(seed=0)         # transformers' GPT2LMHeadModel as it is: tied embeddings
    model = llama_model(seed=0)        # transformers' LlamaForCausalLM as it is: rotary embeddings, GQA
    model = mistral_model(seed=0)      # ... a sliding window shorter than the sequence; gemma2, mixtral, qwen2-moe too
    as_layers(model)                   # the LayerList engine.train makes of either (engine.layers)
    data = token_data(seed=1)          # next-token pairs over VOCAB, SEQ_LEN long

Their classes live at module level, in a module the workers import (tests/ is on their path), as a
user's must (engine.train saves the model with torch.save).
"""

from __future__ import annotations

import torch
from torch import nn

import engine
from engine.models import LayerList

VOCAB, SEQ_LEN, D_MODEL, BLOCKS = 48, 16, 32, 4


class TokenAndPosition(nn.Module):
    """Token embedding plus a learned position embedding, as GPT-2's wte + wpe."""

    def __init__(self, vocab: int, seq_len: int, d_model: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq_len, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


def encoder_model(seed: int = 0) -> LayerList:
    torch.manual_seed(seed)
    layers = [("embed", TokenAndPosition(VOCAB, SEQ_LEN, D_MODEL))]
    # bias=False: an attention key bias has a gradient that is zero but for rounding (softmax ignores a
    # shift shared by every key), and AdamW scales that noise up to full-size steps that no two summation
    # orders agree on, in plain torch DDP as here. GPT-2's (below) keeps its biases: its noise is ~1e-13.
    layers += [(f"block{i}", nn.TransformerEncoderLayer(D_MODEL, 4, 2 * D_MODEL, dropout=0.0, batch_first=True,
                                                        bias=False)) for i in range(BLOCKS)]
    layers += [("norm", nn.LayerNorm(D_MODEL)), ("head", nn.Linear(D_MODEL, VOCAB))]
    return LayerList(layers)


def gpt2_model(seed: int = 0):
    """A tiny GPT2LMHeadModel: wte, wpe, blocks, ln_f, and lm_head tied to wte (GPT-2's default)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, n_positions=SEQ_LEN, n_embd=D_MODEL,
                        n_layer=BLOCKS, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def llama_model(seed: int = 0):
    """A tiny LlamaForCausalLM: rotary embeddings, grouped-query attention (2 key-value heads for 4), untied."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, hidden_size=D_MODEL,
                         intermediate_size=2 * D_MODEL, num_hidden_layers=BLOCKS, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _family(name: str, seed: int, **extra):
    """A family of tests/hf_families.py at this module's sizes (VOCAB, SEQ_LEN positions, D_MODEL, BLOCKS)."""
    from transformers import AutoModelForCausalLM
    from tests.hf_families import FAMILIES
    config = FAMILIES[name].config()
    for key, value in {"vocab_size": VOCAB, "max_position_embeddings": SEQ_LEN, "hidden_size": D_MODEL,
                       "num_hidden_layers": BLOCKS, **extra}.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def mistral_model(seed: int = 0):
    """A tiny MistralForCausalLM with a sliding window of 5 tokens: past it (SEQ_LEN is 16), each block's
    attention sees only the 5 tokens before, by the mask of its layer type."""
    return _family("mistral", seed)


def gemma2_model(seed: int = 0):
    """A tiny Gemma2ForCausalLM: sliding and full layers alternating, logit soft caps, tied embeddings."""
    return _family("gemma2", seed)


# many small experts, so that a rank's share of a batch (256 tokens) leaves some of them without a token


def mixtral_model(seed: int = 0):
    """A tiny MixtralForCausalLM: 256 experts, two per token (Mixtral renormalises the chosen experts' weights:
    with one per token its router would learn nothing), a sliding window."""
    return _family("mixtral", seed, num_local_experts=256, num_experts_per_tok=2)


def qwen2_moe_model(seed: int = 0):
    """A tiny Qwen2MoeForCausalLM: 64 experts, one per token, and a shared expert."""
    return _family("qwen2-moe", seed, num_experts=64, num_experts_per_tok=1)


# a first token id that every global batch of token_data's first three steps holds, and that each rank's share
# lacks in one of them (a batch without it at all: torch's optimizer skips a parameter whose gradient is None,
# where every strategy here, torch's DDP too, steps it on a zero gradient)
RARE = 13


class RoutedEmbedding(nn.Module):
    """A mixture of experts as users write one, a module per expert: a sample's first token goes to the `rare`
    embedding when its id is RARE, every other token to `common`. Per sample, so data parallel computes one
    worker's function; a rank whose share has no such sample runs no `rare`, which gets no gradient there."""

    def __init__(self, vocab: int, d_model: int):
        super().__init__()
        self.common, self.rare = nn.Embedding(vocab, d_model), nn.Embedding(vocab, d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.common(ids)
        chosen = ids[:, :1] == RARE
        if not chosen.any():
            return out
        first = torch.where(chosen.unsqueeze(-1), self.rare(ids[:, :1]), out[:, :1])
        return torch.cat([first, out[:, 1:]], dim=1)


def routed_model(seed: int = 0) -> LayerList:
    torch.manual_seed(seed)
    return LayerList([("route", RoutedEmbedding(VOCAB, D_MODEL)), ("norm", nn.LayerNorm(D_MODEL)),
                      ("head", nn.Linear(D_MODEL, VOCAB))])


def as_layers(model) -> LayerList:
    return engine.layers(model, check=False)


MODELS = {"encoder": encoder_model, "gpt2": gpt2_model, "llama": llama_model, "mistral": mistral_model,
          "gemma2": gemma2_model, "mixtral": mixtral_model, "qwen2-moe": qwen2_moe_model, "routed": routed_model}


def masked_token_data(seed: int = 1):
    """token_data with a third of the targets -100 (not counted), placed at random: the ranks' shares of a
    batch count different numbers of targets."""
    ds = token_data(seed)
    g = torch.Generator().manual_seed(seed + 100)
    y_train, y_test = ds.y_train.clone(), ds.y_test.clone()
    y_train[torch.rand(y_train.shape, generator=g) < 0.33] = -100
    y_test[torch.rand(y_test.shape, generator=g) < 0.33] = -100
    return engine.tensor_dataset(ds.x_train, y_train, ds.x_test, y_test, name="masked-tokens")


def token_data(seed: int = 1, samples: int = 512):
    """Sequences from a fixed random bigram table, so that there is something to learn."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, VOCAB, (VOCAB,), generator=g)
    start = torch.randint(0, VOCAB, (samples, 1), generator=g)
    noise = torch.rand(samples, SEQ_LEN, generator=g) < 0.2
    ids = [start[:, 0]]
    for t in range(SEQ_LEN):
        ids.append(torch.where(noise[:, t], torch.randint(0, VOCAB, (samples,), generator=g), table[ids[-1]]))
    ids = torch.stack(ids, dim=1)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return engine.tensor_dataset(x[:448], y[:448], x[448:], y[448:], name="tokens")
