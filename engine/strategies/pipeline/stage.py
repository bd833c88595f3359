"""Pipeline parallel: each rank runs one stage (a run of consecutive layers) of the model.

    stage = PipelineStage(model, [["fc0", "act0", "fc1"], ["act1", "head"]], topo, device,
                          optim_cfg, PipelineConfig(micro_batches=4, schedule="1f1b", rebalance="off"))
    loss = stage.train_step(x, y)   # the global-batch loss on the last stage, None elsewhere
    stage.stage_params()            # the parameters this rank trains
    stage.layout()                  # {"strategy": "pipeline", "stages": ..., "schedule": ..., ...}
    decision = stage.check(step, requested=False)      # every rank, at each step boundary: rebalance?
    events = stage.boundary(step, trained, memory)     # the same, as the step loop asks it (rebalancing.py)

Rebalancing (engine/strategies/pipeline/rebalance.py): every stage times its layers; at a check the last
stage decides a new layout, and the layers migrate during the next step without
stopping it (engine/strategies/pipeline/migration.py: the layout switches at a micro-batch, weights and
optimizer state move at the step's start, partial gradients at its end).

With one replica rank r runs stage r. Every rank holds the whole LayerList (built from the same seed) but only runs
and updates its own layers (a weight tied across stages: StageTies, tied.py). x and y are the replica's batch on
every stage: stage 0 reads x, the last y (labels never travel), cut into `micro_batches` equal micro-batches;
activations travel forward and their gradients backward between neighbouring stages, point to point. Each
micro-batch's loss is weighted by its counted targets over the global batch's (engine/training/loss.py): gradients
and loss are those of one pass over the whole batch. One update per step, through LayerUpdates (begin_step before
the first forward, end_backward after, then validate: clipping decided over every stage, step_guard.py).

Messages (engine/strategies/pipeline/wire.py): a header with the shape and dtype, then the payload, on the first
message of a step in each direction (and the first under a new layout); non-blocking sends kept until the step's
end, blocking receives: both schedules are deadlock-free. Forward messages use tag 0, backward tag 1.

Stages x replicas (grid.py): R replicas of each stage, each running the pipeline on its share of the batch on a
process group of its own; a stage's replicas average their gradients (replicas.py) or own its layers' updates
(shards.py). `rank` here is the stage's index in its pipeline.

Schedules (schedule.py): "gpipe", all forwards then all backwards; "1f1b", min(stages - rank - 1, micro_batches)
warm-up forwards, then one forward and one backward in turn, then the remaining backwards.

Times: `timings` holds this stage's own compute on the device's clock (engine/training/timing.py: CUDA events on a
GPU, perf_counter on the CPU): each micro-batch's forward and backward from its input's (or gradient's) arrival to
its send queued, and the update. Waiting for a neighbour is `recv_wait_ms`, host time. On a GPU a stage before
the last, which reads nothing of its own step, reports the step before (StepTimes: no synchronize). `device_clock`: the clock to read (by default the device's; tests pass a scripted GPU's).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine.config import OptimConfig, PipelineConfig, UpdateConfig
from engine.models.compile import FIGURES, eager_layers
from engine.training.loss import counted, cross_entropy, share_loss
from engine.models.layers import params_by_layer
from engine.techniques.updates.updater import LayerUpdates
from engine.runtime.control import Table
from engine.runtime.events import Event
from engine.runtime.topology import Groups
from engine.strategies.base import Strategy
from engine.strategies.pipeline.evaluate import evaluate
from engine.strategies.pipeline.grid import Grid
from engine.strategies.pipeline.migration import Migration
from engine.strategies.pipeline.rebalancing import Rebalancing
from engine.strategies.pipeline.replicas import Replicas
from engine.strategies.pipeline.schedule import SCHEDULES, check_stages, schedule_ops, split_micro, uniform_stages
from engine.training.optim import make_optimizer
from engine.strategies.pipeline.shards import StageShards
from engine.strategies.pipeline.stage_times import stage_rows
from engine.strategies.pipeline.rebalance import LayerClock, Rebalancer, measure_link_rate
from engine.strategies.pipeline.tied import StageTies
from engine.strategies.pipeline.checkpoint import StageCheckpoint
from engine.strategies.pipeline.wire import BWD_TAG, FWD_TAG, StageWire
from engine.training.timing import Clock, StepTimes

TIME_EVERY = 4   # a stage times its layers on every 4th step (and before each automatic check)


class PipelineStage(Strategy):
    name = "pipeline"
    staged = True

    def __init__(self, model, stage_layers: list[list[str]] | str, topo, device, optim_cfg: OptimConfig,
                 settings: PipelineConfig, loss_fn=cross_entropy, update_cfg: UpdateConfig | None = None,
                 device_clock: Clock | None = None, grid: Grid | None = None, sharded=None):
        """`stage_layers`: the layout to start in (configured_stages resolves `settings.partition` to it, or
        "balanced"); `settings`: [parallel.pipeline] (PipelineConfig, spec.py); `grid`: which rank holds which
        stage of which replica (grid.py; by default one replica, rank r stage r); `sharded`: [parallel.sharded]
        (ShardedConfig) where a stage's replicas own its layers' updates (shards.py), None: they average."""
        schedule, micro_batches, rebalance = settings.schedule, settings.micro_batches, settings.rebalance
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        self.grid = grid = grid or Grid.of(topo.world_size, topo.world_size)
        self.balance_first = stage_layers == "balanced"   # profiled and split at the first step
        if self.balance_first:
            stage_layers = uniform_stages(model, grid.stages)
        check_stages(model.names, stage_layers, grid.stages, getattr(model, "clusters", None))
        self.model, self.topo, self.device, self.loss_fn = model, topo, device, loss_fn
        self.schedule, self.micro_batches = schedule, micro_batches
        # `rank`: this rank's stage, its index in its replica's pipeline (the wire, the ties, a migration)
        self.stages, self.rank, self.replica = len(stage_layers), grid.stage_of(topo.rank), grid.replica_of(topo.rank)
        self.is_first, self.is_last = self.rank == 0, self.rank == self.stages - 1
        # one replica: the world; several: this replica's pipeline (and this stage's replicas: replicas.py)
        self.replicas = Replicas(grid, topo)
        self.group = group = self.replicas.pipeline
        self.prev = None if self.is_first else dist.get_global_rank(group, self.rank - 1)
        self.next = None if self.is_last else dist.get_global_rank(group, self.rank + 1)
        self.set_layout(stage_layers)
        self.owned = params_by_layer(model)   # each layer's update's; a tied weight's first holder's (StageTies)
        self.shards = StageShards(self, sharded) if sharded is not None and grid.replicas > 1 else None
        self.norm_group = topo.compute if self.shards else group   # where every gradient is, once
        # a device update frees its gradients (no buffer holds a view of them: replicas.py and shards.py copy),
        # which the ledger counts as held
        self.updater = LayerUpdates(model, self.updated_here(), optim_cfg, device, update_cfg or UpdateConfig(),
                                    release_grads=device.ledger.count_as_held)
        self.ties = StageTies(model, self.group, self.rank)
        # torch's first optimizer is slow (1.8 s: lazy imports): not inside the step layers migrate in
        make_optimizer(optim_cfg, [torch.nn.Parameter(torch.zeros(1))])
        self.optimizer = self.updater
        self.timings = {"fwd_ms": 0.0, "bwd_ms": 0.0, "optim_ms": 0.0}
        self.wire = StageWire(group, self.rank, device.torch_device)   # the messages to the neighbours
        self.ckpt = StageCheckpoint(self)   # what a checkpoint holds of this stage, the layout it resumes in
        self.times = StepTimes(device_clock or Clock(device.torch_device), ("fwd_ms", "bwd_ms", "optim_ms"))
        self.layer_clock = LayerClock(model.names, self.times.clock)   # the layer times the rebalance plans with
        self.layer_clock.armed = rebalance != "off"
        self._steps = 0   # steps run, for the clock's sampling
        self._deferred = False   # an operator's check waits for one timed step
        # the layout's model counts each boundary's sends at the links' measured rate (only where it can move)
        rate = measure_link_rate(group, self.rank, self.stages, device.torch_device) \
            if rebalance != "off" or self.balance_first else math.inf
        self.rebalancer = Rebalancer(model, topo, rebalance, settings.imbalance_threshold,
                                     settings.rebalance_check_every, rate, micro_batches, grid)
        self.pending: list[list[str]] | None = None   # the layout the next step migrates to
        self.migration: Migration | None = None      # the last step's migration, until reported
        self.rebalancing = Rebalancing(self)   # the operator's command and the check, as the step loop asks

    def set_layout(self, stage_layers: list[list[str]]) -> None:
        """This rank's range of layers (at construction, after a migration, on resume)."""
        ranges = check_stages(self.model.names, stage_layers, self.grid.stages,
                              getattr(self.model, "clusters", None))
        self.stage_layers = [list(s) for s in stage_layers]
        self.start, self.end = ranges[self.rank]
        self.ledger_module = torch.nn.ModuleList(self.model.layers[self.start:self.end])

    def parallel_groups(self, rank: int, world_size: int) -> Groups:
        """Model parallel within a replica: its stages hold one copy of the model, and every stage of it takes the
        replica's share of the batch (stage 0 its inputs, the last its labels); data parallel across the
        replicas, a share each (one replica: the whole batch)."""
        return Groups(tuple(self.grid.group_of(self.rank)), tuple(self.grid.pipeline(self.replica)))

    def tracked_module(self) -> torch.nn.Module:
        return self.ledger_module

    def owned_layers(self) -> list[str]:
        """The layers this stage runs now (engine/techniques/memory/ plans their activation policies)."""
        return self.model.names[self.start:self.end]

    def in_flight(self) -> int:
        """Micro-batches whose activations this stage holds at once, at most: all of them under GPipe;
        under 1F1B the warm-up forwards plus the one in progress."""
        if self.schedule == "gpipe":
            return self.micro_batches
        return min(self.stages - self.rank, self.micro_batches)

    def updated_here(self) -> dict[int, list]:
        """The parameters of each layer whose update runs here: this stage's layers (sharded: those it owns)."""
        if self.shards is not None:
            return self.shards.mine(self.start, self.end)
        return {i: ps if self.start <= i < self.end else [] for i, ps in self.owned.items()}

    # --- a step --------------------------------------------------------------------------------
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        size = split_micro(x.shape[0], self.micro_batches)
        if y.shape[0] != x.shape[0]:   # checked on every rank, so all refuse the step together
            raise ValueError(f"x has {x.shape[0]} samples but y has {y.shape[0]}")
        if self.balance_first:
            self.balance_first = False
            decision = self.rebalancer.initial(self.model, x[:size], y[:size], self.loss_fn, self.stage_layers)
            if decision.changed:
                self.ckpt.restore_layers(self.ckpt.adopt(decision.stages))
            self.ckpt.resumed = None
        dev = self.device.torch_device
        m, counted_y = self.micro_batches, counted(y, self.loss_fn) if self.is_last else 0
        # the global batch's counted targets, over which every micro-batch's loss is a part of the mean: its own
        # batch's with one replica; with R, each replica holds a share (equal, unless some labels are ignored)
        total, replicas = counted_y, self.grid.replicas
        if replicas > 1 and self.is_last:
            total = self.global_counted if self.global_counted is not None else counted_y * replicas
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        times = self.times
        times.begin_step()
        self.updater.begin_step()
        if self.pending and self.shards is not None:
            self.shards.sync()   # the weights that move are the owners' last
        move, self.pending = (Migration(self, self.pending) if self.pending else None), None
        wire, ops = self.wire, schedule_ops(self.schedule, self.stages, self.rank, m)
        ranges = [(self.start, self.end)]
        arrivals = eager_layers(())
        if move is not None:
            move.start()
            # posted before the schedule's first receive: NCCL matches a pair's messages in the order they are
            # posted, whatever their tags (the sources send the state first); taken before its first new-layout op
            move.receive_state()
            ranges.append(check_stages(self.model.names, move.new)[self.rank])
            # `[model] compile`: a layer that arrives runs eager in its migration step, compiled from the next
            arrivals = eager_layers([self.model.layers[i] for i in range(*ranges[1])
                                     if not self.start <= i < self.end])
        wire.begin_step(move, ops, self.prev, self.next)   # the schedule's receives, each posted one ahead
        compiles = FIGURES.dynamo + FIGURES.seconds
        # saved tensors counted through autograd's hooks until a micro-batch of this layout and shape is known;
        # then each micro-batch at once (MemoryLedger.unit_bytes: the same peak)
        key = (self.start, self.end, tuple(x.shape), x.dtype)
        with self.device.ledger.by_units(key, exact=move is not None) as units, arrivals:
            last = len(ops) - 1 if move is None else -1   # its gradients are final (a migration's arrive after)
            for k, (op, i) in enumerate(ops):
                new_layout = move is not None and move.ready(i)
                if op == "F":
                    # each op is marked from its input's arrival (after any receive) to its send queued
                    received = None if self.is_first else wire.recv(self.prev, FWD_TAG, new_layout)
                    t0 = times.mark()
                    if self.is_first:
                        # its own copy, as on a GPU: a view would keep (and swap) the whole batch's storage
                        inp = x[i * size:(i + 1) * size].to(dev, copy=True)
                    else:
                        inp = received.requires_grad_(True)
                    start, end = ranges[1] if new_layout else ranges[0]
                    units.forward_begin()
                    out = self.layer_clock.forward(self.model.layers, start, end, inp)
                    if self.is_last:
                        # the labels' own copy too: a view would share one storage across the micro-batches
                        mine = y[i * size:(i + 1) * size].to(dev, copy=True)
                        loss = share_loss(self.loss_fn, out, mine, total, replicas)
                        losses.append(loss.detach())
                        outputs[i] = loss
                    else:
                        wire.send(out, self.next, FWD_TAG, new_layout)
                        outputs[i] = out
                    inputs[i] = inp
                    units.forward_end()
                    times.add("fwd_ms", t0, times.mark())
                else:
                    out, inp = outputs.pop(i), inputs.pop(i)
                    if k == last:   # the replicas' exchange overlaps the last backward (replicas.py, shards.py)
                        (self.shards or self.replicas).arm(self._own_params(tied=False))
                    grad = None if self.is_last else wire.recv(self.next, BWD_TAG, new_layout)
                    t0 = times.mark()
                    if out.requires_grad:   # a stage of layers without parameters on stage 0 has no graph
                        self.layer_clock.backward(out, grad)
                    if not self.is_first:
                        wire.send(inp.grad if inp.grad is not None else torch.zeros_like(inp), self.prev, BWD_TAG,
                                  new_layout)
                    units.backward_end()
                    times.add("bwd_ms", t0, times.mark())
        if move is not None:
            move.finish()   # partial gradients change hands before the update
            self.set_layout(move.new)
            self.device.ledger.retrack(self.ledger_module)
            self.layer_clock.take()   # the next check measures the new layout only
            self.migration, wire.moving = move, None
        elif self._steps == 0 or FIGURES.dynamo + FIGURES.seconds != compiles:
            # the first step pays one-off costs (allocations, lazy imports), a step that compiled its compile
            # (engine/models/compile.py): not a layer's cost
            self.layer_clock.take()
        else:
            self.layer_clock.end_step()
        self._steps += 1
        wire.sent_bytes += self.ties.sum_grads(self.layer_stages(), wire.pending)
        shards = self.shards
        reduce_s = shards.reduce(self.start, self.end) if shards else self.replicas.average(self._own_params())
        t0 = times.mark()
        self.updater.end_backward(self.norm_group)   # the norm over every stage decides (clip_mode "wait"), or
        self.updater.validate(self.norm_group)       # validates the updates that ran ("speculate": redone if clipped)
        times.add("optim_ms", t0, times.mark())
        if shards:   # the owners' layers out; a tied weight settled before the pipeline returns it (tied.py)
            shards.broadcast(self.start, self.end, self.updater)
            shards.settle([tie[0] for tie in self.ties.ties])
        wire.sent_bytes += self.ties.return_weights(self.layer_stages(), self.updater, wire.pending)
        wire.finish()
        loss = float(torch.stack(losses).sum()) if self.is_last else None   # waits for the last stage's work
        # fwd/bwd: this stage's own compute; waiting for neighbours is recv_wait_ms (idle in the stages panel)
        self.timings = {**times.end_step(), "recv_wait_ms": wire.recv_s * 1000, "sent_bytes": wire.sent_bytes,
                        "migration_bytes": move.sent_bytes if move else 0,
                        "migration_ms": move.duration_ms if move else 0.0,
                        **({"replica_reduce_ms": reduce_s * 1000} if reduce_s is not None else {}),
                        **({"shard_gate_ms": shards.take_gate_ms()} if shards else {})}
        self.device.ledger.refresh()
        return loss

    # --- rebalancing -----------------------------------------------------------------------------
    def check(self, step: int, requested: bool = False, memory=None):
        """Every rank, at every step boundary. A check when one is due (or `requested`): the RebalanceDecision,
        whose layout (if changed) the next step migrates to; otherwise None. With `memory` (the activation
        policy, `auto`), the check picks only layouts every stage can hold (engine/techniques/memory/room.py)."""
        decision = None
        requested, self._deferred = requested or self._deferred, False
        if requested and self.layer_clock.steps == 0:   # nothing timed since the last change: time this step first
            self._deferred = True
        elif self.pending is None and self.rebalancer.due(step, requested):
            room = (lambda: memory.room(self.layer_static_bytes())) if memory is not None and memory.auto else None
            decision = self.rebalancer.check(step, self.layer_clock, self.stage_layers, requested, room)
            if decision.changed:
                self.pending = decision.stages
        # time every TIME_EVERY-th step, and always the step before an automatic check; never a step that migrates
        # (its times are not the layout's: dropped, `take`)
        r = self.rebalancer
        self.layer_clock.armed = r.mode != "off" and self.pending is None and (
            self._steps % TIME_EVERY == 0 or self._deferred or (r.mode == "auto" and (step + 1) % r.check_every == 0))
        return decision

    def take_migration(self) -> Migration | None:
        """The migration the last step ran, once (for its report)."""
        move, self.migration = self.migration, None
        return move

    def migrate(self, new_stages: list[list[str]]) -> None:
        """Move to `new_stages` during the next step (every rank, at the same boundary)."""
        check_stages(self.model.names, new_stages, self.grid.stages, getattr(self.model, "clusters", None))
        self.pending = [list(s) for s in new_stages] if new_stages != self.stage_layers else None

    # --- views ---------------------------------------------------------------------------------
    def layer_static_bytes(self) -> dict[str, int]:
        """Each layer this stage runs: the device bytes that travel with it in a migration (rebalancing.py)."""
        return self.rebalancing.static_bytes()

    def _own_params(self, tied: bool = True) -> list[torch.nn.Parameter]:
        """The parameters of this stage's layers (a tied weight: its first holder's; `tied` False: none)."""
        left_out = set() if tied else {id(tie[2]) for tie in self.ties.ties}
        return [p for i in range(self.start, self.end) for p in self.owned[i] if id(p) not in left_out]

    def stage_params(self) -> list[torch.nn.Parameter]:
        return [p for u in self.updater.updates.values() for p in u.params]

    def stage_state(self) -> dict[str, torch.Tensor]:
        """This stage's entries of model.state_dict() (keys as in the whole model)."""
        keys = tuple(f"layers.{i}." for i in range(self.start, self.end))
        return {k: v for k, v in self.model.state_dict().items() if k.startswith(keys)}

    def layout(self) -> dict:
        out = {"strategy": "pipeline", "stages": self.stage_layers, "schedule": self.schedule,
               "micro_batches": self.micro_batches}
        if self.grid.replicas > 1:   # stages x replicas: which ranks hold each stage (grid.py)
            out["grid"] = {**self.grid.said(), "data": "sharded" if self.shards else "ddp", "owners": bool(self.shards)}
        return out

    # --- what the step loop asks (engine/strategies/base.py) --------------------------------------
    def step_loss(self, losses: list[float]) -> float:
        return self.replicas.loss(losses)   # every replica's last stage's: their mean is the global batch's

    def events(self, step: int, table: Table, run_dir) -> list[Event]:
        return super().events(step, table, run_dir) + self.rebalancing.migrated(step, table)

    def command(self, command: dict, step: int) -> list[Event] | None:
        taken = command["name"] == "rebalance" and self.rebalancer.mode != "off"   # its spec's commands say so
        return self.rebalancing.command(command) if taken else None

    def boundary(self, step: int, trained: bool, memory) -> list[Event]:
        return self.rebalancing.boundary(step, trained, memory)

    def layer_stages(self) -> dict[str, int]:
        return {name: stage for stage, names in enumerate(self.stage_layers) for name in names}

    def stage_rows(self, ranks: list[dict]) -> dict:
        """The step record's `stages` and `imbalance_ms` (stage_times.py stage_rows)."""
        return stage_rows(self, ranks)

    def weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        return self.ckpt.weights(copy)

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """A stage's replicas hold one copy between them, the same on each: replica 0 writes it (sharded: each
        owner its layers', StageCheckpoint.weights)."""
        if self.replica and self.shards is None:
            self.sync()
            return {}, {}
        return super().checkpoint_state()

    def load(self, reader) -> None:
        """The layout its run had reached, where it fits (StageCheckpoint.resume_layout); then every weight by
        name (every stage holds the whole model's copy) and this stage's optimizer state, as the base loads."""
        self.ckpt.resume_layout(reader)
        super().load(reader)
        self.ckpt.keep_for_balance(reader)

    def sync(self) -> float:
        """Host updates and (sharded) every broadcast in flight have landed; the seconds waited for the former."""
        waited = super().sync()
        if self.shards is not None:
            self.shards.sync()
        return waited

    def close(self) -> None:
        if self.shards is not None:
            self.shards.close()
        super().close()

    def evaluate(self, ds, precision, limit: int, chunk: int) -> dict:
        """Through the pipeline, each replica its share, on every rank (evaluate.py): no weight gathered."""
        return evaluate(self, ds, precision, limit, chunk)
