"""The hybrid optimizer update planner: cost model, exact global plan, online local rule."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import format_size
import engine.techniques.updates.plan as update_plan
from engine.techniques.updates.plan import (
    PLACEMENTS,
    InfeasibleCapacity,
    UpdateCost,
    Profile,
    _Bounds,
    describe,
    fixed,
    min_capacity,
    plan_brute_force,
    plan_global,
    plan_local,
    simulate,
)

D, H = PLACEMENTS


def layer(name, fwd=1.0, bwd=2.0, device=1.0, host=1.0, copy=0.0, state=10) -> UpdateCost:
    return UpdateCost(name, fwd_ms=fwd, bwd_ms=bwd, device_ms=device, host_ms=host, copy_ms=copy, state_bytes=state)


THREE = (layer("a", fwd=1, bwd=2, device=1, host=3, copy=1, state=100),
         layer("b", fwd=1, bwd=4, device=2, host=2, copy=0.5, state=200),
         layer("c", fwd=2, bwd=3, device=1.5, host=5, copy=1, state=300))


def test_simulate_hand_worked():
    profile = Profile(THREE, peak_bytes=1000, capacity_bytes=1300)
    # a: backward ends at 2, host 2 -> 2+1+3 = 6; b: ends at 6, host from 6 to 8.5;
    # c: ends at 9, on the device until 10.5. Device holds 1000 + 300.
    t = simulate(profile, [H, H, D])
    assert (t.makespan_ms, t.device_end_ms, t.host_end_ms) == (10.5, 10.5, 8.5)
    assert t.host_spans == {"a": (2.0, 6.0), "b": (6.0, 8.5)}
    assert (t.device_bytes, t.fits, t.placement, t.host_layers) == (1300, True, (H, H, D), 2)
    # a: ends at 2, device to 3; b: ends at 7, host to 9.5; c: ends at 10, device to 11.5.
    t = simulate(profile, {"a": D, "b": H, "c": D})
    assert (t.makespan_ms, t.device_end_ms, t.host_end_ms) == (11.5, 11.5, 9.5)
    assert t.host_spans == {"b": (7.0, 9.5)}
    assert (t.device_bytes, t.fits) == (1400, False)
    # The host sticks out past the device: c's backward ends at 12, its host update at 18.
    t = simulate(profile, [D, D, H])
    assert (t.device_end_ms, t.host_end_ms, t.makespan_ms) == (12.0, 18.0, 18.0)


def test_simulate_rejects_bad_placements():
    profile = Profile(THREE, peak_bytes=0, capacity_bytes=10**6)
    with pytest.raises(ValueError, match="3 layers"):
        simulate(profile, [D, H])
    with pytest.raises(ValueError, match="'gpu' is not one of"):
        simulate(profile, [D, "gpu", H])
    with pytest.raises(ValueError, match=r"missing \['c'\]"):
        simulate(profile, {"a": D, "b": D})


def test_profile_validates():
    with pytest.raises(ValueError, match="repeated: a"):
        Profile((layer("a"), layer("a")), peak_bytes=0, capacity_bytes=1)
    with pytest.raises(ValueError, match="bwd_ms"):
        layer("a", bwd=-1.0)
    with pytest.raises(ValueError, match="host_ms"):
        layer("a", host=float("nan"))


def test_fixed():
    profile = Profile(THREE, peak_bytes=1000, capacity_bytes=1300)
    assert fixed(profile, "device").placement == (D, D, D)
    assert fixed(profile, "device").fits is False  # still scored, for the report
    assert fixed(profile, "host").placement == (H, H, H)
    assert fixed(profile, {"b": H}).placement == (D, H, D)
    with pytest.raises(ValueError, match=r"unknown layer 'fc9'.*a, b, c"):
        fixed(profile, {"fc9": H})
    with pytest.raises(ValueError, match="not one of"):
        fixed(profile, "cpu")


def test_local_rule_sends_cheap_updates_to_the_host_and_keeps_late_ones():
    profile = Profile((layer("head", fwd=1, bwd=2, device=1, host=2, copy=1),
                       layer("stem", fwd=1, bwd=2, device=1, host=10, copy=1)), peak_bytes=100, capacity_bytes=1000)
    t = plan_local(profile)
    # head ends at 2; the next forward needs it at 2 + stem's backward + stem's forward = 5, and
    # the host is done at 2+1+2 = 5: host. stem ends at 4 and is needed at once; the host would
    # take until 15: device.
    assert t.placement == (H, D)
    assert (t.makespan_ms, t.device_end_ms, t.host_end_ms) == (5.0, 5.0, 5.0)
    assert plan_global(profile) == t


def test_local_rule_capacity_forces_the_host():
    # stem would stay on the device, but its state does not fit there.
    profile = Profile((layer("head", fwd=1, bwd=2, device=1, host=2, copy=1, state=10),
                       layer("stem", fwd=1, bwd=2, device=1, host=10, copy=1, state=10)),
                      peak_bytes=100, capacity_bytes=105)
    t = plan_local(profile)
    assert t.placement == (H, H) and t.fits
    assert t.host_spans == {"head": (2.0, 5.0), "stem": (5.0, 16.0)}
    assert plan_global(profile) == t


def test_local_rule_counts_device_updates_already_placed():
    profile = Profile((layer("a", fwd=0, bwd=1, device=1, host=4),
                       layer("b", fwd=0, bwd=1, device=3, host=100),
                       layer("c", fwd=0, bwd=1, device=1, host=2),
                       layer("d", fwd=1, bwd=1, device=1, host=1)), peak_bytes=0, capacity_bytes=100)
    t = plan_local(profile)
    # a: ends at 1, needed at 1 + 4 = 5, host done at 5: host. b: its host update is too slow,
    # device, which delays c's backward end to 6 (not 3): the host, free at 5, is done at 8,
    # when the forward needs c (6 + d's backward and forward). d: needed at once: device.
    assert t.placement == (H, D, H, D)
    assert t.host_spans == {"a": (1.0, 5.0), "c": (6.0, 8.0)}
    assert t.makespan_ms == 8.0


def test_tie_break_fewer_host_updates_then_device_first():
    # Makespan 8 three ways: (H, D, D), (D, H, D) with one host update, (H, H, D) with two.
    profile = Profile(tuple(layer(n, bwd=2, device=1, host=3) for n in "abc"), peak_bytes=0, capacity_bytes=20)
    for placement in ([H, D, D], [D, H, D], [H, H, D]):
        assert simulate(profile, placement).makespan_ms == 8.0
    assert plan_brute_force(profile).placement == (D, H, D)
    assert plan_global(profile).placement == (D, H, D)


def test_infeasible_capacity_message():
    profile = Profile(THREE, peak_bytes=3 * 2**19, capacity_bytes=2**20)
    for planner in (plan_global, plan_local, plan_brute_force):
        with pytest.raises(InfeasibleCapacity) as err:
            planner(profile)
        assert str(err.value) == (
            "device capacity 1.0 MiB (1048576 bytes) is too small for the update plan: even with every "
            "optimizer update on the host the device needs 1.5 MiB (params, gradients, activations); "
            "the smallest capacity that fits is 1.5 MiB (1572864 bytes)")
        assert err.value.min_capacity_bytes == min_capacity(profile) == 3 * 2**19
        assert isinstance(err.value, ValueError)
    fits = Profile(THREE, peak_bytes=3 * 2**19, capacity_bytes=3 * 2**19)
    assert plan_global(fits).placement == (H, H, H) == plan_local(fits).placement


def test_sizes_and_describe():
    assert [format_size(n) for n in (0, 1023, 1536, 5 * 2**30, 3 * 2**40)] == \
        ["0 B", "1023 B", "1.5 KiB", "5.0 GiB", "3.0 TiB"]
    t = fixed(Profile(THREE, peak_bytes=1000, capacity_bytes=1300), "device")
    assert describe(t) == ("makespan 13.50 ms (device 13.50 ms, host 0.00 ms); 0/3 updates on the host; "
                           "device 1.6 KiB of 1.3 KiB (does not fit)")


def test_brute_force_refuses_many_layers():
    profile = Profile(tuple(layer(f"l{i}") for i in range(21)), peak_bytes=0, capacity_bytes=1)
    with pytest.raises(ValueError, match="at most 20 layers"):
        plan_brute_force(profile)


def test_no_layers():
    t = plan_global(Profile((), peak_bytes=5, capacity_bytes=5))
    assert (t.makespan_ms, t.placement, t.fits) == (0.0, (), True)


# Small whole numbers make ties (the tie-break), floats make the general case.
_MS = st.one_of(st.integers(0, 4).map(float), st.floats(0, 20, allow_nan=False, allow_infinity=False))


@st.composite
def profiles(draw, max_layers=12):
    n = draw(st.integers(0, max_layers))
    layers = tuple(UpdateCost(f"l{i}", *(draw(_MS) for _ in range(5)), state_bytes=draw(st.integers(0, 100)))
                   for i in range(n))
    peak = draw(st.integers(0, 1000))
    total = sum(l.state_bytes for l in layers)
    return Profile(layers, peak_bytes=peak, capacity_bytes=peak + draw(st.integers(0, total)))


@settings(max_examples=100, deadline=None)
@given(profiles())
def test_global_is_exact_and_never_worse(profile):
    best = plan_global(profile)
    assert best == plan_brute_force(profile)  # makespan, and placement by the tie-break
    assert best.fits
    local = plan_local(profile)
    assert local.fits
    assert best.makespan_ms <= local.makespan_ms
    assert best.makespan_ms <= fixed(profile, "host").makespan_ms
    everything = fixed(profile, "device")
    if everything.fits:
        assert best.makespan_ms <= everything.makespan_ms


def _random_profile(seed: int, n: int, headroom: float, kinds: int | None = None) -> Profile:
    rng = random.Random(seed)

    def costs():
        return (rng.uniform(0.5, 5), rng.uniform(1, 10), rng.uniform(0.1, 3), rng.uniform(1, 20),
                rng.uniform(0.5, 5), rng.randint(1, 10**6))
    # kinds: a model of a few repeated blocks, so many layers cost exactly the same.
    blocks = [costs() for _ in range(kinds or n)]
    layers = tuple(UpdateCost(f"l{i}", *blocks[i % len(blocks)]) for i in range(n))
    peak = 10**7
    return Profile(layers, peak_bytes=peak, capacity_bytes=peak + int(headroom * sum(l.state_bytes for l in layers)))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("seed, headroom, kinds", [(0, 0.2, None), (1, 0.5, None), (2, 1.0, None), (3, 0.35, 2)])
def test_global_on_sixty_layers(seed, headroom, kinds):
    profile = _random_profile(seed, 60, headroom, kinds)
    best = plan_global(profile)
    assert best.fits and len(best.placement) == 60
    assert best.makespan_ms <= plan_local(profile).makespan_ms
    assert best.makespan_ms <= fixed(profile, "host").makespan_ms


@pytest.mark.parametrize("seed", range(3))
def test_global_matches_brute_force_on_fourteen_layers(seed):
    profile = _random_profile(seed, 14, 0.4)
    assert plan_global(profile) == plan_brute_force(profile)


# --- several host threads: k servers fed in backward order, each update on the first free one ---


def threads(profile: Profile, k: int) -> Profile:
    return dataclasses.replace(profile, host_threads=k)


def test_profile_validates_host_threads():
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError, match="host_threads"):
            Profile(THREE, peak_bytes=0, capacity_bytes=1, host_threads=bad)
    assert Profile(THREE, peak_bytes=0, capacity_bytes=1).host_threads == 1


def test_simulate_on_several_threads_hand_worked():
    profile = Profile(tuple(layer(n, bwd=1, device=1, host=4, copy=1) for n in "abc"),
                      peak_bytes=0, capacity_bytes=100)
    # One thread: a ends at 1, host 1-6; b ends at 2, waits until 6, 6-11; c ends at 3, 11-16.
    t = simulate(profile, [H, H, H])
    assert t.host_spans == {"a": (1.0, 6.0), "b": (6.0, 11.0), "c": (11.0, 16.0)} and t.makespan_ms == 16.0
    # Two: b starts on the second thread at its backward's end; c takes the first free, a's, at 6.
    t = simulate(threads(profile, 2), [H, H, H])
    assert t.host_spans == {"a": (1.0, 6.0), "b": (2.0, 7.0), "c": (6.0, 11.0)}
    assert (t.makespan_ms, t.device_end_ms, t.host_end_ms) == (11.0, 3.0, 11.0)
    # Three: nobody waits; the last host end (c's) is the makespan.
    t = simulate(threads(profile, 3), [H, H, H])
    assert t.host_spans == {"a": (1.0, 6.0), "b": (2.0, 7.0), "c": (3.0, 8.0)} and t.host_end_ms == 8.0
    # The last host end, not the last started: a's long update outlasts b's on the other thread.
    t = simulate(threads(Profile((layer("a", bwd=1, host=9, copy=0), layer("b", bwd=1, host=1, copy=0)),
                                 peak_bytes=0, capacity_bytes=100), 2), [H, H])
    assert t.host_spans == {"a": (1.0, 10.0), "b": (2.0, 3.0)} and t.host_end_ms == t.makespan_ms == 10.0


def test_local_rule_uses_the_first_free_thread():
    profile = Profile((layer("a", fwd=0, bwd=1, device=2, host=5, copy=0),
                       layer("b", fwd=0, bwd=1, device=2, host=5, copy=0),
                       layer("c", fwd=6, bwd=1, device=2, host=1, copy=0)), peak_bytes=0, capacity_bytes=100)
    # One thread: a ends at 1, is needed at 1 + 1 + 1 + 6 = 9 and done at 6: host. b ends at 2,
    # is needed at 2 + 1 + 6 = 9, but the thread is busy until 6 and b would be done at 11:
    # device. c, the model's first layer, is needed at once: device.
    assert plan_local(profile).placement == (H, D, D)
    # Two: b starts at once on the second thread, done at 7 <= 9: host.
    t = plan_local(threads(profile, 2))
    assert t.placement == (H, H, D) and t.host_spans == {"a": (1.0, 6.0), "b": (2.0, 7.0)}


@settings(max_examples=100, deadline=None)
@given(profiles(), st.sampled_from([1, 2, 3]))
def test_global_is_exact_on_several_threads(profile, k):
    profile = threads(profile, k)
    best = plan_global(profile)
    assert best == plan_brute_force(profile)  # makespan, and placement by the tie-break
    assert best.fits
    assert best.makespan_ms <= min(plan_local(profile).makespan_ms, fixed(profile, "host").makespan_ms)


@settings(max_examples=100, deadline=None)
@given(profiles(max_layers=10), st.data())
def test_a_thread_more_never_slows_a_placement(profile, data):
    placement = data.draw(st.lists(st.sampled_from(PLACEMENTS), min_size=len(profile.layers),
                                   max_size=len(profile.layers)))
    ends = [simulate(threads(profile, k), placement).makespan_ms for k in (1, 2, 3, len(profile.layers) + 1)]
    assert ends == sorted(ends, reverse=True)
    # With a thread per layer no host update waits: each starts when its backward ends.
    t = simulate(threads(profile, len(profile.layers) + 1), placement)
    backward_end = 0.0
    for cost, where in zip(profile.layers, placement):
        backward_end += cost.bwd_ms
        if where == H:
            assert t.host_spans[cost.name][0] == backward_end
        else:
            backward_end += cost.device_ms


def _state_after(profile: Profile, prefix: list[str]) -> tuple[float, tuple[float, ...], int]:
    """The planner's state after placing `prefix`: device clock, sorted thread free times (each at
    least the clock), device bytes."""
    d, free, b = 0.0, [0.0] * profile.host_threads, profile.peak_bytes
    for cost, where in zip(profile.layers, prefix):
        d += cost.bwd_ms
        if where == D:
            d += cost.device_ms
            b += cost.state_bytes
        else:
            heapq.heapreplace(free, max(d, free[0]) + cost.copy_ms + cost.host_ms)
    return d, tuple(sorted(max(f, d) for f in free)), b


@settings(max_examples=150, deadline=None)
@given(profiles(max_layers=7), st.sampled_from([1, 2, 3]), st.data())
def test_lower_bound_never_exceeds_a_completion(profile, k, data):
    # The branch and bound is exact only if no state's bound passes its best completion.
    profile = threads(profile, k)
    n = len(profile.layers)
    prefix = data.draw(st.lists(st.sampled_from(PLACEMENTS), max_size=n))
    d, h, b = _state_after(profile, prefix)
    if b > profile.capacity_bytes:
        return
    completions = [simulate(profile, prefix + list(rest))
                   for rest in itertools.product(PLACEMENTS, repeat=n - len(prefix))]
    best = min((t.makespan_ms for t in completions if t.fits), default=None)
    if best is not None:
        assert _Bounds(profile).lower(len(prefix), d, h, b) <= best * (1 + 1e-12) + 1e-12


@pytest.mark.timeout(30)
@pytest.mark.parametrize("k", [2, 3, 16])
@pytest.mark.parametrize("seed, headroom, kinds", [(0, 0.2, None), (1, 0.5, None), (3, 0.35, 2)])
def test_global_on_sixty_layers_and_several_threads(seed, headroom, kinds, k):
    profile = threads(_random_profile(seed, 60, headroom, kinds), k)
    best = plan_global(profile)
    assert best.fits and len(best.placement) == 60
    assert best.makespan_ms <= plan_local(profile).makespan_ms
    assert best.makespan_ms <= fixed(profile, "host").makespan_ms
    assert best.makespan_ms <= plan_global(threads(profile, k - 1)).makespan_ms  # a thread more never hurts


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_global_matches_brute_force_on_fourteen_layers_and_several_threads(seed, k):
    profile = threads(_random_profile(seed, 14, 0.4), k)
    assert plan_global(profile) == plan_brute_force(profile)


def _busy_host_profile(seed: int, n: int, k: int, headroom: float) -> Profile:
    """A host busy throughout: updates 10-40 times a layer's backward (an H100's host beside its GPU)."""
    rng = random.Random(seed)
    layers = tuple(UpdateCost(f"l{i}", rng.uniform(0.3, 1), rng.uniform(0.6, 2), rng.uniform(0.02, 0.1),
                              rng.uniform(10, 40), rng.uniform(0.5, 2), rng.randint(10**7, 10**8)) for i in range(n))
    peak = 10**9
    return Profile(layers, peak_bytes=peak, capacity_bytes=peak + int(headroom * sum(l.state_bytes for l in layers)),
                   host_threads=k)


def test_global_says_whether_it_proved_its_plan(monkeypatch):
    profile = _busy_host_profile(0, 14, 4, 0.3)
    exact = plan_global(profile)
    assert exact.optimal is True and exact == plan_brute_force(profile) and plan_brute_force(profile).optimal
    assert plan_local(profile).optimal is None and fixed(profile, "host").optimal is None
    # A front limit too small for this profile: the best found, never worse than the simple plans.
    monkeypatch.setattr(update_plan, "_FRONT_LIMIT", 2)
    found = plan_global(profile)
    assert found.optimal is False and found.fits
    assert exact.makespan_ms <= found.makespan_ms <= min(plan_local(profile).makespan_ms,
                                                         fixed(profile, "host").makespan_ms)
    assert describe(found).startswith(f"makespan {found.makespan_ms:.2f} ms (the best found, not proven optimal) ")
    # One thread keeps the exact search whole.
    assert plan_global(threads(profile, 1)).optimal is True


@pytest.mark.timeout(60)
def test_global_on_a_busy_host_stays_bounded():
    # Sixty layers on eight threads, the host busy throughout: the exact fronts outgrow memory,
    # the limited search answers in seconds.
    profile = _busy_host_profile(1, 60, 8, 0.3)
    best = plan_global(profile)
    assert best.fits and best.makespan_ms <= plan_local(profile).makespan_ms


# --- plans that never lose: calibration, the trial's budget, a plan that goes back (trial.py) -------------------

def test_calibration_scales_the_device_side_to_the_measured_step():
    from engine.techniques.updates.trial import calibrated
    profile = Profile([layer("b", fwd=1.0, bwd=2.0, device=1.0, host=5.0), layer("a", fwd=1.0, bwd=2.0, device=1.0,
                                                                               host=5.0)], 0, 100)
    everything = {"a": "device", "b": "device"}
    got, scale = calibrated(profile, everything, 4.0)   # modelled: 2 ms of forward, 6 of backward and updates
    assert scale == pytest.approx(0.5)
    assert sum(c.fwd_ms for c in got.layers) + fixed(got, "device").makespan_ms == pytest.approx(4.0)
    assert [c.host_ms for c in got.layers] == [5.0, 5.0]   # the host's own clock: not scaled
    assert calibrated(profile, everything, None) == (profile, 1.0)   # nothing measured: as modelled


class ScriptedClock:
    """The updater's step clock: each step (begin_step to begin_step) takes the next of `step_ms`."""

    def __init__(self, step_ms):
        self.step_ms, self.t = list(step_ms), 0.0

    def __call__(self) -> float:
        return self.t

    def tick(self) -> None:
        self.t += self.step_ms.pop(0) / 1000


