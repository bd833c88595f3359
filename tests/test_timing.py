"""Measured times are the device's, not the host's (engine/timing.py). On a GPU a layer's kernels run
after its Python returns, so the planners read CUDA events; here a stand-in GPU runs "kernels" that
take a scripted time on its own clock, and its events, like CUDA's, can be read only once complete.
Every plan input (the activation plan's layer times, the profiler's rows, a device update's time)
must equal the scripted GPU times, while the host spends next to nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import MemoryConfig, OptimConfig
from engine.models.layers import LayerList
from engine.runtime.devices import LedgerDevice
from engine.runtime.profiler import LayerProfiler
from engine.techniques.layer_update import LayerUpdate
from engine.techniques.memory import ActivationPolicy
from engine.timing import Clock
from test_stream_swap import FakeCopies


class FakeGPU:
    """A device clock: a kernel advances it; an event stamps it when recorded and is complete once
    synchronized (reading an incomplete one is CUDA's error)."""

    def __init__(self):
        self.now = 0.0

    def event(self):
        gpu = self

        class Event:
            def __init__(self):
                self.at, self.complete = None, False

            def record(self, stream=None):
                self.at = gpu.now

            def synchronize(self):
                self.complete = True

            def elapsed_time(self, end) -> float:
                if not (self.complete or end.complete) or end.at is None:
                    raise RuntimeError("Both events must be completed before calculating elapsed time.")
                return end.at - self.at
        return Event()


class Kernel(torch.autograd.Function):
    """Identity whose forward and backward take `fwd_ms` and `bwd_ms` of GPU time."""

    @staticmethod
    def forward(ctx, x, gpu, fwd_ms, bwd_ms):
        gpu.now += fwd_ms
        ctx.gpu, ctx.bwd_ms = gpu, bwd_ms
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.gpu.now += ctx.bwd_ms
        return grad, None, None, None


class Timed(nn.Module):
    def __init__(self, gpu: FakeGPU, fwd_ms: float, bwd_ms: float):
        super().__init__()
        self.gpu, self.fwd_ms, self.bwd_ms = gpu, fwd_ms, bwd_ms
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return Kernel.apply(self.linear(x), self.gpu, self.fwd_ms, self.bwd_ms)


SCRIPT = {"a": (3.0, 7.0), "b": (5.0, 11.0), "c": (2.0, 13.0)}   # layer: (forward ms, backward ms)


def model_on(gpu: FakeGPU) -> LayerList:
    torch.manual_seed(0)
    return LayerList([(name, Timed(gpu, *ms)) for name, ms in SCRIPT.items()])


def test_the_activation_plan_reads_the_devices_times():
    gpu = FakeGPU()
    model = model_on(gpu)
    device = LedgerDevice(1 << 30)
    device.ledger.track_module(model)
    # auto swaps every layer in its measured step: through copies as on a GPU, where the host never waits
    policy = ActivationPolicy(model, device, MemoryConfig(policy="auto", host_link_gbps=5.0),
                              copies=FakeCopies("always"), clock=Clock(events=gpu.event))
    x = torch.randn(8, 4, requires_grad=True)
    for step in range(2):   # the first step is not measured; the second is, and a plan follows
        policy.before_step(step)
        with device.ledger.saved_activations():
            model(x).sum().backward()
        policy.after_step(step)
    policy.close()
    assert policy.plan is not None
    for name, (fwd, bwd) in SCRIPT.items():
        cost = policy.known[name]
        assert cost.fwd_ms == pytest.approx(fwd) and cost.bwd_ms == pytest.approx(bwd), (name, cost)


class StallingCopies(FakeCopies):
    """Copies out land as soon as asked about, copies in only when the compute stream waits for them,
    and that wait costs the fake GPU `STALL_MS`: a link too slow for its prefetches."""

    STALL_MS = 50.0

    def __init__(self, gpu: FakeGPU):
        super().__init__("never")
        self.gpu = gpu

    def done(self, event) -> bool:
        if event.direction == "out" and not event.landed:
            self._land(event)
        return event.landed

    def use(self, event, tensor) -> None:
        if not event.landed:
            self.gpu.now += self.STALL_MS
        super().use(event, tensor)


def test_a_layers_backward_leaves_out_the_compute_streams_waits_for_the_link():
    gpu = FakeGPU()
    model = model_on(gpu)
    device = LedgerDevice(1 << 30)
    device.ledger.track_module(model)
    copies = StallingCopies(gpu)
    policy = ActivationPolicy(model, device, MemoryConfig(policy="auto", host_link_gbps=5.0),
                              copies=copies, clock=Clock(events=gpu.event))
    x = torch.randn(8, 4, requires_grad=True)
    for step in range(2):
        policy.before_step(step)
        with device.ledger.saved_activations():
            model(x).sum().backward()
        policy.after_step(step)
    swapper = policy.swapper
    policy.close()
    assert swapper.stalls > 0 and copies.calls["use-unlanded"] == swapper.stalls
    for name, (fwd, bwd) in SCRIPT.items():
        cost = policy.known[name]
        assert cost.fwd_ms == pytest.approx(fwd) and cost.bwd_ms == pytest.approx(bwd), (name, cost)


def test_the_profilers_rows_are_the_devices_times():
    gpu = FakeGPU()
    model = model_on(gpu)
    device = LedgerDevice(1 << 30)
    profiler = LayerProfiler(model, device.ledger, Clock(events=gpu.event))
    profiler.arm()
    with device.ledger.saved_activations():
        model(torch.randn(8, 4, requires_grad=True)).sum().backward()
    rows = {r["name"]: r for r in profiler.finish()}
    profiler.remove()
    # a layer's backward runs from its output's gradient to the one before it: its own and, for the
    # first layer, the rest of backward (here nothing)
    for name, (fwd, bwd) in SCRIPT.items():
        assert rows[name]["fwd_ms"] == pytest.approx(fwd) and rows[name]["bwd_ms"] == pytest.approx(bwd), rows[name]


def test_a_device_updates_time_is_the_devices():
    gpu = FakeGPU()
    layer = nn.Linear(4, 4)
    update = LayerUpdate("a", 0, list(layer.parameters()), OptimConfig(name="adamw", lr=0.01))
    update.clock = Clock(events=gpu.event)
    update.optimizer.register_step_pre_hook(lambda opt, args, kwargs: setattr(gpu, "now", gpu.now + 4.5))
    layer(torch.randn(2, 4)).sum().backward()
    update.step_device()
    assert update.device_ms == pytest.approx(4.5)


def test_the_cpu_clock_is_the_hosts():
    clock = Clock(torch.device("cpu"))
    assert not clock.on_device
    a = clock.mark()
    b = clock.mark()
    assert 0 <= clock.ms(a, b) < 1000
