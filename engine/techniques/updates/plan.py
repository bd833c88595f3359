"""Where each layer's optimizer update runs: the planner of the hybrid optimizer update.

A layer's update runs either on the *device* (inline on the compute thread, right after
that layer's backward) or on the *host* (the executor's threads, with their own copy of the
weights and optimizer state, which work while the backward of earlier layers goes on).
Layers are always given in BACKWARD order: index 0 is the model's last layer, the first
whose backward ends.

Cost model (`simulate`; every planner, the brute force included, scores placements with it):

* Device: the clock starts at 0; each layer adds its `bwd_ms`, and its backward ends at
  r_i; a device-placed update then adds its `device_ms`, delaying every later backward.
* Host: `host_threads` = k servers (the executor's threads) fed by one FIFO queue in
  backward order, each update taken by the first free thread. A host update starts at
  max(r_i, the earliest free time of the k threads), then occupies that thread for
  `copy_ms + host_ms` (gradients down, weights back up, the step itself). Each thread runs
  at the speed the trial measured, whatever the others do: where the threads share cores
  with the compute thread (the CPU "device"), k of them give less than k times one.
* makespan = max(device end, last host end).
* Memory: the device holds `peak_bytes` (params, grads, activations) plus the optimizer
  state of every device-placed layer; a placement *fits* if that is <= `capacity_bytes`.
  All-host therefore always fits unless `peak_bytes` alone is over capacity, and then no
  placement does: the planners raise `InfeasibleCapacity`.

Planners:

* `plan_global`: the exact optimum (minimum makespan among placements that fit), by a DP
  over layers keeping a Pareto front of (device clock, the k threads' free times, device
  bytes), cut by a lower bound against the best of a beam search and the simple plans
  (branch and bound). 60 layers take milliseconds to a few tenths of a second on one
  thread. On several the fronts can grow much faster where the host is busy throughout
  (updates many times a layer's backward): the search then keeps a bounded front and says
  when its plan is only the best it found (`Timeline.optimal`); see `plan_global`.
* `plan_brute_force`: all 2^n placements, for checking `plan_global` (n <= 20).
* `plan_local`: the online rule the engine can apply as each backward ends, without
  looking ahead: host if the first free host thread would finish the update before the
  next step's forward needs the layer, else device, unless the device has no room for its
  state.
* `fixed`: a given placement ("device", "host", or a per-layer dict), scored as is.

Tie-break (global and brute force): among placements with the same makespan, fewer host
updates first (each one costs copies and a second copy of the weights), then the
lexicographically smallest placement in backward order with "device" < "host".
"""

from __future__ import annotations

import dataclasses
from heapq import heapreplace
from itertools import accumulate

from engine.techniques.updates.cost import (BRUTE_FORCE_MAX_LAYERS, PLACEMENTS, InfeasibleCapacity, UpdateCost, Profile,
                                           Timeline, _bits_of, _placement_of, _require_fits, describe, fixed,
                                           min_capacity, simulate)
from engine.techniques.updates.search import _Bounds, _search

_BEAM_WIDTH = 64  # states per layer of the heuristic search that sets the first bound
_FRONT_LIMIT = 2048  # with several host threads: states per layer the exact search keeps at most

__all__ = ["BRUTE_FORCE_MAX_LAYERS", "PLACEMENTS", "InfeasibleCapacity", "UpdateCost", "Profile", "Timeline",
           "describe", "fixed", "min_capacity", "plan_brute_force", "plan_global", "plan_local", "simulate"]


def plan_brute_force(profile: Profile) -> Timeline:
    """Score all 2^n placements; the reference `plan_global` is checked against."""
    n = len(profile.layers)
    if n > BRUTE_FORCE_MAX_LAYERS:
        raise ValueError(f"brute force over {n} layers is 2^{n} placements; it takes at most "
                         f"{BRUTE_FORCE_MAX_LAYERS} layers (use plan_global)")
    _require_fits(profile)
    best: tuple[float, int, int] | None = None
    for bits in range(2 ** n):  # ascending, so the first of equal (makespan, host count) is the smallest
        timeline = simulate(profile, _placement_of(bits, n))
        if timeline.fits and (best is None or (timeline.makespan_ms, timeline.host_layers) < best[:2]):
            best = (timeline.makespan_ms, timeline.host_layers, bits)
    return dataclasses.replace(simulate(profile, _placement_of(best[2], n)), optimal=True)


def plan_local(profile: Profile) -> Timeline:
    """The online rule, decided for each layer when its backward ends.

    Host if the first free host thread, after the work already queued, finishes the update
    before the next step's forward reaches the layer (the rest of this backward, then the
    forward of the layers in front of it), since it then costs the device nothing; else
    device, which delays later backward by `device_ms` but is ready in time; unless the
    layer's state does not fit on the device, which forces the host.
    """
    _require_fits(profile)
    layers = profile.layers
    # after[i]: backward still to run after layer i, plus the forward of the layers before it.
    after = list(accumulate((l.bwd_ms + l.fwd_ms for l in reversed(layers[1:])), initial=0.0))[::-1]
    t = 0.0
    free = [0.0] * profile.host_threads  # each host thread's free time, a min-heap
    device_bytes = profile.peak_bytes
    placement = []
    for layer, later in zip(layers, after):
        t += layer.bwd_ms
        host_done = max(t, free[0]) + layer.copy_ms + layer.host_ms
        fits_on_device = device_bytes + layer.state_bytes <= profile.capacity_bytes
        if host_done <= t + later or not fits_on_device:
            placement.append("host")
            heapreplace(free, host_done)
        else:
            placement.append("device")
            t += layer.device_ms
            device_bytes += layer.state_bytes
    return simulate(profile, placement)


def plan_global(profile: Profile) -> Timeline:
    """The placement with the least makespan that fits (exact), with the module's tie-break.

    A beam search finds a near-best makespan quickly; the exact search, cut against it (or
    against the simple plans, if better), then has few states to keep. With several host
    threads a state holds every thread's free time, and where the host is busy throughout
    (updates many times longer than a layer's backward) the fronts can grow past memory: the
    exact search keeps at most `_FRONT_LIMIT` states per layer, those with the least lower
    bounds, and if it had to drop any, the result is the best placement it or the beam found
    (never worse than the simple plans) with `optimal` False instead of True.
    """
    _require_fits(profile)
    bounds = _Bounds(profile)
    simple = [fixed(profile, "host"), plan_local(profile), fixed(profile, "device")]
    found = [(t.makespan_ms, t.host_layers, _bits_of(t.placement)) for t in simple if t.fits]
    found.append(_search(profile, bounds, float("inf"), width=_BEAM_WIDTH)[0])
    limit = None if profile.host_threads == 1 else _FRONT_LIMIT
    best, dropped = _search(profile, bounds, min(found)[0], tie_break=True, width=limit)
    if dropped:
        best = min(found + [best] if best else found)
    return dataclasses.replace(simulate(profile, _placement_of(best[2], len(profile.layers))), optimal=not dropped)