def scripted_run(step_ms, profile_steps=2, chosen=None, monkeypatch=None):
    """An MLP's auto updates, one step a scripted time; `chosen`: the placement the planner returns."""
    from pathlib import Path

    import torch
    from engine.config import Config, UpdateConfig
    from engine.models import build_model
    from engine.runtime.devices import LedgerDevice
    from engine.models.layers import params_by_layer
    from engine.techniques.updates import trial
    from engine.techniques.updates.report import plan_events
    from engine.techniques.updates.updater import LayerUpdates
    from engine.training.loss import cross_entropy
    if chosen is not None:
        monkeypatch.setattr(trial, "plan_global", lambda p: update_plan.simulate(p, [chosen[n] for n in p.names]))
    cfg = Config()
    cfg.optim.name = "adamw"
    model = build_model(cfg.model, {"input_dim": 8, "num_classes": 3}, 0)
    device = LedgerDevice(1 << 30)
    updater = LayerUpdates(model, params_by_layer(model), cfg.optim, device,
                           UpdateConfig(placement="auto", profile_steps=profile_steps, host_threads=1))
    device.ledger.track_module(model, updater)
    clock = updater.trial.now = ScriptedClock(step_ms)
    events, placements = [], []
    for step in range(len(step_ms)):
        updater.begin_step()
        cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0])).backward()
        updater.end_backward()
        updater.wait_host()
        placements.append(updater.placement())
        events += plan_events(updater, step + 1, Path("runs/scripted"))   # its profile file is not written here
        clock.tick()
    updater.close()
    return updater, events, placements


