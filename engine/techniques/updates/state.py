"""What a checkpoint holds of LayerUpdates (updater.py): each layer's optimizer state, and the weights as the
updates keep them (the fp32 masters under bf16 working weights); and their restore (UpdateCheckpoint).

Imports torch.
"""

from __future__ import annotations

import torch


def named_state(optimizer: torch.optim.Optimizer, params: list, names: dict[int, str],
                copy: bool = True) -> dict[str, dict]:
    """`optimizer`'s state of each of `params` (in the order the optimizer holds them: the working parameter
    or its fp32 master) under its global name (`names`: id of a parameter -> the model's own name), copied to
    the CPU: {name: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}}. What a checkpoint of any job shape
    reads: a strategy, a world size and a placement leave it the same. `copy=False`: the live tensors, where
    they are (a checkpoint's writer copies each to the host as it writes it)."""
    held = optimizer.state_dict()["state"]
    return {names[id(p)]: {k: (v.detach().to("cpu", copy=True) if copy else v.detach()) if torch.is_tensor(v) else v
                           for k, v in held[i].items()}
            for i, p in enumerate(params) if i in held}


def load_named_state(optimizer: torch.optim.Optimizer, params: list, names: dict[int, str],
                     state: dict[str, dict]) -> None:
    """Each of `params` takes its entry of `state` (named_state's form, of the whole model or more); one
    without an entry starts afresh. The optimizer casts each entry to where it runs (device or host, dtype)."""
    own = optimizer.state_dict()
    own["state"] = {i: dict(state[names[id(p)]]) for i, p in enumerate(params) if names[id(p)] in state}
    optimizer.load_state_dict(own)


class UpdateCheckpoint:
    """What a checkpoint reads of LayerUpdates' updates and what a restore writes into them, by global name
    (`names`: id of a parameter -> the model's own name). `updates` is LayerUpdates' own (index ->
    LayerUpdate); LayerUpdates lets every host update land before each of these."""

    def __init__(self, updates: dict):
        self.updates = updates

    def state_by_name(self, names: dict[int, str], copy: bool = True) -> dict[str, dict]:
        """The optimizer state of every parameter updated here, under its global name (named_state)."""
        return {k: v for u in self.updates.values()
                for k, v in named_state(u.optimizer, u.params, names, copy).items()}

    def load_state_by_name(self, state: dict[str, dict], names: dict[int, str]) -> None:
        """Every layer updated here takes its parameters' entries of `state` (any strategy's, any job shape's)."""
        for u in self.updates.values():
            load_named_state(u.optimizer, u.params, names, state)

    def load_weights_by_name(self, read, names: dict[int, str]) -> None:
        """Every layer updated here takes its parameters' weights, `read(name)` (a checkpoint's, by global name;
        the fp32 masters where the run kept them), into its masters and working weights: one layer's in
        flight at a time."""
        for u in self.updates.values():
            u.load_weights([read(names[id(p)]) for p in u.params])

    def master_of(self) -> dict[int, torch.Tensor]:
        """id of each parameter updated here -> the weight its update keeps (the fp32 master where there
        is one): what a checkpoint stores."""
        return {id(p): w for u in self.updates.values() for p, w in zip(u.params, u.weights())}

    def weights_state(self, module: torch.nn.Module, copy: bool = True) -> dict[str, torch.Tensor]:
        """`module`'s state dict with each parameter updated here as its update keeps it (fp32 masters
        under bf16 working weights), so a checkpoint holds full-precision weights (`copy=False`: the live
        tensors, for a writer that reads them before the next step)."""
        kept = self.master_of()
        state = module.state_dict()
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in kept:
                state[name] = kept[id(p)].detach().clone() if copy else kept[id(p)].detach()
        return state
