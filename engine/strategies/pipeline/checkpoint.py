"""A pipeline stage's checkpoint (technique 4): the weights this stage writes under the model's own names (a
tied weight: its owner stage's only; its optimizer state is the base's, by name), and the restore from any
strategy's checkpoint, in the layout the run had reached when it was a pipeline of as many stages (and `adopt`,
taking a layout between steps: a resume's, the balanced start's). PipelineStage's collaborator (stage.py).

Imports engine.runtime.checkpoint and the pipeline's schedule (the layout's checks).
"""

from __future__ import annotations

import torch

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
                self.adopt(saved["stages"])

    def adopt(self, stage_layers: list[list[str]]) -> list[int]:
        """Take a layout between steps (resume, the balanced start): nothing is in flight, the weights are
        every rank's own copy, and optimizer state starts fresh for layers this rank did not update (after a
        resume, the balanced start takes theirs from the checkpoint: restore_layers). Returns
        those layers."""
        st = self.stage
        if st.shards is not None:
            st.shards.migrate(st.stage_layers, stage_layers)
        st.set_layout(stage_layers)
        want = {i for i, ps in st.updated_here().items() if ps}
        for i in sorted(set(st.updater.updates) - want):
            st.updater.drop_layer(i)
        arrived = sorted(want - set(st.updater.updates))
        for i in arrived:
            st.updater.add_layer(i, st.owned[i])
        st.device.ledger.retrack(st.ledger_module)
        return arrived

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
