"""A pipeline stage's checkpoint (technique 4): the weights this stage writes under the model's own names (a
tied weight: its owner stage's only; its optimizer state is the base's, by name), and the restore from any
strategy's checkpoint, in the layout the run had reached when it was a pipeline of as many stages. Part of
PipelineStage (stage.py).

Imports engine.runtime.checkpoint and the pipeline's schedule (the layout's checks).
"""

from __future__ import annotations

import torch

from engine.runtime import checkpoint as ckpt
from engine.strategies.base import parameter_names
from engine.strategies.pipeline.schedule import check_stages
from engine.techniques.updates.state import load_named_state


class StageCheckpoint:
    """PipelineStage's checkpoint side (a mixin: the model, the updater, the ties and the layout are the stage's)."""

    resumed: tuple | None = None   # (checkpoint, manifest) until the balanced start has placed the layers

    def weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """This stage's entries of the model's state_dict (a tied weight: its owner stage's only)."""
        self.sync()
        whole = self.updater.weights_state(self.model, copy=False)   # as its updates keep them (fp32 masters)
        others = self.ties.not_owned_keys(self.layer_stages())
        return {k: whole[k].detach().clone() if copy else whole[k].detach() for k in self.stage_state()
                if k not in others}

    def load(self, reader) -> None:
        """A pipeline keeps the layout its run had reached (rebalancing may have moved it) when the checkpoint is
        a pipeline's with as many stages; otherwise the layout is this run's own, decided anew. Then every
        weight by name (every stage holds the whole model's copy), and this stage's optimizer state."""
        saved = reader.manifest.get("layout", {})
        if saved.get("strategy") == self.name and len(saved.get("stages") or []) == self.stages:
            try:
                check_stages(self.model.names, saved["stages"], self.topo.world_size,
                             getattr(self.model, "clusters", None))
            except (ValueError, TypeError) as e:
                raise ckpt.CheckpointError(f"{reader.path}: its pipeline layout does not fit this model and world "
                                           f"size ({e})") from None
            self.sync()
            self.balance_first = False
            if saved["stages"] != self.stage_layers:
                self._adopt(saved["stages"])
        super().load(reader)
        if self.balance_first:   # the layout is decided at the first step: the layers it brings here need theirs
            self.resumed = (reader.path, reader.manifest)

    def restore_layers(self, indices: list[int]) -> None:
        """Layers this stage took at the balanced start of a resumed run: their fp32 masters and optimizer state
        from the checkpoint it resumed from, by name (the working weights are every stage's copy already)."""
        if self.resumed is None or not indices:
            return
        names = parameter_names(self.model)
        with ckpt.Reader(*self.resumed) as reader:
            for u in filter(None, map(self.updater.updates.get, indices)):   # a layer with parameters
                u.load_weights([reader.weight(names[id(p)]) for p in u.params])
                load_named_state(u.optimizer, u.params, names, reader.optimizer)
