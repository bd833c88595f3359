"""Measured times are the device's, not the host's (engine/training/timing.py). On a GPU a layer's kernels run
after its Python returns, so the planners read CUDA events; here a stand-in GPU runs "kernels" that
take a scripted time on its own clock, and its events, like CUDA's, can be read only once complete.
Every plan input (the activation plan's layer times, the profiler's rows, a device update's time)
must equal the scripted GPU times, while the host spends next to nothing; so must every strategy's
per-step times (ddp, sharded, a pipeline's stages, a parameter-server worker's rows), with the time the
host spends waiting for a neighbour left out of forward and backward."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine.training.loss import cross_entropy
from engine.config import Config, MemoryConfig, OptimConfig, PipelineConfig, ShardedConfig
from engine.models.layers import LayerList
from engine.runtime.control import FIELDS
from engine.runtime.devices import LedgerDevice
from engine.processes.procpool import DistPool
from engine.runtime.profiler import LayerProfiler
from engine.runtime.meter import CommMeter
from engine.techniques.updates.layer import LayerUpdate
from engine.techniques.memory import ActivationPolicy
from engine.training.timing import Clock, StepTimes
from test_stream_swap import FakeCopies


class FakeGPU:
    """A device clock: a kernel advances it (by its time times `scale`, so that steps differ); an event
    stamps it when recorded. Events run in the order recorded, as on one stream: synchronizing one
    completes it and every one before it, and so does `run()` (the device caught up). `eager`: events
    complete as they are recorded, a device never behind the host (as once the host has read a result
    of the step). Reading an incomplete one is CUDA's error."""

    def __init__(self, eager: bool = False):
        self.now, self.scale, self.eager = 0.0, 1.0, eager
        self.recorded = 0   # events recorded so far
        self.ran = 0        # the first `ran` of them have run
        self._lock = threading.Lock()   # backends' threads record too (a communication hook's completion)

    def run(self) -> None:
        self.ran = self.recorded

    def event(self):
        gpu = self

        class Event:
            def __init__(self):
                self.at, self.seq = None, None

            def record(self, stream=None):
                with gpu._lock:
                    gpu.recorded += 1
                    self.at, self.seq = gpu.now, gpu.recorded
                    if gpu.eager:
                        gpu.ran = gpu.recorded

            @property
            def complete(self) -> bool:
                return self.seq is not None and self.seq <= gpu.ran

            def query(self) -> bool:
                return self.complete

            def synchronize(self):
                gpu.ran = max(gpu.ran, self.seq)

            def elapsed_time(self, end) -> float:
                if not (self.complete and end.complete):
                    raise RuntimeError("Both events must be completed before calculating elapsed time.")
                return end.at - self.at
        return Event()


class Kernel(torch.autograd.Function):
    """Identity whose forward and backward take `fwd_ms` and `bwd_ms` of GPU time (times its scale)."""

    @staticmethod
    def forward(ctx, x, gpu, fwd_ms, bwd_ms):
        gpu.now += fwd_ms * gpu.scale
        ctx.gpu, ctx.bwd_ms = gpu, bwd_ms
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.gpu.now += ctx.bwd_ms * ctx.gpu.scale
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


def test_the_pipelines_layer_clock_reads_the_devices_times():
    """The rebalance plans with these: on a GPU, each layer's kernels' time, not the time to queue them."""
    from engine.strategies.pipeline.rebalance import LayerClock
    gpu = FakeGPU()
    model = model_on(gpu)
    clock = LayerClock(model.names, Clock(events=gpu.event))
    for _ in range(2):
        out = clock.forward(model.layers, 0, len(model.names), torch.randn(8, 4, requires_grad=True))
        clock.backward(out.sum())
        clock.end_step()
    ms, _ = clock.take()   # per step: each layer's scripted forward + backward, nothing of the host's time
    assert ms == pytest.approx([SCRIPT[name][0] + SCRIPT[name][1] for name in model.names])


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


