"""[emulate]: a layer that turns slow mid-run (engine/runtime/emulate.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from engine.config import EmulateConfig
from engine.runtime.emulate import SlowLayer
from engine.models import LayerList


def _model() -> LayerList:
    return LayerList([("fc0", nn.Linear(4, 4)), ("act0", nn.ReLU()), ("head", nn.Linear(4, 2))])


def test_the_layer_sleeps_from_its_step_on_and_the_others_never(monkeypatch):
    slept = []
    monkeypatch.setattr("engine.runtime.emulate.time.sleep", slept.append)
    model = _model()
    slow = SlowLayer.install(model, EmulateConfig(slow_layer="act0", slow_layer_ms=50.0, slow_from_step=3))
    x = torch.randn(2, 4)
    slow.step = 2
    model(x)
    assert slept == []
    slow.step = 3
    model(x)
    assert slept == [0.05]
    model.layers[0](x), model.layers[2](x)   # the other layers: no sleep
    assert slept == [0.05]


def test_no_layer_named_installs_nothing_and_an_unknown_one_is_refused_by_name():
    model = _model()
    assert SlowLayer.install(model, EmulateConfig()) is None
    with pytest.raises(ValueError, match=r"emulate.slow_layer = 'fc9' is not a layer of this model; its layers are: "
                                         r"fc0, act0, head"):
        SlowLayer.install(model, EmulateConfig(slow_layer="fc9", slow_layer_ms=1.0))
