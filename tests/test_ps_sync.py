"""The parameter server's per-layer synchronisation, with scripted arrival times, and its layer assignment."""

from __future__ import annotations

import pytest
import torch

from engine.strategies.param_server import ParamServerError, assign_layers
from engine.techniques.ps_sync import Arrival, LayerSync, staleness_scale

W = {2, 3, 4, 5}


def grad(value: float) -> torch.Tensor:
    return torch.full((3,), value)


def soft(**kw) -> LayerSync:
    sync = LayerSync("soft", W, **kw)
    sync.window_s = {2: 0.010, 3: 0.010, 4: 0.010, 5: 0.030}
    return sync


def test_soft_window_takes_what_arrives_within_the_openers_slack():
    sync = soft()
    assert sync.offer(Arrival(2, 0, 1.000, grad(1))) == []           # opens [1.000, 1.010]
    assert sync.offer(Arrival(3, 0, 1.004, grad(2))) == []
    assert sync.offer(Arrival(4, 0, 1.010, grad(3))) == []           # on the deadline: in
    assert sync.next_deadline() == pytest.approx(1.010)
    late = sync.offer(Arrival(5, 0, 1.011, grad(4)))                 # after it: closes the window, opens the next
    assert len(late) == 1
    update = late[0]
    assert update.workers == [2, 3, 4] and update.staleness == [0, 0, 0]
    assert update.scales == [0.25] * 3                               # 1/(1+0), over 4 live workers
    assert torch.allclose(update.grad, grad((1 + 2 + 3) / 4))
    assert update.version == 1 and update.window_s == pytest.approx(0.010)
    # the late gradient opened the next window, as long as its own worker's slack
    assert sync.next_deadline() == pytest.approx(1.041)
    assert sync.due(1.040) == []
    (second,) = sync.due(1.042)
    # computed on version 0, applied at 1: the layer has moved 3/4 of a round since (staleness_unit "rounds")
    assert second.workers == [5] and second.staleness == [pytest.approx(0.75)]
    assert second.scales == [pytest.approx(1 / 1.75 / 4)]
    assert torch.allclose(second.grad, grad(4 / 1.75 / 4))
    assert sync.version == 2


def test_in_rounds_a_gradients_staleness_is_how_far_the_layer_moved_not_how_many_windows_closed():
    """Four fresh gradients of version 0, in four windows of one (the first layer's windows are that short): in
    versions each later one is a window staler and counts less (1, 1/2, 1/3, 1/4 of a quarter); in rounds each
    window moved the layer a quarter of a round (scaled), so the four count 0.78 of a round where one window of four counts 1."""
    def split(unit: str) -> list:
        sync = soft(unit=unit)
        sync.window_s = {w: 0.0 for w in W}
        got = []
        for i, w in enumerate(sorted(W)):
            got += sync.offer(Arrival(w, 0, 1.0 + i * 0.01, grad(1)))
        got += sync.due(2.0)
        assert [u.workers for u in got] == [[2], [3], [4], [5]]
        return got
    versions = split("versions")
    assert [u.staleness for u in versions] == [[0], [1], [2], [3]]
    assert sum(u.scales[0] for u in versions) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)   # 0.52 of a round
    rounds = split("rounds")
    moved, expect = 0.0, []
    for _ in range(4):   # each gradient: staleness = the scales applied since version 0
        scale = staleness_scale(moved, True) / 4
        expect.append((moved, scale))
        moved += scale
    assert [(u.staleness[0], u.scales[0]) for u in rounds] == [(pytest.approx(s), pytest.approx(c)) for s, c in expect]
    assert sum(u.scales[0] for u in rounds) == pytest.approx(moved) and moved > 0.77   # 0.78 of a round
    # one window of all four: the same in both units
    whole = [soft(unit=unit) for unit in ("versions", "rounds")]
    for sync in whole:
        for i, w in enumerate(sorted(W)):
            last = sync.offer(Arrival(w, 0, 1.0 + i * 0.001, grad(1)))
        assert last[0].scales == [0.25] * 4 and last[0].staleness == [0] * 4 and sync.moved == 1.0


def test_in_rounds_a_version_from_before_a_restore_counts_in_versions():
    sync = soft(unit="rounds")
    sync.restore(40)
    sync.window_s = {w: 0.0 for w in W}
    (first,) = sync.offer(Arrival(2, 40, 1.0, grad(1))) + sync.due(1.5)
    assert first.staleness == [0.0] and sync.version == 41 and sync.moved == pytest.approx(0.25)
    (old,) = sync.offer(Arrival(3, 38, 2.0, grad(1))) + sync.due(2.5)   # read before the checkpoint was written
    assert old.staleness == [3.0]
    with pytest.raises(ValueError, match="staleness unit 'steps'; one of versions, rounds"):
        LayerSync("soft", W, unit="steps")


def test_soft_window_closes_early_when_every_live_worker_is_in():
    sync = soft()
    for i, w in enumerate(sorted(W)):
        updates = sync.offer(Arrival(w, 0, 1.0 + i * 0.001, grad(1)))
    assert len(updates) == 1 and updates[0].workers == [2, 3, 4, 5]
    assert sync.window is None


