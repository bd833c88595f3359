"""Swapping as on a GPU (engine/techniques/memory/stream_swap.py), proven on the CPU with a stand-in for
the CUDA copy calls: a copy happens only when its event completes, and until then its destination
holds garbage, so a storage used before its copy landed shows in the gradients.

The stand-in lands copies in the order each side stream queued them: when the test's schedule says
so (`done` queried), when the host blocks on one, or when the compute stream waits for one (`use`).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import MemoryConfig
from engine.training.data import batch_for
from engine.models import build_model
from engine.runtime.devices import LedgerDevice
from engine.training.loss import cross_entropy
from engine.techniques.memory import ActivationPolicy, StreamLink, StreamSwapper
from test_memory import ZOO, one_step, setup

GARBAGE = 0xAB


class FakeEvent:
    def __init__(self, direction: str, src: torch.Tensor, dst: torch.Tensor):
        self.direction, self.src, self.dst, self.landed = direction, src, dst, False


class FakeCopies:
    """CudaCopies' methods on the CPU. `schedule` says whether a copy lands when `done` asks: "never"
    (only when waited for), "always", or "random"."""

    pinned = False

    def __init__(self, schedule: str = "never", seed: int = 0):
        self.schedule, self.rng = schedule, random.Random(seed)
        self.queued = {"out": [], "in": []}
        self.calls = {"copy-out": 0, "copy-in": 0, "block": 0, "use": 0, "use-unlanded": 0}

    def copy(self, direction: str, src: torch.Tensor, dst: torch.Tensor | None = None):
        dst = torch.empty(src.numel(), dtype=torch.uint8) if dst is None else dst
        dst.fill_(GARBAGE)
        event = FakeEvent(direction, src, dst)
        self.queued[direction].append(event)
        self.calls[f"copy-{direction}"] += 1
        return dst, event

    def _land(self, event: FakeEvent) -> None:
        """The side stream runs in order: `event`'s copy and every one queued before it land."""
        queue = self.queued[event.direction]
        while not event.landed:
            first = queue.pop(0)
            first.dst.copy_(first.src)
            first.landed = True

    def done(self, event: FakeEvent) -> bool:
        if not event.landed and (self.schedule == "always" or (self.schedule == "random" and self.rng.random() < 0.5)):
            self._land(event)
        return event.landed

    def block(self, event: FakeEvent) -> None:
        self.calls["block"] += 1
        self._land(event)

    def use(self, event: FakeEvent, tensor: torch.Tensor) -> None:
        self.calls["use"] += 1
        self.calls["use-unlanded"] += not event.landed
        self._land(event)   # the compute stream runs nothing after this until the copy has landed

    def land_all(self) -> None:
        for queue in self.queued.values():
            if queue:
                self._land(queue[-1])


def stream_step(zoo: str, policy, copies: FakeCopies, capacity: int = 1 << 30, device_type: str | None = None) -> dict:
    """One forward+backward of a zoo model under `policy`, swapping through `copies`; `device_type`: the kind
    of device the ledger counts (None: everything saved)."""
    cfg, data = setup(zoo)
    model = build_model(cfg.model, data.meta, 0)
    device = LedgerDevice(capacity)
    device.ledger.device_type = device_type
    device.ledger.track_module(model)
    policies = ActivationPolicy(model, device, MemoryConfig(policy=policy, host_link_gbps=5.0), copies=copies)
    swapper = policies.swapper
    assert isinstance(swapper, StreamSwapper) and isinstance(policies.link, StreamLink)
    x, y = batch_for(data, 0, cfg.data.batch_size, 0)
    torch.manual_seed(3)   # the dropout masks, as one_step draws them
    with device.ledger.saved_activations():
        loss = cross_entropy(model(x), y)
        after_forward = {"bytes": dict(device.ledger.bytes), "calls": dict(copies.calls),
                         "pending_out": swapper.pending_out}
        loss.backward()
    del loss
    copies.land_all()   # the streams drain (on a GPU: the next synchronize)
    swapper.reap()
    out = {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}, "forward": after_forward,
           "end": dict(device.ledger.bytes), "peak": device.ledger.peak_bytes, "names": model.names,
           "calls": dict(copies.calls), "pool": policies.link.pool, "swapper": swapper,
           "capacity": capacity, "over": device.ledger.over_capacity}
    policies.close()
    return out