def test_one_per_layer_timer_marks_for_the_profiler_the_layer_clock_and_the_activation_plan():
    """The console's layer table, the rebalance and the memory plan read per-layer times from one mechanism
    (LayerSpans): the same layers on the same device give each the same forward times."""
    from engine.techniques.memory.measure import Measure
    from engine.strategies.pipeline.rebalance import LayerClock
    from engine.training.timing import LayerSpans
    gpu = FakeGPU()
    model = model_on(gpu)
    device = LedgerDevice(1 << 30)
    profiler = LayerProfiler(model, device.ledger, Clock(events=gpu.event))
    layer_clock = LayerClock(model.names, Clock(events=gpu.event))
    measure = Measure(Clock(events=gpu.event))
    assert all(isinstance(t.spans, LayerSpans) for t in (profiler, layer_clock, measure))
    profiler.arm()
    layer_clock.backward(layer_clock.forward(model.layers, 0, len(model.names), torch.randn(8, 4)).sum())
    layer_clock.end_step()
    for name, layer in zip(model.names, model.layers):
        t0 = measure.clock.mark()
        layer(torch.randn(8, 4))
        measure.forward_ran(name, t0, 0.0, ())
    profiler.remove()
    fwd_ms, _, calls, _ = measure.spans.read()
    for i, (name, (fwd, bwd)) in enumerate(SCRIPT.items()):
        assert fwd_ms[name] == pytest.approx(fwd) and calls[name] == 1
        assert layer_clock.fwd_ms[i] == pytest.approx(fwd) and layer_clock.bwd_ms[i] == pytest.approx(bwd)


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


# --- the strategies' per-step times -----------------------------------------------------------------

def test_step_times_are_the_steps_own_once_its_work_has_run_else_the_step_befores():
    gpu = FakeGPU()
    times = StepTimes(Clock(events=gpu.event), ("fwd_ms", "bwd_ms"))

    def step(fwd_ms: float, bwd_ms: float) -> list:
        a = times.mark()
        gpu.now += fwd_ms
        b = times.mark()
        gpu.now += bwd_ms
        times.add("fwd_ms", a, b)
        times.add("bwd_ms", b, times.mark())
        return [a, b]

    step(3.0, 7.0)
    assert times.end_step() == {"fwd_ms": 0.0, "bwd_ms": 0.0}   # not run yet, and nothing waited for
    assert gpu.ran == 0
    marks = step(5.0, 11.0)
    # the step before is read (its last mark waited for: a step old), the step just queued never
    assert times.end_step() == {"fwd_ms": 3.0, "bwd_ms": 7.0}
    assert not any(m.complete for m in marks)
    step(2.0, 13.0)
    gpu.run()   # the host read a result of the step: every step queued so far has run
    assert times.end_step() == {"fwd_ms": 2.0, "bwd_ms": 13.0}
    # spans of a name add up; begin_step forgets what was marked outside a step
    times.add("fwd_ms", times.mark(), times.mark())
    times.begin_step()
    a = times.mark()
    gpu.now += 1.5
    times.add("fwd_ms", a, times.mark())
    a = times.mark()
    gpu.now += 2.5
    times.add("fwd_ms", a, times.mark())
    gpu.run()
    assert times.end_step() == {"fwd_ms": 4.0, "bwd_ms": 0.0}


def test_step_times_on_the_cpu_are_the_steps_own_exactly():
    times = StepTimes(Clock(torch.device("cpu")), ("fwd_ms",))
    for _ in range(2):
        a = times.mark()
        time.sleep(0.002)
        b = times.mark()
        times.add("fwd_ms", a, b)
        assert times.end_step() == {"fwd_ms": (b - a) * 1000}


