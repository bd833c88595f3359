"""Built-in small CNN of branch-and-merge blocks; it exists to exercise Blocks (clusters).

    model = make_branchy(image_shape=(1, 8, 8), num_classes=10, channels=16, depth=2)
    model.clusters  # [["stem"], ["block0.split", "block0.left", "block0.right", "block0.merge"], ...]
    logits = model(x)  # x: (B, C*H*W) or (B, C, H, W) float -> (B, num_classes)

Inside a block the layers pass a tuple (left, right) between them, so the block can
only be run whole: a pipeline stage boundary must fall between clusters.
It has no dropout layers, so model.dropout does not affect it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.layers import Block, LayerList


class Stem(nn.Module):
    """Reshape flat input to (B, C, H, W), then conv 3x3 + ReLU to `channels`."""

    def __init__(self, image_shape: tuple[int, int, int], channels: int):
        super().__init__()
        self.image_shape = tuple(image_shape)
        self.conv = nn.Conv2d(self.image_shape[0], channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x.reshape(x.shape[0], *self.image_shape)))


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


class Left(nn.Module):
    """Conv 3x3 + ReLU on element 0 of the pair; element 1 passes through."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = pair
        return torch.relu(self.conv(a)), b


class Right(nn.Module):
    """Conv 1x1 + ReLU on element 1 of the pair; element 0 passes through."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = pair
        return a, torch.relu(self.conv(b))


class Merge(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return a + b


def make_branchy(image_shape: tuple[int, int, int], num_classes: int, *, channels: int,
                 depth: int) -> LayerList:
    items: list = [("stem", Stem(image_shape, channels))]
    for i in range(depth):
        items.append(Block(f"block{i}", [("split", Split()), ("left", Left(channels)),
                                         ("right", Right(channels)), ("merge", Merge())]))
    items += [("pool", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())),
              ("head", nn.Linear(channels, num_classes))]
    return LayerList(items)
