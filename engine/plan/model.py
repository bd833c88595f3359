"""What `trainyard plan` knows of a config's model: built on the meta device (no weights), each layer's
parameters, the optimizer state an update of each would keep, and keep's saved activations per micro-batch size.

    cfg = planned_config("run.toml", ["data.seq_len=4096"])     # ConfigError names a bad key or value
    shape = ModelShape.of(cfg, params="bf16")                  # the working weights' dtype: "fp32" | "bf16"
    shape.activations("block3", 2)                             # bytes block3 saves for 2 samples

Activations come from engine/run/fit.py's saved_bytes (the ledger's byte rule, a forward on fake tensors) at one
and two samples, and grow linearly between and beyond them: every tensor a forward saves scales with the batch
but the shared inputs' constant part (rotary tables). The optimizer state is one step of the run's own optimizer on
meta tensors (engine/techniques/updates/layer.py's rule: AdamW's two fp32 moments and its step counter).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from engine.config import Config, ConfigError, PrecisionConfig
from engine.config.check import apply_overrides, check_config_table
from engine.config.load import read_toml
from engine.models.layers import params_by_layer
from engine.run.fit import saved_bytes
from engine.training.loss import cross_entropy
from engine.training.optim import make_optimizer

CPU = torch.device("cpu")   # the fake forward's device: autocast's op lists of the CPU (docs/plan.md)


def planned_config(path, overrides: list[str]) -> Config:
    """The config as `trainyard run` checks it, but that a token file is neither needed nor read: the plan
    is for a machine that has the data, this one may not."""
    table = apply_overrides(read_toml(path), overrides)
    tokens = isinstance(table.get("data"), dict) and table["data"].get("name") == "tokens"
    checked = copy.deepcopy(table)
    if tokens:   # checked as text data (every other rule the same); no file is looked at
        checked["data"]["name"] = "text"
    cfg = check_config_table(checked)
    if tokens:
        cfg.data.name = "tokens"
        if cfg.model.name != "hf" and not cfg.data.vocab_size:
            raise ConfigError("data.vocab_size = 0: the plan reads no token file, so it needs the vocabulary "
                              "given (data.vocab_size)")
    if cfg.model.name == "user":
        raise ConfigError('model.name = "user": names the model given to engine.train in Python; a config '
                          'file names a built-in model or "hf"')
    return cfg


def build_on_meta(cfg: Config):
    """The config's model on the meta device: shapes and dtypes, no memory; (model, x, y) with (x, y) two
    samples of the run's inputs."""
    d = cfg.data
    if d.name in ("text", "tokens"):
        x = torch.zeros(2, d.seq_len, dtype=torch.int64)
        y = torch.zeros(2, d.seq_len, dtype=torch.int64)
        meta = {"vocab_size": d.vocab_size, "seq_len": d.seq_len}
        if d.name == "text" and cfg.model.name != "hf":
            from engine.training.data import load_dataset   # the characters of the standard library: no file
            meta = load_dataset(d, cfg.run.seed).meta
    else:   # digits, synthetic: made in memory, small
        from engine.training.data import load_dataset
        ds = load_dataset(d, cfg.run.seed)
        meta, x, y = ds.meta, ds.x_train[:2].clone(), ds.y_train[:2].clone()   # its own storage, as a batch has
    if cfg.model.name == "hf":
        from engine.models.hf import from_files
        with torch.device("meta"):   # from the config.json alone, never the weights
            model = from_files(cfg.model.hf_config or cfg.model.hf_weights)
    else:
        from engine.models import build_model
        with torch.device("meta"):
            model = build_model(cfg.model, meta, cfg.run.seed)
    return model, x, y