def test_the_stream_meter_counts_what_ran_on_the_device_and_never_waits():
    gpu = FakeGPU()
    meter = CommMeter(Clock(events=gpu.event))
    t0 = meter.started(100)
    gpu.now += 4.0
    t1 = meter.started(50)
    gpu.now += 6.0
    meter.finished(t0)   # [0, 10]
    gpu.now += 5.0
    meter.finished(t1)   # [4, 15]
    taken = meter.take()
    assert taken == {"bytes": 150, "busy_ms": 0.0, "in_flight": 0} and gpu.ran == 0
    gpu.run()
    # busy is the union of the two operations' intervals, [0, 15]: their overlap counts once
    assert meter.take() == {"bytes": 0, "busy_ms": 15.0, "in_flight": 0}


def test_a_meter_whose_busy_time_nobody_reads_keeps_no_interval_and_says_none():
    """Every rank but the first makes its meters with busy=False: only rank 0's record says its streams, and an
    interval kept per operation, never taken, grew a rank's memory for the run's life."""
    gpu = FakeGPU()
    meter = CommMeter(Clock(events=gpu.event), busy=False)
    for _ in range(1000):
        t0 = meter.started(100)
        assert meter.in_flight == 1
        gpu.now += 1.0
        meter.finished(t0)
    assert (meter.kept, meter.in_flight, meter.bytes) == (0, 0, 100_000)
    assert meter.last is not None   # the last completion: sharded's broadcast span still reads it
    # bytes still counted (bench broadcast reads every rank's); busy time not measured, so not said to be 0
    assert meter.take() == {"bytes": 100_000, "busy_ms": None, "in_flight": 0}
    assert meter.take()["bytes"] == 0
    read = CommMeter(Clock(events=gpu.event))
    read.finished(read.started(1))
    assert read.kept == 1


def test_a_meter_nobody_reads_at_all_marks_nothing():
    """DDP's meter on every rank but the first: neither its busy time nor its last completion is read, so it makes no
    mark (on a GPU a CUDA event made and recorded at each operation's launch and completion)."""
    gpu = FakeGPU()
    meter = CommMeter(Clock(events=gpu.event), busy=False, last=False)
    for _ in range(100):
        t0 = meter.started(100)
        meter.finished(t0)
    assert (gpu.recorded, meter.last, meter.bytes, meter.in_flight) == (0, None, 10_000, 0)
    assert meter.take() == {"bytes": 10_000, "busy_ms": None, "in_flight": 0}
    sharded = CommMeter(Clock(events=gpu.event), busy=False)   # its last completion is read on every rank
    sharded.finished(sharded.started(1))
    assert gpu.recorded == 2 and sharded.last is not None


