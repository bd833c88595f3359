"""The model API: a model is an ordered list of named layers, some grouped into blocks.

    from engine.models import LayerList, Block
    model = LayerList([
        ("fc0", nn.Linear(64, 32)), ("act0", nn.ReLU()),
        Block("res", [("split", Split()), ("left", Left()), ("merge", Merge())]),
        ("head", nn.Linear(32, 10)),
    ])
    model.names     # ["fc0", "act0", "res.split", "res.left", "res.merge", "head"]
    model.clusters  # [["fc0"], ["act0"], ["res.split", "res.left", "res.merge"], ["head"]]
    logits = model(x)

Parallel techniques (pipeline stages, sharding, offload) are applied *to* a LayerList
from outside, so they only ever need `names`, `layers` and `clusters`.

The contract between layers:
- a loose layer takes one tensor and returns one tensor;
- inside a Block, values passed between layers may be tuples of tensors, but the
  block's first layer takes a single tensor and its last layer returns one.
So a pipeline may cut between any two clusters and always ship a single tensor.
This is documented rather than checked at run time (checking costs every forward).

Names: a layer or block name is non-empty, without whitespace or "."; a layer
"split" inside block "b1" is called "b1.split". The dot is reserved for that join, so
every full name says unambiguously which block it belongs to.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from torch import nn


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name must be a non-empty string, got {name!r}")
    if any(ch.isspace() for ch in name):
        raise ValueError(f"{what} name {name!r} contains whitespace")
    if "." in name:
        raise ValueError(f"{what} name {name!r} contains '.', which is reserved for "
                         f"'block.layer' full names")
    return name


def _check_layer(item: object, where: str) -> tuple[str, nn.Module]:
    if not (isinstance(item, tuple) and len(item) == 2):
        raise ValueError(f"{where}: expected a (name, nn.Module) pair or a Block, got {item!r}")
    name, module = item
    _check_name(name, "layer")
    if not isinstance(module, nn.Module):
        raise ValueError(f"{where}: layer {name!r} is a {type(module).__name__}, not a torch.nn.Module")
    return name, module


class Block:
    """Consecutive layers that form one unit (e.g. a branch-and-merge block); never split across stages."""

    def __init__(self, name: str, layers: list[tuple[str, nn.Module]]):
        self.name = _check_name(name, "block")
        self.layers = [_check_layer(item, f"block {name!r}") for item in layers]
        if not self.layers:
            raise ValueError(f"block {name!r} is empty; a Block needs at least one layer")

    def __repr__(self) -> str:
        return f"Block({self.name!r}, {[n for n, _ in self.layers]})"


def tied_parameters(model: "LayerList") -> list[list[tuple[str, str]]]:
    """The parameters that several layers hold (tied weights, e.g. an input embedding that is also the output
    head's): one list per shared parameter of its (layer, parameter) names, in forward order. Declared once
    here, from the modules as built (one Parameter object, two places); every strategy reads this list, which
    survives a copy of a layer to another process where the object identity does not."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for layer_name, layer in zip(model.names, model.layers):
        for param_name, p in layer.named_parameters(remove_duplicate=False):
            names = holders.setdefault(id(p), [])
            if (layer_name, param_name) not in names:
                names.append((layer_name, param_name))
    return [names for names in holders.values() if len({layer for layer, _ in names}) > 1]


def params_by_layer(model: "LayerList", only=None) -> dict[int, list]:
    """Each layer's parameters (a parameter shared by layers belongs to the first), optionally only
    those in `only` (a set of ids: the parameters this rank updates)."""
    seen, out = set(), {}
    for index, layer in enumerate(model.layers):
        mine = []
        for p in layer.parameters():
            if id(p) not in seen and (only is None or id(p) in only):
                seen.add(id(p))
                mine.append(p)
        out[index] = mine
    return out


class SharedInputs(nn.Module):
    """Tensors several layers take besides the hidden state, computed from the input's shape alone and shared
    by every layer that takes them (a Hugging Face decoder's attention masks and rotary tables:
    engine/models/hf/parts.py BlockInputs). Not parameters: it has no parameters or buffers, so nothing of it
    is in state_dict, a checkpoint or an export. The layers that take it hold it as a submodule, so
    `module.modules()` finds it once however many layers share it, and the ledger counts `nbytes()`
    (shared_inputs, shared_input_bytes)."""

    def tensors(self) -> list:
        """The tensors held now."""
        return []

    def nbytes(self) -> int:
        """Their bytes, each storage once."""
        storages = {(t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in self.tensors()}
        return sum(storages.values())


def shared_inputs(modules) -> list[SharedInputs]:
    """The SharedInputs under `modules`, each once (found by walking them: keep the list while they stay)."""
    return list({id(m): m for module in modules for m in module.modules() if isinstance(m, SharedInputs)}.values())


def shared_input_bytes(found: list[SharedInputs]) -> int:
    """Bytes the SharedInputs `found` hold now."""
    return sum(m.nbytes() for m in found)


def shared_input_ptrs(found: list[SharedInputs]) -> set[int]:
    """The storages of the tensors the SharedInputs `found` hold now."""
    return {t.untyped_storage().data_ptr() for m in found for t in m.tensors()}


class LayerList(nn.Module):
    """Named layers applied in order; `clusters` says which of them must stay together."""

    def __init__(self, items: Iterable[tuple[str, nn.Module] | Block]):
        super().__init__()
        names: list[str] = []
        modules: list[nn.Module] = []
        clusters: list[list[str]] = []
        for item in items:
            if isinstance(item, Block):
                full = [f"{item.name}.{n}" for n, _ in item.layers]
                names += full
                modules += [m for _, m in item.layers]
                clusters.append(full)
            else:
                name, module = _check_layer(item, "LayerList")
                names.append(name)
                modules.append(module)
                clusters.append([name])
        if not names:
            raise ValueError("LayerList is empty; a model needs at least one layer")
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"duplicate layer name {name!r}")
            seen.add(name)
        self.names = names
        # registered child: state_dict keys read "layers.<index>.<param>"
        self.layers = nn.ModuleList(modules)
        self.clusters = clusters
        self._index = {name: i for i, name in enumerate(names)}
        self.ties = tied_parameters(self)

    def __setstate__(self, state):   # a LayerList saved before ties were declared
        super().__setstate__(state)
        if "ties" not in self.__dict__:
            self.ties = tied_parameters(self)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[tuple[str, nn.Module]]:
        return iter(zip(self.names, self.layers))

    def index(self, name: str) -> int:
        """Position of layer `name` in forward order."""
        if name not in self._index:
            raise KeyError(f"no layer named {name!r}; layers are {self.names}")
        return self._index[name]

    def layer(self, name: str) -> nn.Module:
        return self.layers[self.index(name)]