def test_a_second_gradient_from_one_worker_waits_for_the_next_window():
    sync = soft()
    sync.offer(Arrival(2, 0, 1.000, grad(1)))
    sync.offer(Arrival(2, 0, 1.001, grad(5)))      # (only after a mode change could this happen)
    (first,) = sync.due(1.0105)
    assert first.workers == [2]
    assert sync.window is not None and sync.window.entries[0].grad[0] == 5
    assert sync.next_deadline() == pytest.approx(1.011)


def test_pull_waits_while_the_workers_gradient_is_in_an_open_window():
    sync = soft()
    sync.offer(Arrival(2, 0, 1.0, grad(1)))
    assert not sync.pull_ready(2, 1)
    assert sync.pull_ready(3, 1)                   # not in the window: current weights at once
    sync.due(1.02)
    assert sync.pull_ready(2, 1)


def test_bsp_waits_for_every_live_worker_and_averages():
    sync = LayerSync("bsp", W)
    for w in (2, 3, 4):
        assert sync.offer(Arrival(w, 0, 1.0, grad(w))) == []
    assert sync.missing() == {5}
    (update,) = sync.offer(Arrival(5, 0, 9.0, grad(5)))
    assert torch.allclose(update.grad, grad((2 + 3 + 4 + 5) / 4)) and update.staleness == [0] * 4


def test_bsp_goes_on_without_a_lost_worker():
    sync = LayerSync("bsp", W)
    for w in (2, 3, 4):
        sync.offer(Arrival(w, 0, 1.0, grad(1)))
    (update,) = sync.lose(5, 1.5)
    assert update.workers == [2, 3, 4]
    assert update.scales == [pytest.approx(1 / 3)] * 3   # averaged over the workers still live
    assert sync.offer(Arrival(5, 0, 2.0, grad(1))) == []  # a lost worker's late gradient is dropped


def test_a_worker_that_leaves_after_its_gradient_went_in_still_counts_in_that_window():
    # the end of a run: worker 2 pushed its last gradient and said BYE before worker 3's arrived
    sync = LayerSync("bsp", {2, 3})
    assert sync.offer(Arrival(2, 0, 1.0, grad(2.0))) == []
    assert sync.lose(2, 1.1) == []                        # the window still waits for worker 3
    (update,) = sync.offer(Arrival(3, 0, 1.2, grad(4.0)))
    assert update.scales == [0.5, 0.5] and torch.allclose(update.grad, grad(3.0))   # the mean, not the sum


def test_asp_applies_each_gradient_scaled_by_its_staleness():
    sync = LayerSync("asp", W)
    (a,) = sync.offer(Arrival(2, 0, 1.0, grad(1)))
    (b,) = sync.offer(Arrival(3, 0, 1.1, grad(1)))
    (c,) = sync.offer(Arrival(4, 0, 1.2, grad(1)))
    assert [a.scales, b.scales, c.scales] == [[1.0], [0.5], [pytest.approx(1 / 3)]]
    assert [a.staleness, b.staleness, c.staleness] == [[0], [1], [2]]
    assert sync.version == 3 and sync.pull_ready(5, 100)
    unscaled = LayerSync("asp", W, scaling=False)
    unscaled.offer(Arrival(2, 0, 1.0, grad(1)))
    (d,) = unscaled.offer(Arrival(3, 0, 1.1, grad(1)))
    assert d.scales == [1.0] and d.staleness == [1]


def test_ssp_bounds_how_far_the_fastest_runs_ahead():
    sync = LayerSync("ssp", {2, 3}, bound=2)
    for _ in range(3):
        sync.offer(Arrival(2, sync.version, 1.0, grad(1)))   # worker 2 has pushed 3, worker 3 none
    assert sync.pull_ready(2, 2)        # iteration 2: 2 ahead of the slowest's 0 pushes
    assert not sync.pull_ready(2, 3)    # iteration 3 would be 3 ahead
    sync.offer(Arrival(3, 0, 1.0, grad(1)))
    assert sync.pull_ready(2, 3)
    assert not sync.pull_ready(2, 4)
    sync.lose(3, 2.0)                   # a lost worker no longer holds the others back
    assert sync.pull_ready(2, 4)


def test_mode_change_applies_what_waits_first():
    sync = soft()
    sync.offer(Arrival(2, 0, 1.0, grad(1)))
    (flushed,) = sync.set_mode("asp", 1.001)
    assert flushed.workers == [2] and sync.mode == "asp" and sync.window is None
    with pytest.raises(ValueError, match="sync mode 'fast'"):
        sync.set_mode("fast", 1.0)


def test_staleness_scale():
    assert [staleness_scale(s, True) for s in (0, 1, 3)] == [1.0, 0.5, 0.25]
    assert staleness_scale(7, False) == 1.0


def test_layers_are_assigned_to_servers_balanced_by_bytes():
    sizes = {0: 400, 2: 100, 4: 300, 6: 200}
    owner = assign_layers(sizes, 2)
    load = [sum(b for j, b in sizes.items() if owner[j] == s) for s in (0, 1)]
    assert load == [500, 500] and owner == {0: 0, 2: 0, 4: 1, 6: 1}
    assert assign_layers(sizes, 1) == dict.fromkeys(sizes, 0)
    with pytest.raises(ParamServerError, match="parallel.param_server.servers = 5 but the model has only 4 layers"):
        assign_layers(sizes, 5)
