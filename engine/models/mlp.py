"""Built-in multi-layer perceptron for flat float features (e.g. 8x8 digits as 64 floats).

    model = make_mlp(input_dim=64, num_classes=10, hidden=128, depth=2, dropout=0.1)
    model.names  # ["fc0", "act0", "drop0", "fc1", "act1", "drop1", "head"]
    logits = model(x)  # x: (B, input_dim) float -> (B, num_classes)

Every layer is loose (its own cluster), so a pipeline may cut anywhere.
"""

from __future__ import annotations

from torch import nn

from engine.models.layers import LayerList


def make_mlp(input_dim: int, num_classes: int, *, hidden: int, depth: int,
             dropout: float = 0.0) -> LayerList:
    items: list[tuple[str, nn.Module]] = []
    width_in = input_dim
    for i in range(depth):
        items += [(f"fc{i}", nn.Linear(width_in, hidden)), (f"act{i}", nn.ReLU())]
        if dropout > 0:
            items.append((f"drop{i}", nn.Dropout(dropout)))
        width_in = hidden
    items.append(("head", nn.Linear(width_in, num_classes)))
    return LayerList(items)