def test_a_plan_measured_slower_than_the_steps_it_replaced_goes_back(monkeypatch):
    host_fc0 = {"fc0": "host", "fc1": "device", "head": "device"}
    # host trial step (the run's first), device trial step 10 ms, then the plan's steps at 30 ms
    updater, events, placements = scripted_run([50, 10, 30, 30, 30, 30], chosen=host_fc0, monkeypatch=monkeypatch)
    kinds = [e.kind for e in events]
    assert kinds == ["update_plan", "plan_reverted"]
    [back] = [e for e in events if e.kind == "plan_reverted"]
    assert back.fields["plan_ms"] == 30 and back.fields["replaced_ms"] == 10
    assert placements[2] == host_fc0 and set(placements[-1].values()) == {"device"}   # back to the trial's device
    # the same plan at 8 ms a step stands
    updater, events, placements = scripted_run([50, 10, 8, 8, 8, 8], chosen=host_fc0, monkeypatch=monkeypatch)
    assert [e.kind for e in events] == ["update_plan"] and placements[-1] == host_fc0


def test_the_trial_costs_at_most_two_steps_beyond_its_device_steps():
    # a host step far slower than the device step: the trial stops after one of each, the plan says its cost
    updater, events, _ = scripted_run([400, 10, 400, 10, 10, 10], profile_steps=6)
    [made] = [e for e in events if e.kind == "update_plan"]
    assert len(updater.trial.steps) == 2 and made.fields["trial_steps"] == 2
    assert made.fields["trial_extra_ms"] <= made.fields["budget_ms"] == 20
    # host steps close to the device step: the whole trial runs, within the budget
    updater, events, _ = scripted_run([12, 10, 12, 10, 12, 10, 10, 10], profile_steps=6)
    [made] = [e for e in events if e.kind == "update_plan"]
    assert len(updater.trial.steps) == 6 and made.fields["trial_extra_ms"] <= made.fields["budget_ms"]