@dataclass
class ModelShape:
    """One layer list's figures under one working dtype, by layer name; parameters by index (each counted at
    its first layer, as engine.models.layers.params_by_layer does)."""

    names: list[str]
    clusters: list[list[str]]
    layer_params: dict[str, list[int]]   # a layer's parameters (indices), a tied one in each layer holding it
    numel: list[int]
    width: list[int]                     # bytes an element of a working weight (and its gradient) takes
    state: list[int]                     # optimizer state bytes of an fp32 copy, once stepped
    saved: dict[str, tuple[int, int]]    # keep's saved bytes at 1 and 2 samples
    output: dict[str, tuple[int, int]]   # a layer's output bytes at 1 and 2 samples
    input: tuple[int, int]               # the first layer's input
    loss: tuple[int, int]
    inputs: tuple[int, int]              # the blocks' shared inputs (masks, rotary tables)
    params: str                          # "fp32" | "bf16"

    @staticmethod
    def of(cfg: Config, params: str, built=None) -> "ModelShape":
        """`built`: (model, x, y) from build_on_meta, reused across dtypes."""
        model, x, y = built or build_on_meta(cfg)
        precision = dataclasses.replace(cfg.precision, params=params,
                                        compute="bf16" if params == "bf16" else cfg.precision.compute)
        model = copy.deepcopy(model).to(torch.bfloat16 if params == "bf16" else torch.float32)   # meta: no memory
        order = [p for ps in params_by_layer(model).values() for p in ps]
        index = {id(p): i for i, p in enumerate(order)}
        layer_params = {n: [index[id(p)] for p in layer.parameters()] for n, layer in zip(model.names, model.layers)}
        figures = [_forward(model, x[:b], y[:b], precision) for b in (1, 2)]
        return ModelShape(
            names=list(model.names), clusters=[list(c) for c in model.clusters], layer_params=layer_params,
            numel=[p.numel() for p in order], width=[p.element_size() for p in order],
            state=_state_bytes(cfg, order), params=params,
            saved={n: _pair(f[0].get(n, 0) for f in figures) for n in model.names},
            output={n: _pair(f[3].get(n, 0) for f in figures) for n in model.names},
            input=_pair(v[:b].numel() * v.element_size() for b, v in ((1, x), (2, x))),
            loss=_pair(f[1] for f in figures), inputs=_pair(f[2] for f in figures))

    def activations(self, layer: str, samples: int) -> int:
        return _at(self.saved[layer], samples)

    def layer_input(self, position: int, samples: int) -> int:
        """What recompute keeps of the layer at `position`: its input, the output of the one before."""
        return _at(self.input, samples) if position == 0 else _at(self.output[self.names[position - 1]], samples)

    def loss_bytes(self, samples: int) -> int:
        return _at(self.loss, samples)

    def input_bytes(self, samples: int) -> int:
        return _at(self.inputs, samples)

    @property
    def parameter_count(self) -> int:
        return sum(self.numel)


def _forward(model, x, y, precision: PrecisionConfig) -> tuple[dict[str, int], int, int, dict[str, int]]:
    outputs: dict[str, int] = {}
    by_layer, loss, inputs = saved_bytes(model, x, y, cross_entropy, precision, CPU, outputs)
    return by_layer, loss, inputs, outputs


def _pair(values) -> tuple[int, int]:
    one, two = values
    return int(one), int(two)


def _at(pair: tuple[int, int], samples: int) -> int:
    """Linear in the samples through the figures at one and two."""
    one, two = pair
    return max(0, one + (two - one) * (samples - 1))


def _state_bytes(cfg: Config, order: list[torch.Tensor]) -> list[int]:
    """Each parameter's optimizer state once stepped, on an fp32 copy (the master, or the fp32 weight)."""
    meta = [torch.nn.Parameter(torch.empty(p.shape, device="meta", dtype=torch.float32)) for p in order]
    for m in meta:
        m.grad = torch.empty_like(m)
    optimizer = make_optimizer(cfg.optim, meta, kernel="foreach")
    with torch.no_grad():
        optimizer.step()
    return [sum(v.numel() * v.element_size() for v in optimizer.state[m].values() if torch.is_tensor(v))
            for m in meta]