def run_steps(gpu: FakeGPU, strategy, steps: int, batch: int = 8) -> list[dict]:
    """`steps` steps of `strategy` on the fake GPU, step k's kernels taking (k + 1) times their script."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 4, generator=gen), torch.randint(0, 4, (batch,), generator=gen)
    out = []
    for k in range(steps):
        gpu.scale = k + 1.0
        strategy.train_step(x, y)
        out.append(dict(strategy.timings))
    return out


def ledger_device(model) -> LedgerDevice:
    device = LedgerDevice(1 << 30)
    device.ledger.track_module(model)
    return device


WAIT_MS = 100.0   # what the device's clock moves on while the host waits for a neighbour
UPDATE_MS = 4.5   # a layer's device update


def ddp_job(topo, steps: int) -> list[dict]:
    from engine.strategies.ddp import DDPStrategy
    gpu = FakeGPU(eager=True)   # the step's loss is read: its work has run by the step's end
    model = model_on(gpu)
    device = ledger_device(model)
    strategy = DDPStrategy(model, OptimConfig(name="sgd", lr=0.01), topo, device, device_clock=Clock(events=gpu.event))
    try:
        return run_steps(gpu, strategy, steps)
    finally:
        strategy.close()


def sharded_job(topo, steps: int) -> list[dict]:
    from engine.strategies.sharded import ShardedStrategy
    gpu = FakeGPU(eager=True)
    model = model_on(gpu)
    device = ledger_device(model)
    strategy = ShardedStrategy(model, OptimConfig(name="sgd", lr=0.01), topo, device, ShardedConfig(streams=2, slices=2),
                               device_clock=Clock(events=gpu.event))
    wait, landed = strategy._wait, set()

    def waiting(i: int) -> None:   # the compute stream waits for a slice's broadcast: its clock moves on
        work = strategy._works[i]
        if work not in landed:     # once: a broadcast that has landed is not waited for again
            landed.add(work)
            gpu.now += WAIT_MS
        wait(i)
    strategy._wait = waiting
    try:
        return [{**t, "slices": len(strategy.plan)} for t in run_steps(gpu, strategy, steps)]
    finally:
        strategy.close()


def pipeline_job(topo, steps: int) -> list[dict]:
    from engine.strategies.pipeline import PipelineStage
    # the last stage reads its loss (its work has run by the step's end); the first reads nothing of its own
    gpu = FakeGPU(eager=topo.rank == 1)
    model = model_on(gpu)
    device = LedgerDevice(1 << 30)
    stage = PipelineStage(model, [["a"], ["b", "c"]], topo, device, OptimConfig(name="sgd", lr=0.01),
                          PipelineConfig(micro_batches=2, schedule="1f1b", rebalance="off"),
                          device_clock=Clock(events=gpu.event))
    device.ledger.track_module(stage.ledger_module, stage.optimizer)
    for u in stage.updater.updates.values():
        u.optimizer.register_step_pre_hook(lambda opt, args, kwargs: setattr(gpu, "now", gpu.now + UPDATE_MS * gpu.scale))
    recv = stage.wire.recv

    def waiting(*args, **kwargs):   # the neighbour is late: the device's clock moves on meanwhile
        gpu.now += WAIT_MS
        return recv(*args, **kwargs)
    stage.wire.recv = waiting
    try:
        return run_steps(gpu, stage, steps)
    finally:
        stage.close()


@pytest.fixture(scope="module")
def pool2():
    with DistPool(2, timeout_s=30) as p:
        yield p


def _scripted(names, scale: float) -> tuple[float, float]:
    return (sum(SCRIPT[n][0] for n in names) * scale, sum(SCRIPT[n][1] for n in names) * scale)


@pytest.mark.timeout(120)
def test_ddps_step_times_are_the_devices(pool2):
    for rank_times in pool2.run(ddp_job, timeout=60, steps=3):
        for k, t in enumerate(rank_times):
            fwd, bwd = _scripted(SCRIPT, k + 1)
            assert t["fwd_ms"] == pytest.approx(fwd) and t["bwd_ms"] == pytest.approx(bwd), (k, t)
            assert t["after_backward_ms"] == 0.0, t   # the host's dispatching: no device work


@pytest.mark.timeout(120)
def test_sharded_step_times_are_the_devices_with_the_gates_in_the_forward(pool2):
    for rank_times in pool2.run(sharded_job, timeout=60, steps=3):
        for k, t in enumerate(rank_times):
            fwd, bwd = _scripted(SCRIPT, k + 1)
            # each slice waited for once, at the first layer needing it; the first step's weights are there already
            gate = 0.0 if k == 0 else WAIT_MS * t["slices"]
            assert t["gate_ms"] == pytest.approx(gate), (k, t)
            assert t["fwd_ms"] == pytest.approx(fwd + gate) and t["bwd_ms"] == pytest.approx(bwd), (k, t)
            # the host's sends, sums and updates: real work on the CPU, none on the scripted device
            assert t["reduce_ms"] == 0.0 and t["optim_ms"] == 0.0 and t["broadcast_wait_ms"] == 0.0, (k, t)


@pytest.mark.timeout(120)
def test_a_pipelines_stage_times_are_the_devices_without_its_waits_for_neighbours(pool2):
    first, last = pool2.run(pipeline_job, timeout=60, steps=3)
    micro = 2
    for stage, layers, updates, rank_times, late in ((0, ["a"], 1, first, 1), (1, ["b", "c"], 2, last, 0)):
        for k, t in enumerate(rank_times):
            assert t["recv_wait_ms"] != pytest.approx(micro * WAIT_MS, abs=1e-6), t   # host time, not the device's
            if k - late < 0:   # the first stage reports a step late: nothing before its first step
                assert (t["fwd_ms"], t["bwd_ms"], t["optim_ms"]) == (0.0, 0.0, 0.0), (stage, k, t)
                continue
            fwd, bwd = _scripted(layers, k - late + 1)
            assert t["fwd_ms"] == pytest.approx(micro * fwd) and t["bwd_ms"] == pytest.approx(micro * bwd), \
                (stage, k, t)
            assert t["optim_ms"] == pytest.approx(updates * UPDATE_MS * (k - late + 1)), (stage, k, t)


class FakeLink:
    """A server's link as a worker sees it: sends are kept; a pull's weights arrive after the host
    waited `host_wait_s`, while the device's clock moved on WAIT_MS."""

    def __init__(self, gpu: FakeGPU, params: dict, host_wait_s: float):
        self.gpu, self.params, self.host_wait_s = gpu, params, host_wait_s
        self.sent: list = []

    def send(self, kind, layer=0, version=0, iteration=0, a=0.0, payload=None):
        self.sent.append((kind, iteration, payload))

    def expect(self, tensor, tag):
        from engine.strategies.param_server.links import TAG_WEIGHTS, pack_weights
        link, layer = self, tag - TAG_WEIGHTS

        class Work:
            def wait(self):
                time.sleep(link.host_wait_s)
                link.gpu.now += WAIT_MS
                params = link.params[layer]
                tensor.copy_(pack_weights(params, params[0].dtype, version=0, flags=0))
        return Work()

    def flush(self):
        pass


