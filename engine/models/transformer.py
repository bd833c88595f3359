"""Built-in small character-level GPT, one Block of two layers per transformer block.

    model = make_transformer(vocab_size=90, seq_len=32, d_model=64, heads=4, depth=2)
    model.names  # ["embed", "block0.attn", "block0.mlp", "block1.attn", "block1.mlp", "norm", "head"]
    logits = model(tokens)  # tokens: (B, T) int64 with T <= seq_len -> (B, T, vocab_size)

Each residual sub-layer carries its own residual add, so every layer maps one
(B, T, d_model) tensor to another and a pipeline could cut between any two; they
are still grouped per transformer block so a partitioner keeps a block whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import Block, LayerList


class Embed(nn.Module):
    """Token plus learned position embedding: (B, T) int64 -> (B, T, d_model)."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, dropout: float):
        super().__init__()
        self.seq_len = seq_len
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len {self.seq_len}")
        positions = torch.arange(t, device=tokens.device)
        return self.drop(self.token(tokens) + self.position(positions))


class CausalSelfAttention(nn.Module):
    """x + attn(LayerNorm(x)), each position attending only to itself and earlier ones."""

    def __init__(self, d_model: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=2)
        # (B, T, D) -> (B, heads, T, D/heads), the layout scaled_dot_product_attention expects
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(b, t, d)
        return x + self.drop(self.proj(y))


class FeedForward(nn.Module):
    """x + MLP(LayerNorm(x)) with a 4x wide GELU hidden layer."""

    def __init__(self, d_model: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def make_transformer(vocab_size: int, seq_len: int, *, d_model: int, heads: int, depth: int,
                     dropout: float = 0.0) -> LayerList:
    if d_model % heads != 0:
        raise ValueError(f"transformer d_model ({d_model}) must be divisible by heads ({heads})")
    items: list = [("embed", Embed(vocab_size, seq_len, d_model, dropout))]
    for i in range(depth):
        items.append(Block(f"block{i}", [("attn", CausalSelfAttention(d_model, heads, dropout)),
                                         ("mlp", FeedForward(d_model, dropout))]))
    items += [("norm", nn.LayerNorm(d_model)), ("head", nn.Linear(d_model, vocab_size))]
    return LayerList(items)
