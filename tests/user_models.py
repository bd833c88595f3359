"""Models the project did not define, wrapped by hand into a LayerList as a user would, and token data.

    model = encoder_model(seed=0)      # torch's own nn.TransformerEncoderLayer blocks
    model = gpt2_model(seed=0)         # GPT-2 blocks from transformers (ImportError without it)
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


class HFBlock(nn.Module):
    """A transformers decoder block as one layer: a tensor in, the hidden states out."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


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


def gpt2_model(seed: int = 0) -> LayerList:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    config = GPT2Config(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, n_positions=SEQ_LEN, n_embd=D_MODEL, n_layer=BLOCKS, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(seed)
    layers = [("embed", TokenAndPosition(VOCAB, SEQ_LEN, D_MODEL))]
    layers += [(f"block{i}", HFBlock(GPT2Block(config, layer_idx=i))) for i in range(BLOCKS)]
    layers += [("norm", nn.LayerNorm(D_MODEL)), ("head", nn.Linear(D_MODEL, VOCAB))]
    return LayerList(layers)


MODELS = {"encoder": encoder_model, "gpt2": gpt2_model}


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