def test_a_parameter_server_workers_rows_are_the_devices_without_its_waits_for_weights():
    from engine.strategies.param_server.links import BYE, PULL
    from engine.strategies.param_server.setup import layer_params
    from engine.strategies.param_server.worker import PSWorker
    gpu = FakeGPU(eager=True)   # the worker reads its loss: the iteration's work has run by its end
    model = model_on(gpu)
    params = layer_params(model)
    device = ledger_device(model)
    link = FakeLink(gpu, params, host_wait_s=0.003)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 4, (8,), generator=gen)

    def batch(iteration: int, index: int):
        gpu.scale = iteration + 1.0
        return x, y
    iterations = 3
    setup = SimpleNamespace(cfg=Config(), topo=SimpleNamespace(rank=1), servers=1, params=params, model=model,
                            device=device, links={0: link}, owner={j: 0 for j in params}, first_step=0,
                            batch=batch, stop=None, loss_fn=cross_entropy, global_counted=lambda iteration: None,
                            workers=1)
    worker = PSWorker(setup, device_clock=Clock(events=gpu.event))
    setup.stop = type("Stop", (), {"requested": property(lambda self: worker.iteration >= iterations)})()
    worker.run()
    # each iteration's row goes to server 0 with the next pull, the last with the goodbye
    rows = [dict(zip(FIELDS, payload.tolist())) for kind, _, payload in link.sent
            if kind in (PULL, BYE) and payload is not None]
    assert len(rows) == iterations
    for k, row in enumerate(rows):
        fwd, bwd = _scripted(SCRIPT, k + 1)
        assert row["fwd_ms"] == pytest.approx(fwd) and row["bwd_ms"] == pytest.approx(bwd), (k, row)
        # waiting for weights is host time (the host blocked), not the device's, and in the iteration's wall time
        assert row["wait_ms"] >= len(params) * 3.0 and row["step_ms"] >= row["wait_ms"], (k, row)
        assert row["wait_ms"] != pytest.approx(len(params) * WAIT_MS, abs=1e-6), (k, row)
