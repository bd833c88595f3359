"""Baseline data parallel: torch DistributedDataParallel, the reference every technique is measured against.

    strategy = DDPStrategy(model, optim_cfg, topo, device)
    loss = strategy.train_step(x, y)      # forward, backward (all-reduce inside), optimizer step
    strategy.timings                      # fwd_ms, bwd_ms, optim_ms, compute_ms of that step, on the device's clock
    strategy.stream_stats()               # the one communicator: bytes, busy time, in flight
    strategy.checkpoint_state(); strategy.load(reader)   # rank 0 writes the copy every rank holds

Every strategy has this contract (engine/strategies/base.py: Strategy): it builds its own
optimizer over what it updates, and says what of a checkpoint it writes and reads, by global name.

Each rank runs its slice of the global batch; DDP averages gradients, so a step
equals a single-process step on the whole global batch. A communication hook
around DDP's own all-reduce measures the traffic without changing it.

Times are the device's (engine/training/timing.py: CUDA events on a GPU, perf_counter on the CPU), read after
the step's loss: that read waits for the step's work, so `timings` is the step's own on a GPU as on
the CPU, with no synchronize of its own. `device_clock`: the clock to read (by default the device's;
tests pass a scripted GPU's).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from engine.training.data import micro_steps
from engine.training.loss import cross_entropy, share_loss, step_value
from engine.config import OptimConfig, UpdateConfig
from engine.models.layers import params_by_layer
from engine.runtime.devices import LedgerDevice
from engine.runtime.gradients import FreedGradients
from engine.runtime.refusal import Refused
from engine.techniques.updates.updater import LayerUpdates
from engine.runtime.meter import CommMeter, stream_entry
from engine.runtime.topology import Topology
from engine.strategies.base import Strategy
from engine.strategies.ddp.spec import DdpConfig
from engine.training.timing import Clock, StepTimes

UNUSED_PARAMETERS = ("a parameter of the model got no gradient in a step (a layer that skips some of its parameters, "
                     "as a mixture of experts with a module per expert does): torch's DistributedDataParallel, which "
                     "parallel.strategy = \"ddp\" runs, then needs parallel.ddp.find_unused_parameters = true; or train "
                     "with parallel.strategy = \"sharded\", which counts a gradient that never came as zero")


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, model: torch.nn.Module, optim_cfg: OptimConfig, topo: Topology,
                 device: LedgerDevice, settings: DdpConfig | None = None, update_cfg: UpdateConfig | None = None,
                 loss_fn=cross_entropy, device_clock: Clock | None = None, reduce_dtype: torch.dtype = torch.float32,
                 accumulate: int = 1):
        """`settings`: [parallel.ddp] (DdpConfig, spec.py), its defaults where None."""
        settings = settings or DdpConfig()
        self.model, self.topo, self.device, self.loss_fn = model, topo, device, loss_fn
        self.accumulate = accumulate   # micro-steps per update: all-reduced once, after the last
        self.global_counted: int | None = None   # the step's counted targets over the global batch (engine/training/loss.py)
        self.reduce_dtype = reduce_dtype   # bf16 gradients are widened to it for the all-reduce (fp32)
        clock = device_clock or Clock(device.torch_device)
        self.times = StepTimes(clock, ("fwd_ms", "bwd_ms", "after_backward_ms", "compute_ms"))
        ids = [device.torch_device.index] if device.kind == "cuda" else None
        # DDP broadcasts rank 0's parameters here, so every rank starts from the same weights. With
        # gradients as views into DDP's buckets, a bucket's gradients are final when its all-reduce is.
        # Host updates start when their bucket's all-reduce completes: with updates on the host, buckets
        # of about one layer (1 MiB) let them start layer by layer; all on the device, DDP's default.
        update_cfg = update_cfg or UpdateConfig()
        bucket_mb = 25.0 if update_cfg.placement == "device" else 1.0
        # A world of one has nothing to all-reduce: no DDP wrapper (its buckets, the copy into them, its
        # forward's buffer sync), each gradient final once autograd has accumulated it, as in a plain loop.
        self.solo = topo.compute.size() == 1
        # only rank 0's record says its streams; nothing reads a DDP meter's last completion: other ranks mark nothing
        self.meter = CommMeter(clock, busy=topo.is_first, last=False)
        self._last_micro = True   # solo: this micro-step's gradients are the step's (the hooks dispatch them)
        if self.solo:
            self.ddp = model
        else:
            self.ddp = DistributedDataParallel(model, device_ids=ids, process_group=topo.compute,
                                               gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb,
                                               find_unused_parameters=settings.find_unused_parameters)
            self.ddp.register_comm_hook(topo.compute, self._metered_allreduce)
        # each layer's update, on the device or the host, dispatched as its bucket's all-reduce completes
        # with clipping, host updates speculate and device ones wait for the norm (they run inline either way)
        # solo: a gradient is no view into a bucket, so a device update frees it as the plain loop's
        # zero_grad(set_to_none=True) does; the ledger counts each gradient from its accumulation to its release
        self.grads = FreedGradients(device.ledger)
        self.updater = LayerUpdates(model, params_by_layer(model), optim_cfg, device, update_cfg,
                                    speculate_device=False, release_grads=self.grads.released if self.solo else None)
        self.optimizer = self.updater   # what the ledger counts: device-side optimizer state
        self._params = list(model.parameters())
        # device updates run inline on the compute thread, during backward, as their buckets' all-reduce lands
        # (solo: as each gradient is accumulated, while some update runs on the host: _solo_hooks)
        self._hooks: list = []
        if not self.solo:
            for p in self._params:
                p.register_post_accumulate_grad_hook(lambda _p: self.updater.run_device_ready())
        self.timings = {"fwd_ms": 0.0, "bwd_ms": 0.0, "optim_ms": 0.0}
        # This rank's own compute ends with the last gradient autograd computes, the first layer's; after
        # that, backward() only waits for the all-reduce of the last buckets, which waits for the slowest
        # rank. compute_ms leaves that wait out, so a straggler stands out from the peers that wait for it.
        # (solo: no peer to wait for, backward is all its own)
        self._grads_done = None
        first = next((layer for layer in getattr(model, "layers", [model]) if any(True for _ in layer.parameters())),
                     None)
        for p in first.parameters() if first is not None and not self.solo else ():
            p.register_post_accumulate_grad_hook(self._gradient_done)

    def _solo_hooks(self) -> bool:
        """solo: a hook on every parameter (its gradient dispatches its layer's update as it is accumulated) while
        some update runs on the host, whose overlap with the rest of backward is what the host placement is for;
        with every update on the device they run after backward, as a plain loop's optimizer step does (a hook
        per parameter cost the backward 6% at `trainyard bench step`'s host-bound size). True: hooked."""
        want = any(u.side == "host" for u in self.updater.updates.values())
        if want and not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._solo_gradient) for p in self._params]
        elif not want and self._hooks:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
        return want

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.ddp(x)
        except RuntimeError as e:   # torch's DDP, after a step where some parameter got no gradient
            if "Expected to have finished reduction" not in str(e):
                raise
            raise Refused(UNUSED_PARAMETERS) from None

    def _solo_gradient(self, param) -> None:
        self.grads.made((param,))   # a new gradient: on the ledger
        if self._last_micro:   # final: its layer's update runs once the layer's last one is
            self.updater.params_reduced((param,))
            self.updater.run_device_ready()

    def _gradient_done(self, _param) -> None:
        self._grads_done = self.times.clock.mark()

    def _metered_allreduce(self, group, bucket):
        buffer = bucket.buffer()
        if buffer.dtype == self.reduce_dtype or not buffer.is_floating_point():
            t0 = self.meter.started(buffer.numel() * buffer.element_size())
            future = default_hooks.allreduce_hook(group, bucket)
        else:   # bf16 gradients summed in fp32 (precision.reduce): widened, summed, stored back as bf16
            wide = buffer.to(self.reduce_dtype).div_(group.size())
            t0 = self.meter.started(wide.numel() * wide.element_size())
            future = dist.all_reduce(wide, group=group, async_op=True).get_future().then(
                lambda fut: buffer.copy_(fut.value()[0]))

        def done(fut):
            self.meter.finished(t0)
            self.updater.params_reduced(bucket.parameters())
            return fut.value()[0] if isinstance(fut.value(), list) else fut.value()
        return future.then(done)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x.to(self.device.torch_device), y.to(self.device.torch_device)
        self.updater.begin_step()   # gradients were zeroed (solo: freed) by the updates that used them
        hooked = self.solo and self._solo_hooks()
        if self.solo:   # gradients kept from the last step (a skipped one's, a guarded update's) are counted
            self.grads.begin(self._params)
        times = self.times
        self._grads_done = None
        t0 = times.mark()
        micro = micro_steps(x, y, self.accumulate)
        losses = []
        # each micro-step's saved activations: counted tensor by tensor until a micro-step of this shape is
        # known, then booked at once (no hook on every saved tensor) while every layer keeps them
        with self.device.ledger.by_units(("micro-step", tuple(x.shape), len(micro))) as units:
            for k, (xk, yk) in enumerate(micro):   # the all-reduce only in the last micro-step's backward
                self._last_micro = k == len(micro) - 1
                with self.ddp.no_sync() if not self._last_micro and not self.solo else contextlib.nullcontext():
                    ta = times.mark()
                    units.forward_begin()
                    loss = share_loss(self.loss_fn, self._forward(xk), yk, self.global_counted, self.topo.world_size,
                                      len(micro))
                    units.forward_end()
                    t1 = times.mark()
                    loss.backward()
                    if self.solo and not hooked and self._last_micro:   # every gradient is alive at once now
                        self.device.ledger.note_transient(self.grads.uncounted(self._params))
                    units.backward_end()
                    times.add("fwd_ms", ta, t1)
                    times.add("bwd_ms", t1, times.mark())
                losses.append(loss.detach())
        t2 = times.mark()
        self.updater.end_backward()
        self.updater.validate()   # clipping, skipping: ranks hold the same gradients, so each decides alike
        times.add("compute_ms", t0, self._grads_done if self._grads_done is not None else t2)
        times.add("after_backward_ms", t2, times.mark())
        value = step_value(losses)   # waits for the step's work: its marks are read without a synchronize
        hybrid = self.updater.timings()
        self.timings = {**times.end_step(), "optim_ms": hybrid["update_device_ms"], **hybrid}
        self.device.ledger.refresh()
        return value

    def stream_stats(self, step_ms: float) -> list[dict]:
        return [stream_entry(0, self.meter.take(), step_ms)]

    def layout(self) -> dict:
        return {"strategy": self.name}

    # --- checkpoints: ranks hold equal copies, rank 0 writes them ---------------------------
    def weights(self, copy: bool = True) -> dict[str, torch.Tensor]:
        self.sync()   # the weights as the updates keep them: fp32 masters under bf16 working weights
        return self.updater.weights_state(self.model, copy)

    def checkpoint_state(self) -> tuple[dict, dict]:
        return super().checkpoint_state() if self.topo.is_first else ({}, {})
