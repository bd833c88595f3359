"""ShardedStrategy: the step (forward gated per layer, backward, gradients to their owners, the owners'
updates, the sliced broadcast), its checkpoints and its telemetry. The technique is described in
engine/strategies/sharded/__init__.py; the plan and the streams are its neighbours here.

Times are the device's (engine/training/timing.py: CUDA events on a GPU, perf_counter on the CPU), read after
the step's loss: that read waits for the step's work, so `timings` is the step's own on a GPU as on
the CPU, with no synchronize of its own. `fwd_ms` holds the gates' waits (`gate_ms`, on the same clock:
on a GPU the compute stream's wait for a slice's broadcast); `host_wait_ms` is host time (waiting for
host updates, on this thread). `device_clock`: the clock to read (by default the device's; tests pass a
scripted GPU's)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from engine.runtime import emulate
from engine.config import OptimConfig, ShardedConfig, UpdateConfig
from engine.training.loss import cross_entropy, share_loss, step_value
from engine.training.data import micro_steps
from engine.strategies.base import Strategy
from engine.models.layers import params_by_layer
from engine.runtime.devices import LedgerDevice, tensor_bytes
from engine.runtime.meter import CommMeter, stream_entry
from engine.techniques.updates.updater import LayerUpdates
from engine.runtime.topology import Topology
from engine.strategies.sharded.plan import assign_owners, plan_slices
from engine.strategies.sharded.reduce import GradientReduce
from engine.strategies.sharded.streams import Tiers
from engine.training.timing import Clock, StepTimes

PHASES = ("fwd_ms", "bwd_ms", "reduce_ms", "optim_ms", "gate_ms", "broadcast_wait_ms",   # a step's, on the device
          "reduce_span_ms",     # from the step's first gradient sent to its last sum: the reduce, hidden or not
          "broadcast_issue_ms")   # launching the slices: the broadcast's part of the step that nothing hides


# --- the strategy -----------------------------------------------------------------------

class ShardedStrategy(Strategy):
    name = "sharded"
    owning = True   # each parameter's update runs on its owner (layer_owners)

    def __init__(self, model, optim_cfg: OptimConfig, topo: Topology, device: LedgerDevice,
                 settings: ShardedConfig | None = None, *, seed: int = 0, update_cfg: UpdateConfig | None = None,
                 loss_fn=cross_entropy, device_clock: Clock | None = None,
                 reduce_dtype: torch.dtype = torch.float32, accumulate: int = 1):
        """`settings`: [parallel.sharded] (ShardedConfig, spec.py), its defaults where None."""
        settings = settings or ShardedConfig()
        streams, slices = settings.streams, settings.slices
        if slices < streams:
            raise ValueError(f"parallel.sharded.slices = {slices} is smaller than parallel.sharded.streams = "
                             f"{streams}; every stream needs at least one slice")
        self.model, self.topo, self.device, self.loss_fn = model, topo, device, loss_fn
        self.global_counted: int | None = None   # the step's counted targets over the global batch (engine/training/loss.py)
        self.overlap_forward = settings.overlap_forward
        self.accumulate = accumulate   # micro-steps per update: gradients go to their owners after the last
        self.world, self.rank = topo.world_size, topo.rank
        clock = device_clock or Clock(device.torch_device)
        self.times = StepTimes(clock, PHASES)

        # parameters in forward-use order (a shared one at its first use)
        order = [p for params in params_by_layer(model).values() for p in params]
        names = {id(p): n for n, p in model.named_parameters()}
        dtypes = {p.dtype for p in order}
        if len(dtypes) > 1:
            raise ValueError(f"the sharded strategy needs one parameter dtype; this model has "
                             f"{sorted(str(d) for d in dtypes)}")
        self.params = order
        self.param_names = [names[id(p)] for p in order]
        self.owners = assign_owners([tensor_bytes(p) for p in order], self.world)

        # flat buffers, one per owner, on every rank; parameters and gradients become views into them
        dtype = order[0].dtype if order else torch.float32
        offsets, totals = [], [0] * self.world
        for p, owner in zip(order, self.owners):
            offsets.append(totals[owner])
            totals[owner] += p.numel()
        dev = device.torch_device
        self.flat = [torch.empty(n, dtype=dtype, device=dev) for n in totals]
        self.grad_flat = [torch.zeros(n, dtype=dtype, device=dev) for n in totals]
        spans: list[list[tuple[int, int, int]]] = [[] for _ in range(self.world)]
        layer_of = {id(p): [] for p in order}
        for index, layer in enumerate(model.layers):
            for p in layer.parameters():
                layer_of[id(p)].append(index)
        with torch.no_grad():
            for p, owner, off in zip(order, self.owners, offsets):
                view = self.flat[owner][off:off + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                p.grad = self.grad_flat[owner][off:off + p.numel()].view_as(p)
                for layer in layer_of[id(p)]:
                    spans[owner].append((off, off + p.numel(), layer))
        # buffers (batch-norm statistics, say) follow rank 0's, as in DDP; those the state dict leaves out
        # (non-persistent: a rotary embedding's frequencies) are constants of the model, and stay out
        saved = set(model.state_dict())
        self.buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point() and n in saved]
        self.owned_bytes = sum(tensor_bytes(p) for p, o in zip(order, self.owners) if o == self.rank)

        # streams: process groups; with main_stream_communicates the compute group is stream 0
        self.groups = topo.stream_groups(streams, include_compute=settings.main_stream_communicates)
        self.meters = [CommMeter(clock, busy=topo.is_first) for _ in range(streams)]   # rank 0's read
        self.plan = plan_slices(spans, slices, streams, settings.slice_assignment, seed)
        self.gates: dict[int, list[int]] = {}   # layer -> the slices it waits for
        for i, s in enumerate(self.plan):
            for layer in s.layers:
                self.gates.setdefault(layer, []).append(i)

        # this rank updates the parameters it owns, each layer's on the device or the host
        mine = {id(p) for p, o in zip(order, self.owners) if o == self.rank}
        # owners update after the reduce, so the step guard decides first and never rolls back (clip_mode "wait")
        self.updater = LayerUpdates(model, params_by_layer(model, only=mine), optim_cfg, device,
                                    update_cfg or UpdateConfig(), clip_mode="wait")
        self.optimizer = self.updater   # what the ledger counts: device-side optimizer state

        # gradient sums, bucket by bucket (an owner's slices, merged up to 1 MiB): each rank sends a bucket's
        # gradients to its owner point-to-point as soon as backward has made all of them (across hosts: to the
        # owner's relay on this host), while backward goes on with earlier layers, as DDP's buckets do; the
        # owner, and a relay for the buckets it stands for, receive the others' into buffers of their own
        k = topo.local_world_size
        self.tiers = None
        if settings.hierarchical and 1 < k < self.world and self.world % k == 0:
            self.tiers = Tiers(self.rank, k, *topo.host_stream_groups(streams), timeout_s=topo.timeout_s)
        self.reduce = GradientReduce(self.plan, order, self.owners, offsets, self.grad_flat, topo, self.tiers,
                                     self.times, reduce_dtype)
        device.ledger.extra["gradients"] = sum(tensor_bytes(b) for bufs in self.reduce.incoming.values()
                                               for b in bufs.values())
        self._works: list = []                  # slice index -> work of the broadcast in flight
        self._pending: dict[int, list[int]] = {}
        for index, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(self._gate(index))
        self._broadcast_t0 = None   # the last broadcast's launch: its span runs to its last slice's landing
        self.timings = {"fwd_ms": 0.0, "bwd_ms": 0.0, "optim_ms": 0.0, "gate_ms": 0.0, "reduce_ms": 0.0,
                        "broadcast_wait_ms": 0.0, "owned_bytes": self.owned_bytes}
        # every rank starts from the owners' weights (as DDP starts from rank 0's)
        self._broadcast()
        self.sync()

    # --- the broadcast and its gates ------------------------------------------------------
    def _broadcast(self) -> None:
        self._works, self._pending = [], {layer: list(ids) for layer, ids in self.gates.items()}
        for meter in self.meters:
            meter.last = None
        self._broadcast_t0 = self.times.mark()
        for i, s in enumerate(self.plan):
            meter = self.meters[s.stream]
            buffer = self.flat[s.owner][s.start:s.stop]
            if self.tiers is not None:   # across hosts to the owner's peers; the stream's thread does the rest
                self._works.append(self.tiers.send(i, s, buffer, meter))
            else:
                t0 = meter.started(tensor_bytes(buffer))
                work = dist.broadcast(buffer, src=s.owner, group=self.groups[s.stream], async_op=True)
                work.get_future().then(lambda _fut, m=meter, t=t0: m.finished(t))
                self._works.append(work)
            if s.owner == self.rank:   # emulate.kill_at: an owner with a slice out and the rest to come
                emulate.reached("broadcast")

    def _gate(self, index: int):
        def hook(module, args) -> None:
            waiting = self._pending.pop(index, None)
            if waiting:
                t0 = self.times.mark()
                for i in waiting:
                    self._wait(i)
                self.times.add("gate_ms", t0, self.times.mark())
        return hook

    def _wait(self, i: int) -> None:
        try:
            self._works[i].wait()
        except RuntimeError as e:   # a peer died or hung: say which broadcast, keep the backend's words
            s = self.plan[i]
            names = ", ".join(self.model.names[k] for k in s.layers)
            raise RuntimeError(f"broadcast of slice {i} (from rank {s.owner} on stream {s.stream}, "
                               f"parameters of {names}) failed: {e}") from e

    def _broadcast_span(self) -> float:
        """Milliseconds from the last broadcast's launch to its last slice's landing (0 when not known)."""
        landed = [m.last for m in self.meters if m.last is not None]
        if self._broadcast_t0 is None or not landed:
            return 0.0
        return max(self.times.clock.ms(self._broadcast_t0, t) for t in landed)

    def sync(self) -> float:
        """Wait for every broadcast in flight; the seconds waited."""
        t0 = time.perf_counter()
        for i in range(len(self._works)):
            self._wait(i)
        self._works, self._pending = [], {}
        return time.perf_counter() - t0

    # --- a step -------------------------------------------------------------------------
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x.to(self.device.torch_device), y.to(self.device.torch_device)
        for owner, buffer in enumerate(self.grad_flat):
            if owner != self.rank:   # this rank's own shard: each update zeroed its gradients already
                buffer.zero_()
        self.updater.begin_step()
        self.reduce.begin_step()
        times = self.times
        times.begin_step()   # gates passed outside a step (an evaluation) are not this step's
        t0 = times.mark()
        micro = micro_steps(x, y, self.accumulate)
        losses = []
        # booked a micro-step at a time once one of this shape is known, every layer keeping (ledger.by_units)
        with self.device.ledger.by_units(("micro-step", tuple(x.shape), len(micro))) as units:
            for k, (xk, yk) in enumerate(micro):
                self.reduce.accumulating = k < len(micro) - 1
                ta = times.mark()
                units.forward_begin()
                loss = share_loss(self.loss_fn, self.model(xk), yk, self.global_counted, self.world,
                                  len(micro))   # the sum divides by the world
                units.forward_end()
                t1 = times.mark()
                loss.backward()
                units.backward_end()
                times.add("fwd_ms", ta, t1)
                times.add("bwd_ms", t1, times.mark())
                losses.append(loss.detach())
        self.reduce.accumulating = False
        t2 = times.mark()
        if self._works:   # a layer the forward never ran: its slices land before the update
            self.sync()
        broadcast_span = self._broadcast_span()   # the last step's broadcast: every slice of it has landed
        self.reduce.finish()   # the buckets whose gradients never all came, then this rank's shard summed
        t3 = times.mark()
        if self.reduce.t0 is not None:
            times.add("reduce_span_ms", self.reduce.t0, t3)
        self.updater.end_backward(self.topo.compute)   # the norm over every owner's shard decides; then device
        # updates inline, host ones on the executor meanwhile
        host_wait = self.updater.wait_host()   # a slice goes out only once all of it is updated
        for _, buffer in self.buffers:
            dist.broadcast(buffer, src=0, group=self.topo.compute)
        t4 = times.mark()
        self._broadcast()
        t5 = times.mark()
        times.add("broadcast_issue_ms", t4, t5)   # launching every slice (across hosts: the first level)
        if not self.overlap_forward:   # the step waits for the whole broadcast
            self.sync()
            times.add("broadcast_wait_ms", t5, times.mark())
        for name, a, b in (("reduce_ms", t2, t3), ("optim_ms", t3, t4)):
            times.add(name, a, b)
        value = step_value(losses)   # waits for the step's work: its marks are read without a synchronize
        # host_wait_ms: host time, as the host executor's updates are the host's work
        self.timings = {**times.end_step(), "owned_bytes": self.owned_bytes,
                        "host_wait_ms": host_wait * 1000, **self.updater.timings(),
                        "broadcast_span_ms": broadcast_span}
        self.device.ledger.refresh()
        return value

    def stream_stats(self, step_ms: float) -> list[dict]:
        return [stream_entry(i, meter.take(), step_ms) for i, meter in enumerate(self.meters)]

    def layer_owners(self) -> dict[str, int]:
        """Each layer's owner: the rank owning most of its parameter bytes (layers without any: none)."""
        owner_of = {id(p): o for p, o in zip(self.params, self.owners)}
        found = {}
        for name, layer in zip(self.model.names, self.model.layers):
            by_owner: dict[int, int] = {}
            for p in layer.parameters():
                by_owner[owner_of[id(p)]] = by_owner.get(owner_of[id(p)], 0) + tensor_bytes(p)
            if by_owner:
                found[name] = max(by_owner, key=by_owner.get)
        return found

    def layout(self) -> dict:
        return {"strategy": self.name, "world_size": self.world, "streams": len(self.groups),
                "two_level": self.tiers is not None,
                "slices": len(self.plan), "owners": dict(zip(self.param_names, self.owners))}

    # --- checkpoints: every owner writes its shard ------------------------------------------
    def weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """The parameters this rank owns (rank 0: the buffers too)."""
        self.sync()
        kept = self.updater.master_of()   # the weights as the owner's updates keep them (fp32 masters)
        held = {n: kept.get(id(p), p.detach()) for n, p, o in zip(self.param_names, self.params, self.owners)
                if o == self.rank}
        held.update({n: b.detach() for n, b in self.buffers} if self.topo.is_first else {})
        return {n: v.clone() for n, v in held.items()} if copy else held

    def close(self) -> None:
        """Let the last broadcasts land and give the stream groups back."""
        self.sync()
        self.updater.close()
        self.topo.release(self.groups)
        self.reduce.close()
        if self.tiers is not None:
            self.tiers.close()
            self.topo.release(self.tiers.within + self.tiers.across)
