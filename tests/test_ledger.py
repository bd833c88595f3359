"""The memory ledger: what it counts, when it lets go, and the capacity flag."""

from __future__ import annotations

import torch
import torch.nn as nn

from engine.runtime.devices import LedgerDevice, MemoryLedger, open_device
from engine.training.optim import make_optimizer
from engine.config import OptimConfig


def small_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_parameters_gradients_and_optimizer_state_are_counted():
    model = small_model()
    opt = make_optimizer(OptimConfig(name="adamw"), model.parameters())
    ledger = MemoryLedger(capacity_bytes=1 << 20)
    ledger.track_module(model, opt)
    assert ledger.bytes["parameters"] == param_bytes(model)
    assert ledger.bytes["gradients"] == 0 and ledger.bytes["optimizer_state"] == 0
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    ledger.refresh()
    assert ledger.bytes["gradients"] == param_bytes(model)
    # AdamW keeps two moments per parameter plus a scalar step each
    assert ledger.bytes["optimizer_state"] >= 2 * param_bytes(model)


def test_saved_activations_are_counted_while_alive_and_released_after_backward():
    model = small_model()
    ledger = MemoryLedger(capacity_bytes=1 << 20)
    ledger.track_module(model)
    x = torch.randn(32, 8)
    with ledger.saved_activations():
        out = model(x)
        during = ledger.bytes["activations"]
        out.sum().backward()
    # saved: the input (32x8) and the ReLU's output (32x16), which the ReLU and the second
    # Linear both keep (one storage, counted once); parameters are not activations
    assert during == 4 * (32 * 8 + 32 * 16)
    assert ledger.bytes["activations"] == 0
    assert ledger.peak_bytes >= ledger.bytes["parameters"] + during


def test_uncounted_activations_leave_autograd_alone_and_count_nothing():
    """`count_activations = False` (a bench measuring the hooks' share): no hook runs, gradients unchanged."""
    model = small_model()
    ledger = MemoryLedger(capacity_bytes=1 << 20)
    ledger.track_module(model)
    ledger.count_activations = False
    x = torch.randn(32, 8)
    with ledger.saved_activations():
        model(x).sum().backward()
        assert ledger.bytes["activations"] == 0 and ledger._param_ptrs is None
    uncounted = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ledger.count_activations = True
    with ledger.saved_activations():
        model(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(uncounted, model.parameters()))


def test_a_storage_saved_twice_counts_once():
    ledger = MemoryLedger(capacity_bytes=1 << 20)
    x = torch.randn(100, requires_grad=True)
    with ledger.saved_activations():
        y = x * x          # saves x twice
    assert ledger.bytes["activations"] == 400
    del y
    assert ledger.bytes["activations"] == 0


def test_going_over_capacity_is_flagged_not_hidden():
    model = small_model()
    device = LedgerDevice(capacity_bytes=param_bytes(model) + 100)
    device.ledger.track_module(model)
    assert not device.stats()["over_capacity"]
    with device.ledger.saved_activations():
        model(torch.randn(64, 8)).sum().backward()
    stats = device.stats()
    assert stats["over_capacity"] and stats["peak_bytes"] > stats["capacity_bytes"]
    assert stats["simulated"] is True and stats["kind"] == "cpu"
    assert stats["rss_bytes"] > 0 and "cpu_percent" in stats


def test_auto_picks_the_cpu_ledger_without_gpus():
    device = open_device("auto", 1 << 20, local_rank=0, local_world_size=2)
    if not torch.cuda.is_available():
        assert isinstance(device, LedgerDevice) and device.simulated
        assert "simulated" in device.name


def _counted_ledger():
    """small_model() tracked by a ledger whose saved-tensor hook appends to `hooked` each time it runs."""
    model = small_model()
    ledger = MemoryLedger(capacity_bytes=1 << 20)
    ledger.track_module(model)
    hooked = []
    counting = ledger.pack_tensor
    ledger.pack_tensor = lambda t: hooked.append(1) or counting(t)
    return model, ledger, hooked


def test_a_step_is_booked_at_once_after_two_in_a_row_agree_with_the_same_peak():
    """ledger.by_units as ddp and sharded use it (a micro-step a unit): the hooks count every saved tensor until
    two units in a row saved the same bytes (the first one also saves what is made once), then the unit is
    booked at its forward's end with no hook at all, and every step's peak is the one the hooks gave."""
    model, ledger, hooked = _counted_ledger()
    once = torch.randn(32, 16)   # made in the first step only, and saved by it (as a block's shared inputs)
    peaks, calls = [], []
    for step in range(4):
        ledger.reset_peak()
        hooked.clear()
        with ledger.by_units(("micro-step", (32, 8), 1)) as units:
            units.forward_begin()
            out = model(torch.randn(32, 8))
            if step == 0:
                out = out + (once.requires_grad_() ** 2).sum()   # pow saves `once`
            units.forward_end()
            out.sum().backward()
            units.backward_end()
        peaks.append(ledger.peak_bytes)
        calls.append(len(hooked))
    assert ledger.bytes["activations"] == 0
    assert ledger.unit_bytes(("micro-step", (32, 8), 1)) == 4 * (32 * 8 + 32 * 16)
    assert calls[1] > 0 and calls[2] > 0 and calls[3] == 0   # counted by tensor until steps 1 and 2 agreed
    assert peaks[1] == peaks[2] == peaks[3] < peaks[0]


def test_a_profiled_step_of_a_known_unit_takes_its_per_layer_bytes_from_the_first_that_counted_them():
    """The layer profiler's steps (ledger.layers_due) want each layer's saved bytes: the first such step after the
    unit is known counts them tensor by tensor, the later ones take the same figures with no hook on a tensor
    (a by-tensor step cost the host-size bench step 0.6 ms more), and the per-layer bytes and the peak equal a
    by-tensor count's. The first step's bytes (what is made once) are never the ones kept."""
    model, ledger, hooked = _counted_ledger()
    once = torch.randn(32, 16)
    names = [name for name, _ in model.named_children()]
    seen = []
    for step in range(6):
        ledger.reset_peak()
        hooked.clear()
        ledger.activations_by_layer = {}
        ledger.layers_due = step in (0, 4, 5)   # profiled steps: the first, then two of the known unit
        ledger.exact_due = step == 3            # the memory planner's step: every tensor, every time
        with ledger.by_units(("micro-step", (32, 8), 1)) as units:
            units.forward_begin()
            x = torch.randn(32, 8)
            for name, layer in model.named_children():
                ledger.current_layer = name
                x = layer(x)
            ledger.current_layer = None
            if step == 0:
                x = x + (once.requires_grad_() ** 2).sum()
            units.forward_end()
            x.sum().backward()
            units.backward_end()
        seen.append((len(hooked), dict(ledger.activations_by_layer), ledger.peak_bytes))
    assert seen[0][0] > 0 and seen[3][0] > 0 and seen[4][0] > 0 and seen[5][0] == 0
    assert seen[5][1] == seen[4][1] == seen[3][1] != seen[0][1] and set(seen[5][1]) <= set(names) | {""}
    assert sum(seen[5][1].values()) == ledger.unit_bytes(("micro-step", (32, 8), 1))
    assert seen[5][2] == seen[4][2] == seen[3][2]
    assert not ledger.layers_due and not ledger.exact_due
