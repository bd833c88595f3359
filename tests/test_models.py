"""Unit tests of the LayerList API and the built-in models.

    /tmp/v/bin/python -m pytest tests/test_models.py -q
"""

import pytest
import torch
from torch import nn

from engine.config import DataConfig, ModelConfig
from engine.training.data import load_dataset, tensor_dataset
from engine.models import Block, LayerList, build_model

SMALL = dict(hidden=16, depth=2, d_model=16, heads=2, channels=4)


def small(name: str, **kw) -> ModelConfig:
    return ModelConfig(name=name, **{**SMALL, **kw})


def text_meta() -> dict:
    return load_dataset(DataConfig(name="text", seq_len=8, text_chars=5000), seed=0).meta


# ---------------------------------------------------------------- LayerList validation

@pytest.mark.parametrize("items, message", [
    ([("a", nn.ReLU()), ("a", nn.ReLU())], "duplicate layer name 'a'"),
    ([Block("b", [("x", nn.ReLU())]), Block("b", [("x", nn.ReLU())])], "duplicate layer name 'b.x'"),
    ([("b.x", nn.ReLU())], "contains '.'"),
    ([("", nn.ReLU())], "non-empty"),
    ([("my layer", nn.ReLU())], "whitespace"),
    ([("a", "not a module")], "not a torch.nn.Module"),
    ([("a", nn.ReLU()), 42], "Block"),
    ([], "LayerList is empty"),
])
def test_layerlist_rejects_bad_items(items, message):
    with pytest.raises(ValueError, match=message):
        LayerList(items)


def test_block_rejects_bad_layers():
    with pytest.raises(ValueError, match="block 'b' is empty"):
        Block("b", [])
    with pytest.raises(ValueError, match="whitespace"):
        Block("b 1", [("x", nn.ReLU())])
    with pytest.raises(ValueError, match="'x' is a int"):
        Block("b", [("x", 3)])


def test_layerlist_names_index_and_iteration():
    relu = nn.ReLU()
    model = LayerList([("fc", nn.Linear(3, 4)), Block("b", [("x", relu), ("y", nn.Identity())]),
                       ("head", nn.Linear(4, 2))])
    assert model.names == ["fc", "b.x", "b.y", "head"]
    assert model.clusters == [["fc"], ["b.x", "b.y"], ["head"]]
    assert len(model) == 4 and model.index("head") == 3 and model.layer("b.x") is relu
    assert [n for n, _ in model] == model.names
    assert "layers.3.weight" in model.state_dict()
    with pytest.raises(KeyError, match="nope"):
        model.index("nope")
    assert model(torch.zeros(5, 3)).shape == (5, 2)


# ---------------------------------------------------------------- built-in models

def test_mlp_names_and_forward():
    ds = load_dataset(DataConfig(name="digits"), seed=0)
    model = build_model(small("mlp"), ds.meta, seed=0)
    assert model.names == ["fc0", "act0", "fc1", "act1", "head"]
    assert model.clusters == [[n] for n in model.names]
    assert model(ds.x_train[:7]).shape == (7, 10)
    with_drop = build_model(small("mlp", dropout=0.1), ds.meta, seed=0)
    assert with_drop.names == ["fc0", "act0", "drop0", "fc1", "act1", "drop1", "head"]


def test_transformer_names_clusters_and_forward():
    meta = text_meta()
    model = build_model(small("transformer", depth=3), meta, seed=0)
    assert model.names[0] == "embed" and model.names[-2:] == ["norm", "head"]
    blocks = [c for c in model.clusters if len(c) > 1]
    assert blocks == [[f"block{i}.attn", f"block{i}.mlp"] for i in range(3)]
    tokens = torch.randint(0, meta["vocab_size"], (2, 8))
    assert model(tokens).shape == (2, 8, meta["vocab_size"])
    assert model(tokens[:, :5]).shape == (2, 5, meta["vocab_size"])  # shorter than seq_len is fine


def test_transformer_is_causal():
    model = build_model(small("transformer"), text_meta(), seed=0).eval()
    tokens = torch.randint(0, 10, (1, 8))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % 10
    # changing the last token must not change any earlier position's logits
    torch.testing.assert_close(model(tokens)[:, :-1], model(changed)[:, :-1])


def test_transformer_heads_must_divide_d_model():
    with pytest.raises(ValueError, match=r"d_model \(10\).*heads \(4\)"):
        build_model(small("transformer", d_model=10, heads=4), text_meta(), seed=0)


def test_branchy_clusters_and_forward():
    ds = load_dataset(DataConfig(name="digits"), seed=0)
    model = build_model(small("branchy", depth=2), ds.meta, seed=0)
    assert model.clusters == [["stem"]] + [
        [f"block{i}.{n}" for n in ("split", "left", "right", "merge")] for i in range(2)
    ] + [["pool"], ["head"]]
    flat = ds.x_train[:3]
    assert model(flat).shape == (3, 10)
    torch.testing.assert_close(model(flat), model(flat.view(3, 1, 8, 8)))


@pytest.mark.parametrize("name", ["mlp", "transformer", "branchy"])
def test_same_seed_same_weights(name):
    meta = text_meta() if name == "transformer" else load_dataset(DataConfig(name="digits"), 0).meta
    a, b = (build_model(small(name), meta, seed=7).state_dict() for _ in range(2))
    c = build_model(small(name), meta, seed=8).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_model_data_mismatch_errors():
    digits = load_dataset(DataConfig(name="digits"), seed=0).meta
    with pytest.raises(ValueError, match="text"):
        build_model(small("transformer"), digits, seed=0)
    with pytest.raises(ValueError, match="input_dim"):
        build_model(small("mlp"), text_meta(), seed=0)
    with pytest.raises(ValueError, match="image_shape"):
        build_model(small("branchy"), {"input_dim": 10, "num_classes": 3}, seed=0)


def test_custom_layerlist_trains():
    torch.manual_seed(0)
    ds = load_dataset(DataConfig(name="synthetic", samples=256, features=8, classes=3), seed=0)
    model = LayerList([("fc", nn.Linear(8, 16)), ("act", nn.Tanh()),
                       Block("res", [("split", nn.Identity()), ("mix", nn.Linear(16, 16))]),
                       ("head", nn.Linear(16, 3))])
    custom = tensor_dataset(ds.x_train, ds.y_train)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        loss = nn.functional.cross_entropy(model(custom.x_train), custom.y_train)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
