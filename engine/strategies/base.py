"""The strategy contract: every call the step loop (engine/run/worker.py) makes of a data-parallel or pipeline
strategy, with what a strategy that has nothing to say there answers. A strategy subclasses Strategy and
overrides what it does otherwise; the loop never asks whether a strategy has a member.

    strategy.begin_step(lr, counted)        # before the step: its learning rate, the global batch's targets
    loss = strategy.train_step(x, y)        # one optimizer step on this rank's share (None: not the loss's rank)
    strategy.step_loss(losses)              # every rank's loss -> the step's
    events = strategy.events(step, table, run_dir)         # after the exchange: what happened in the step
    strategy.command(command, step)         # an operator command of this strategy's own (None: not one)
    events = strategy.boundary(step, trained, memory)      # at the boundary, after the commands

What the console and the ledger see: tracked_module, owned_layers, in_flight, layer_owners, layer_stages,
stage_rows, stream_stats, layout. Checkpoints: weights and optimizer_state (this rank's, under the model's own
names: checkpoint_state, what it writes), load_optimizer_state and load (from any strategy's and job shape's, by
name: engine/runtime/checkpoint.py, format 2).

A fifth strategy: one package of its own, engine/strategies/NAME/, with its code (a subclass of Strategy:
train_step and weights, and what it does otherwise, its commands and events, what the console sees) and its
spec.py (its StrategySpec: its settings table [parallel.NAME], handed to it whole, split, checks, commands,
builder), and one line in engine/strategies/specs/registry.py, which makes it a `parallel.strategy` choice and
what make_strategy builds. The step loop does not change.

Imports engine.runtime (events, topology), engine.techniques.updates.report and engine.training.evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.runtime.events import Event
from engine.runtime.topology import Groups
from engine.techniques.updates.report import plan_events
import engine.training.evaluation as evaluation

if TYPE_CHECKING:   # the strategies package is imported on the way to engine.runtime.control's figures
    from engine.runtime.control import Table


class Strategy:
    name = ""
    staged = False         # its layers live on stages: layer_stages and stage_rows say which
    owning = False         # each parameter's update runs on its owner rank: layer_owners says which

    # set by every strategy's constructor
    model: torch.nn.Module
    updater: object         # every layer's update, on the device or the host (engine/techniques/updates/updater.py)
    optimizer: object       # what the ledger counts as optimizer state
    timings: dict           # this step's fwd_ms, bwd_ms, optim_ms (and the mode's own figures)
    global_counted: int | None = None   # the step's counted targets over the global batch (engine/training/loss.py)

    # --- the step --------------------------------------------------------------------------------
    def parallel_groups(self, rank: int, world_size: int) -> Groups:
        """Who splits the batch and who holds one copy of the model (engine/runtime/topology.py Groups): data
        parallel by default, every rank a share of the batch and a whole model."""
        return Groups.data_parallel(rank, world_size)

    def begin_step(self, lr: float, counted: int | None) -> None:
        self.updater.lr = lr   # each layer's update takes it as it goes
        self.global_counted = counted

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        raise NotImplementedError

    def step_loss(self, losses: list[float]) -> float:
        """The step's loss from every rank's, the exchange's `loss` column as numbers (each rank's share of the
        global batch's mean): no tensor operation at the step's boundary."""
        return losses[0] if len(losses) == 1 else sum(losses) / len(losses)

    def events(self, step: int, table: Table, run_dir: Path) -> list[Event]:
        """Every rank, after the step's exchange (`table`: every rank's figures): what happened in it."""
        return plan_events(self.updater, step, run_dir)

    def command(self, command: dict, step: int) -> list[Event] | None:
        """An operator command of this strategy's own, taken (its answer in the events, or later); None: not one."""
        return None

    def boundary(self, step: int, trained: bool, memory) -> list[Event]:
        """Every rank, at the step boundary after the commands (a pipeline's rebalance check)."""
        return []

    def sync(self) -> float:
        """Host updates in flight land (before a checkpoint, an evaluation, the end)."""
        return self.updater.wait_host()

    def evaluate(self, ds, precision, limit: int, chunk: int) -> dict:
        """Every rank, at an evaluation: the test accuracy, validation loss and perplexity over the first `limit`
        test samples (engine/training/evaluation.py), the same on every rank. Here each rank runs its share of
        them through its whole model, `chunk` at a time, once every update has landed, and the counts are summed
        over the ranks; a strategy whose ranks hold parts of the model runs them through its own schedule."""
        self.sync()
        n = evaluation.samples(ds, limit)
        if not n:
            return dict(evaluation.NONE)
        world, rank = self.topo.world_size, self.topo.rank
        counts = evaluation.share_counts(self.model, ds, self.device.torch_device, precision, self.loss_fn,
                                         *evaluation.share(n, rank, world), chunk)
        if world > 1:
            dist.all_reduce(counts, group=self.topo.compute)
        return evaluation.figures(counts, self.loss_fn)

    # --- what the ledger, the memory policy and the console see ----------------------------------
    def tracked_module(self) -> torch.nn.Module:
        """What this rank's ledger counts (a pipeline stage: its own layers, followed as they move)."""
        return self.model

    def owned_layers(self) -> list[str]:
        """The layers this rank runs (their activation policies are planned here)."""
        return list(self.model.names)

    def in_flight(self) -> int:
        """Micro-batches whose activations this rank holds at once, at most."""
        return 1

    def layer_owners(self) -> dict[str, int]:
        return {}

    def layer_stages(self) -> dict[str, int]:
        return {}

    def stage_rows(self, ranks: list[dict]) -> dict:
        """The step record's stage fields (a pipeline's `stages`, `imbalance_ms`...)."""
        return {}

    def stream_stats(self, step_ms: float) -> list[dict]:
        return []

    def layout(self) -> dict:
        return {"strategy": self.name}

    # --- checkpoints and the end -----------------------------------------------------------------
    def weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The weights this rank writes, under the model's own state_dict names, as its updates keep them (fp32
        masters under bf16 working weights). Every rank's together hold every weight once or more: what a
        load by name (a new job shape) reads. `copy=False`: the live tensors (a checkpoint's writer)."""
        raise NotImplementedError

    def optimizer_state(self, copy: bool = True) -> dict[str, dict]:
        """The optimizer state this rank keeps, under the model's own parameter names ({name: {"exp_avg": ...,
        "step": ...}}, on the CPU): the parameters whose updates run here. Every rank's together hold every
        parameter's once or more, as `weights` does: what a load by name (a new job shape) reads."""
        self.sync()
        return self.updater.state_by_name(parameter_names(self.model), copy)

    def load_optimizer_state(self, state: dict[str, dict]) -> None:
        """Each parameter whose update runs here takes its entry of `state` (a whole model's by name, written
        by any strategy and job shape: optimizer_state's form); one without an entry starts afresh."""
        self.sync()
        self.updater.load_state_by_name(state, parameter_names(self.model))

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """What this rank writes to a checkpoint: (weights, optimizer state) by global name. Together the ranks
        write every weight and every parameter's optimizer state once or more (a copy others hold alike may be
        left to one of them: DDP's rank 0). The live tensors, not copies: the writer reads each before the next
        step, one at a time."""
        return self.weights(copy=False), self.optimizer_state(copy=False)

    def load(self, reader) -> None:
        """This rank's weights and optimizer state from a checkpoint written by any strategy at any world size
        (reader: engine.runtime.checkpoint.Reader), by name, one tensor at a time: the model's working weights
        (every rank's own copy), the masters and optimizer state of the parameters whose updates run here."""
        self.sync()
        updated = {id(p) for u in self.updater.updates.values() for p in u.params}
        theirs = {name for name, p in self.model.named_parameters(remove_duplicate=False) if id(p) in updated}
        with torch.no_grad():   # the rest: load_weights_by_name reads the updated ones into masters and weights
            for key, value in self.model.state_dict().items():
                if key not in theirs:
                    value.copy_(reader.weight(key, tuple(value.shape)))
        names = parameter_names(self.model)
        self.updater.load_weights_by_name(lambda name: reader.weight(name), names)
        self.updater.load_state_by_name(reader.optimizer, names)

    def close(self) -> None:
        self.updater.close()


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """id of each parameter -> its name in the model's own state_dict (a tied one: its first name)."""
    return {id(p): name for name, p in model.named_parameters()}
