"""A pipeline stage's checkpoint (technique 4): the weights this stage writes under the model's own names (a
tied weight: its owner stage's only) and their optimizer state, one file per stage; and the restore, in the
layout the run had reached. Part of PipelineStage (stage.py).

Imports engine.runtime.checkpoint and the pipeline's schedule (the layout's checks).
"""

from __future__ import annotations

import torch

from engine.runtime import checkpoint as ckpt
from engine.strategies.pipeline.schedule import check_stages


class StageCheckpoint:
    """PipelineStage's checkpoint side (a mixin: the model, the updater, the ties and the layout are the stage's)."""

    def weights(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the model's state_dict (a tied weight: its owner stage's only)."""
        self.sync()
        whole = self.updater.weights_state(self.model)   # this stage's weights as its updates keep them (fp32 masters)
        others = self.ties.not_owned_keys(self.layer_stages())
        return {k: whole[k].detach().clone() for k in self.stage_state() if k not in others}

    def save(self, staged) -> None:
        ckpt.write_file(staged, f"stage{self.rank}.pt",
                        {"params": self.weights(), "optimizer": self.updater.state_dict()})

    def load(self, source, manifest: dict) -> None:
        ckpt.check_strategy(source, manifest, self.name)
        saved = manifest["layout"].get("stages")
        try:   # the layout the run had reached (rebalancing may have moved it): resume in that layout
            check_stages(self.model.names, saved, self.topo.world_size, getattr(self.model, "clusters", None))
        except (ValueError, TypeError) as e:
            raise ckpt.CheckpointError(f"{source}: its pipeline layout does not fit this model and world "
                                       f"size ({e})") from None
        self.sync()
        self.balance_first = False
        if saved != self.stage_layers:
            self._adopt(saved)
        state = self.model.state_dict()
        with torch.no_grad():
            for stage in range(self.stages):
                part = ckpt.load_file(source, f"stage{stage}.pt")
                for key, value in part["params"].items():
                    state[key].copy_(value)
                if stage == self.rank:
                    weights = {id(p): part["params"][n] for n, p in self.model.named_parameters(remove_duplicate=False)
                               if n in part["params"]}
                    self.updater.load_state_dict(part["optimizer"], weights)
