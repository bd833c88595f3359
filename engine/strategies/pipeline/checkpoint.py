"""A pipeline stage's checkpoint (technique 4): the weights this stage writes under the model's own names (a
tied weight: its owner stage's only; its optimizer state is the base's, by name), and the restore from any
strategy's checkpoint, in the layout the run had reached when it was a pipeline of as many stages.
PipelineStage's collaborator (stage.py).

Imports engine.runtime.checkpoint and the pipeline's schedule (the layout's checks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.runtime import checkpoint as ckpt
from engine.strategies.base import parameter_names
from engine.strategies.pipeline.schedule import check_stages
from engine.techniques.updates.state import load_named_state


class StageCheckpoint:
    """A stage's checkpoint side: the weights it writes, the layout it resumes in, and (its own state) the
    checkpoint a balanced start takes its arriving layers' state from. The model, the updater, the ties and the
    layout are the stage's, read through `stage`."""

    def __init__(self, stage):
        self.stage = stage
        self.resumed: tuple | None = None   # (checkpoint, manifest) until the balanced start has placed the layers

    def weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """This stage's entries of the model's state_dict (a tied weight: its owner stage's only; sharded
        replicas: each writes the layers whose updates it owns, replica 0 those without an update)."""
        st = self.stage
        st.sync()
        whole = st.updater.weights_state(st.model, copy=False)   # as its updates keep them (fp32 masters)
        others = st.ties.not_owned_keys(st.layer_stages())
        mine = range(st.start, st.end)
        if st.shards is not None:
            mine = [i for i in mine if st.shards.owners.get(i, 0) == st.replica]
        keys = tuple(f"layers.{i}." for i in mine)
        return {k: v.detach().clone() if copy else v.detach() for k, v in whole.items()
                if k.startswith(keys) and k not in others}

    def gather_weights(self) -> None:
        """Every rank gets every stage's current weights from its replica's stages (an evaluation on rank 0)."""
        st = self.stage
        st.sync()
        with torch.no_grad():
            for stage, (start, end) in enumerate(check_stages(st.model.names, st.stage_layers)):
                for layer in st.model.layers[start:end]:
                    for t in list(layer.parameters()) + list(layer.buffers()):
                        dist.broadcast(t.data, src=dist.get_global_rank(st.group, stage), group=st.group)

    def resume_layout(self, reader) -> None:
        """A pipeline keeps the layout its run had reached (rebalancing may have moved it) when the checkpoint is
        a pipeline's with as many stages; otherwise the layout is this run's own, decided anew."""
        st = self.stage
        saved = reader.manifest.get("layout", {})
        if saved.get("strategy") == st.name and len(saved.get("stages") or []) == st.stages:
            try:
                check_stages(st.model.names, saved["stages"], st.grid.stages,
                             getattr(st.model, "clusters", None))
            except (ValueError, TypeError) as e:
                raise ckpt.CheckpointError(f"{reader.path}: its pipeline layout does not fit this model and world "
                                           f"size ({e})") from None
            st.sync()
            st.balance_first = False
            if saved["stages"] != st.stage_layers:
                st.adopt(saved["stages"])

    def keep_for_balance(self, reader) -> None:
        """Where the layout is decided at the first step, the layers it brings here need their state from this
        checkpoint then (restore_layers)."""
        if self.stage.balance_first:
            self.resumed = (reader.path, reader.manifest)

    def restore_layers(self, indices: list[int]) -> None:
        """Layers this stage took at the balanced start of a resumed run: their fp32 masters and optimizer state
        from the checkpoint it resumed from, by name (the working weights are every stage's copy already)."""
        if self.resumed is None or not indices:
            return
        st = self.stage
        names = parameter_names(st.model)
        with ckpt.Reader(*self.resumed) as reader:
            for u in filter(None, map(st.updater.updates.get, indices)):   # a layer with parameters
                u.load_weights([reader.weight(names[id(p)]) for p in u.params])
                load_named_state(u.optimizer, u.params, names, reader.optimizer)