@pytest.mark.parametrize("schedule", ["never", "always", "random"])
@pytest.mark.parametrize("zoo", sorted(ZOO))
def test_gradients_equal_keep_however_the_copies_land(zoo, schedule):
    keep = one_step(zoo, "keep")
    mixed = {n: ("swap", "keep", "recompute")[i % 3] for i, n in enumerate(keep["names"])}
    for policy in ("swap", mixed):
        got = stream_step(zoo, policy, FakeCopies(schedule, seed=len(zoo)))
        for name, g in keep["grads"].items():
            assert torch.equal(got["grads"][name], g), (zoo, schedule, policy, name)
        assert got["end"]["activations"] == 0 and got["end"]["swapped"] == 0, got["end"]
        swapper = got["swapper"]
        assert swapper.pending_out == 0 and not swapper._outbound and not swapper._settling
        # a stall is an unpack whose copy in had not landed: the compute stream waited for it
        assert swapper.stalls == got["calls"]["use-unlanded"], (zoo, schedule, policy)
        # every host buffer is back in the pool once its copies have landed
        pool = got["pool"]
        assert sum(len(v) for v in pool._free.values()) == pool.made


def test_the_forward_queues_each_copy_out_and_never_waits_for_one():
    got = stream_step("transformer", "swap", FakeCopies("never"))
    forward = got["forward"]
    assert forward["calls"]["copy-out"] > 0 and forward["calls"]["block"] == 0
    # nothing landed during the forward: every swapped storage is still held on the device, in flight
    assert forward["bytes"]["swapped"] == 0 and forward["pending_out"] > 0.9 * forward["bytes"]["activations"]


def test_a_storage_wanted_back_before_its_copy_out_landed_never_crosses_the_link_again():
    got = stream_step("transformer", "swap", FakeCopies("never"))
    # no copy out landed before backward wanted it: each device copy was kept, none came back in
    assert got["calls"]["copy-in"] == 0
    landed = stream_step("transformer", "swap", FakeCopies("always"))
    assert landed["calls"]["copy-in"] == landed["calls"]["copy-out"] > 0


def test_backpressure_blocks_on_the_oldest_copy_and_keeps_the_ledger_under_the_capacity():
    keep = one_step("transformer", "keep")
    base = keep["peak"] - keep["forward"]["activations"]
    capacity = base + keep["forward"]["activations"] // 3
    got = stream_step("transformer", "swap", FakeCopies("never"), capacity=capacity)
    for name, g in keep["grads"].items():
        assert torch.equal(got["grads"][name], g), name
    assert got["calls"]["block"] > 0   # the forward waited for copies out to make room
    assert got["calls"]["copy-in"] > 0   # storages that had left came back over the link
    assert not got["over"], (got["peak"], capacity)


def test_a_storage_freed_while_its_copy_runs_keeps_its_buffers_until_the_copy_lands():
    device = LedgerDevice(1 << 30)
    copies = FakeCopies("never")
    link = StreamLink(torch.device("cpu"), copies)
    swapper = device.ledger.swapper = StreamSwapper(device.ledger, link)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    swapper.group = []
    with device.ledger.saved_activations():
        y = torch.tanh(x @ w)   # the matmul saves x, tanh its output: two storages swapped
        entries = list(swapper.group)
        assert copies.calls["copy-out"] == len(entries) == 2 and swapper.pending_out > 0
        del y   # freed before the copies out landed
        for entry in entries:
            assert entry.state == "dead" and entry.host_buf is not None and entry.device_buf is not None
        assert link.pool.made == 2 and not link.pool._free   # the copies still write the host buffers
        copies.land_all()
        swapper.reap()
        assert sum(map(len, link.pool._free.values())) == 2
        assert all(e.host_buf is None and e.device_buf is None for e in entries)
    assert device.ledger.bytes["activations"] == 0 and device.ledger.bytes["swapped"] == 0


def test_what_autograd_saves_off_the_device_is_neither_counted_nor_swapped():
    """On a GPU an attention kernel with dropout saves its RNG seed and offset on the host. Swapped, they came
    back on the GPU, and the kernel's backward read a device address as a host pointer: a segfault (seen on an
    H200 in tests/test_on_cuda.py). The ledger passes through what is not on its device: here it counts a GPU's
    memory, and everything this CPU model saves is on the host."""
    keep = stream_step("transformer", "swap", FakeCopies("always"))   # the gradients of keep (tests above)
    got = stream_step("transformer", "swap", FakeCopies(), device_type="cuda")
    assert got["calls"]["copy-out"] == 0 and got["forward"]["bytes"]["activations"] == 0
    assert got["swapper"].out_bytes == 0 and got["forward"]["bytes"]["swapped"] == 0
    for name, g in keep["grads"].items():
        assert torch.equal(got["grads"][name], g), name
