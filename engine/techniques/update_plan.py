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
from bisect import bisect_left, bisect_right, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heapreplace
from itertools import accumulate

from engine.config import format_size

PLACEMENTS = ("device", "host")
BRUTE_FORCE_MAX_LAYERS = 20

# Relative slack, far above rounding: on the branch-and-bound cut, because the lower bound
# is summed in another order than `simulate` sums and a tie must survive it; and as the
# margin by which a state must lead another to win whatever the tie-break (`_pareto`).
_BOUND_SLACK = 1e-9
_BEAM_WIDTH = 64  # states per layer of the heuristic search that sets the first bound
_FRONT_LIMIT = 2048  # with several host threads: states per layer the exact search keeps at most


@dataclass(frozen=True)
class LayerCost:
    name: str
    fwd_ms: float      # forward time of the layer
    bwd_ms: float      # backward time of the layer
    device_ms: float   # its update on the device
    host_ms: float     # its update on the host
    copy_ms: float     # copies for a host update (grads down, weights up), on the host's timeline
    state_bytes: int   # optimizer state the update keeps, on the side that runs it

    def __post_init__(self) -> None:
        for key in ("fwd_ms", "bwd_ms", "device_ms", "host_ms", "copy_ms", "state_bytes"):
            value = getattr(self, key)
            if not value >= 0 or value == float("inf"):  # also rejects NaN
                raise ValueError(f"layer {self.name!r}: {key} = {value!r} must be a finite number >= 0")


@dataclass(frozen=True)
class Profile:
    layers: tuple[LayerCost, ...]  # backward order
    peak_bytes: int                # device peak without any optimizer state
    capacity_bytes: int
    host_threads: int = 1          # host servers: each host update runs on the first free one

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        names = [layer.name for layer in self.layers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"layer names must be unique; repeated: {', '.join(dupes)}")
        if self.peak_bytes < 0 or self.capacity_bytes < 0:
            raise ValueError("peak_bytes and capacity_bytes must be >= 0")
        if not isinstance(self.host_threads, int) or self.host_threads < 1:
            raise ValueError(f"host_threads = {self.host_threads!r} must be an integer >= 1")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)


@dataclass(frozen=True)
class Timeline:
    """One placement under the cost model."""

    makespan_ms: float
    device_end_ms: float
    host_end_ms: float
    device_bytes: int
    capacity_bytes: int
    fits: bool
    placement: tuple[str, ...]                   # backward order
    host_spans: dict[str, tuple[float, float]] = field(hash=False)  # host layer -> (start, end)
    # plan_global: True if proven the best, False if its search hit its limit (the best it found)
    optimal: bool | None = field(default=None, compare=False)

    @property
    def host_layers(self) -> int:
        return self.placement.count("host")


class InfeasibleCapacity(ValueError):
    """No placement fits: the device is too small even with every update on the host."""

    def __init__(self, capacity_bytes: int, min_capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.min_capacity_bytes = min_capacity_bytes
        super().__init__(
            f"device capacity {format_size(capacity_bytes)} ({capacity_bytes} bytes) is too small for the "
            f"update plan: even with every optimizer update on the host the device needs "
            f"{format_size(min_capacity_bytes)} (params, gradients, activations); the smallest capacity "
            f"that fits is {format_size(min_capacity_bytes)} ({min_capacity_bytes} bytes)")


def min_capacity(profile: Profile) -> int:
    """The smallest capacity any placement fits in: all-host, which keeps no state on the device."""
    return profile.peak_bytes


def simulate(profile: Profile, placement: Mapping[str, str] | Sequence[str]) -> Timeline:
    """Score a complete placement (one entry per layer) with the cost model."""
    if isinstance(placement, Mapping):
        missing = [n for n in profile.names if n not in placement]
        if missing or len(placement) != len(profile.layers):
            raise ValueError(f"placement must name every layer exactly: missing {missing}, "
                             f"unknown {sorted(set(placement) - set(profile.names))}")
        placement = [placement[n] for n in profile.names]
    placement = tuple(placement)
    if len(placement) != len(profile.layers):
        raise ValueError(f"placement has {len(placement)} entries for {len(profile.layers)} layers")
    bad = [p for p in placement if p not in PLACEMENTS]
    if bad:
        raise ValueError(f"placement {bad[0]!r} is not one of {PLACEMENTS}")

    t = host_end = 0.0
    free = [0.0] * profile.host_threads  # each host thread's free time, a min-heap
    device_bytes = profile.peak_bytes
    spans: dict[str, tuple[float, float]] = {}
    for layer, where in zip(profile.layers, placement):
        t += layer.bwd_ms
        if where == "device":
            t += layer.device_ms
            device_bytes += layer.state_bytes
        else:
            start = max(t, free[0])
            end = start + layer.copy_ms + layer.host_ms
            heapreplace(free, end)
            host_end = max(host_end, end)
            spans[layer.name] = (start, end)
    return Timeline(makespan_ms=max(t, host_end), device_end_ms=t, host_end_ms=host_end,
                    device_bytes=device_bytes, capacity_bytes=profile.capacity_bytes,
                    fits=device_bytes <= profile.capacity_bytes, placement=placement, host_spans=spans)


def fixed(profile: Profile, placement: str | Mapping[str, str]) -> Timeline:
    """Score "device", "host", or a dict naming some layers (the rest on the device).

    A placement that does not fit is still scored, with fits=False, so that a report can
    show why all-device is not an option.
    """
    if isinstance(placement, str):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r} is not one of {PLACEMENTS}")
        return simulate(profile, [placement] * len(profile.layers))
    unknown = [n for n in placement if n not in profile.names]
    if unknown:
        raise ValueError(f"unknown layer {unknown[0]!r} in placement; the layers are: {', '.join(profile.names)}")
    return simulate(profile, [placement.get(n, "device") for n in profile.names])


def _require_fits(profile: Profile) -> None:
    if profile.peak_bytes > profile.capacity_bytes:
        raise InfeasibleCapacity(profile.capacity_bytes, min_capacity(profile))


def _bits_of(placement: Sequence[str]) -> int:
    return sum(1 << i for i, where in enumerate(reversed(placement)) if where == "host")


def _placement_of(bits: int, n: int) -> list[str]:
    """Layer 0 is the most significant bit, so integer order is the placements' lexicographic order."""
    return [PLACEMENTS[(bits >> (n - 1 - i)) & 1] for i in range(n)]


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


class _Bounds:
    """Lower bounds on the makespan reachable from a state, from the layers still to place.

    For the layers from index i on, with A = the device clock plus their backward, the host
    key h (the k threads' free times, sorted), B = their mean and C = the device bytes still
    free, the makespan is at least
    * max(h), and the tail: d + the least, over placements whose device-placed state fits C,
      of the later of the device's end (their backward plus the device-placed updates) and
      the latest end of a host-placed update (its backward's end, d on, plus its host cost),
      ignoring the host's queue and the delays device updates add to later backward; it is
      at least A;
    * the balance point of device and host load when updates move to the host in order of
      device time saved per host time spent (the fractional relaxation, ignoring capacity);
    * B + the least host work that moves enough state off the device to fit C
      (the fractional knapsack in order of host time per byte).
    The last two count host work divided by k, as load on the host's mean free time: each
    host update adds at least its cost to one thread's free time, so the last host end is at
    least B + (host work)/k. With k = 1 that is the single thread's free time and its work.
    """

    def __init__(self, profile: Profile):
        layers = profile.layers
        self.n = n = len(layers)
        self.capacity = profile.capacity_bytes
        self.threads = k = profile.host_threads
        hc = [l.copy_ms + l.host_ms for l in layers]
        share = [c / k for c in hc]  # a host update's share of the k threads' mean free time
        self.rest_bwd = _suffix_sums([l.bwd_ms for l in layers])
        self.rest_dev = _suffix_sums([l.device_ms for l in layers])
        self.rest_state = _suffix_sums([l.state_bytes for l in layers])
        self.tail = [_tail(layers, hc, i) for i in range(n + 1)]  # (device bytes, tail) per suffix
        # Per suffix: cumulative (device + host) cost and host cost along the best-ratio order,
        # and cumulative bytes and host cost along the cheapest-host-per-byte order.
        self.balance: list[tuple[list[float], list[float]]] = []
        self.evict: list[tuple[list[int], list[float]]] = []
        for i in range(n + 1):
            rest = range(i, n)
            by_ratio = sorted(rest, key=lambda j: -layers[j].device_ms / hc[j] if hc[j] else -float("inf"))
            self.balance.append((_prefix_sums([layers[j].device_ms + share[j] for j in by_ratio]),
                                 _prefix_sums([share[j] for j in by_ratio])))
            by_cost = sorted((j for j in rest if layers[j].state_bytes), key=lambda j: hc[j] / layers[j].state_bytes)
            self.evict.append((_prefix_sums([layers[j].state_bytes for j in by_cost]),
                               _prefix_sums([share[j] for j in by_cost])))

    def lower(self, i: int, d: float, hs: tuple[float, ...], b: int) -> float:
        if i == self.n:
            return hs[-1]
        a = d + self.rest_bwd[i]
        sizes, tail = self.tail[i]
        lower = max(d + tail[bisect_right(sizes, self.capacity - b) - 1], hs[-1])
        h = sum(hs) / self.threads  # the threads' mean free time; with one thread, its free time
        both, host = self.balance[i]
        gap = a + self.rest_dev[i] - h  # device load over host load, all on the device
        if gap > 0:
            k = bisect_left(both, gap)
            if k < len(both):
                # Move the first k entirely and a fraction of the next, to where the loads meet.
                step = both[k] - (both[k - 1] if k else 0.0)
                done_both, done_host = (both[k - 1], host[k - 1]) if k else (0.0, 0.0)
                lower = max(lower, h + done_host + (gap - done_both) * ((host[k] - done_host) / step))
        over = b + self.rest_state[i] - self.capacity
        if over > 0:
            sizes, host = self.evict[i]
            k = bisect_left(sizes, over)  # < len(sizes): all of them on the host fits, as b <= capacity
            done_size, done_host = (sizes[k - 1], host[k - 1]) if k else (0, 0.0)
            lower = max(lower, h + done_host + (host[k] - done_host) * (over - done_size) / (sizes[k] - done_size))
        return lower


def _tail(layers: Sequence[LayerCost], hc: list[float], i: int) -> tuple[list[int], list[float]]:
    """The tail bound of `_Bounds` for the layers from i on, from a device clock of 0, by the
    device bytes free. A placement whose latest host update ends at T holds on the device
    every layer whose host update would end after T: the first m of the layers in order of
    host end, latest first, for some m. For each m: the bytes of those m layers, and the
    least bound of any m' <= m (m' layers fit wherever m do)."""
    ends = list(accumulate(l.bwd_ms for l in layers[i:]))  # each backward's end
    host_ends = [end + hc[i + j] for j, end in enumerate(ends)]
    device = ends[-1] if ends else 0.0
    sizes, bounds = [0], []
    for j in sorted(range(len(ends)), key=lambda j: -host_ends[j]):
        bounds.append(max(device, host_ends[j]))  # the m before j on the device, j the latest on the host
        device += layers[i + j].device_ms
        sizes.append(sizes[-1] + layers[i + j].state_bytes)
    bounds.append(device)  # all on the device
    return sizes, list(accumulate(bounds, min))


def _prefix_sums(values: list) -> list:
    return list(accumulate(values))


def _suffix_sums(values: list) -> list:
    return list(accumulate(reversed(values), initial=0))[::-1]


def _search(profile: Profile, bounds: _Bounds, cut: float, tie_break: bool = False,
            width: int | None = None) -> tuple[tuple[float, int, int] | None, bool]:
    """(makespan, host count, placement bits) of the best placement whose makespan can reach `cut`
    (None if none does), and whether `width` dropped any state.

    A DP over layers in backward order. A state after layer i is (device clock d, host key h,
    device bytes b, host count k, placement bits p), where h holds the free times of the
    `host_threads` threads, sorted, with two normalisations that change no completion's
    makespan: each free time becomes max(free, d), since every later backward ends after d
    and so a thread free by then starts its next update at that backward's end (and threads
    free at d are interchangeable); and b counts as 0 once every remaining state would fit on
    top of it. State A dominates B if A is <= in d, in each entry of h (both sorted) and in b
    (and, with `tie_break`, in (k, p) too, or ahead by the slack in d and every entry of h):
    every completion of B then does as well from A (with the tie-break: or strictly better),
    since the first free thread's time and the sorted times after an update are monotone in
    the sorted times before it.
    States whose lower bound exceeds `cut` are dropped, with a few ulps of slack so that a
    tie survives the bound's different summation order. With `width`, only that many states
    with the least lower bounds are kept per layer: a heuristic (beam search), not exact, if
    it drops any.
    """
    layers, capacity = profile.layers, profile.capacity_bytes
    margin = _BOUND_SLACK * max(1.0, abs(cut))
    cut += margin
    dropped = False
    # (d, h, b key, k, p, b, lower bound)
    front = [(0.0, (0.0,) * profile.host_threads, 0, 0, 0, profile.peak_bytes, 0.0)]
    for i, layer in enumerate(layers, start=1):
        children = []
        for d, h, _, k, p, b, _ in front:
            r = d + layer.bwd_ms
            on_device = r + layer.device_ms
            host_end = max(r, h[0]) + layer.copy_ms + layer.host_ms  # on the first free thread
            if len(h) == 1:
                on_device_h, on_host_h = (max(h[0], on_device),), (host_end,)
            else:
                on_device_h = tuple(max(x, on_device) for x in h)
                rest = [max(x, r) for x in h[1:]]
                insort(rest, host_end)
                on_host_h = tuple(rest)
            for cd, ch, ck, cp, cb in ((on_device, on_device_h, k, p << 1, b + layer.state_bytes),
                                       (r, on_host_h, k + 1, (p << 1) | 1, b)):
                if cb > capacity:
                    continue
                lower = bounds.lower(i, cd, ch, cb)
                if lower <= cut:
                    children.append((cd, ch, 0 if cb + bounds.rest_state[i] <= capacity else cb, ck, cp, cb, lower))
        front = _pareto(children, margin if tie_break else None)
        if width is not None and len(front) > width:
            front, dropped = sorted(front, key=lambda s: s[-1])[:width], True
    # After the last layer max(h) = max(last host end, device end), the makespan.
    return min(((h[-1], k, p) for _, h, _, k, p, _, _ in front), default=None), dropped


def _pareto(states: list[tuple], tie_margin: float | None) -> list[tuple]:
    """The states no other dominates: <= in d, h and b key; with a `tie_margin`, also <= in
    (k, p), unless better by more than the margin in d and h, since every completion is
    then strictly faster from the dominating state (the margin outlasts rounding).

    Sorted by (d, h, b key, k, p), a dominating state comes first, so one pass against the
    states kept so far suffices (dominance is transitive). With one host thread the <= test
    in (h, b key) is a lookup in a staircase (h ascending, b key descending) of the kept
    states, for the tie test of those more than the margin ahead in d; the few within the
    margin are scanned. With several, `_pareto_threads` tests with sets of states as bits.
    Missing a dominance would only keep a state too many; each one found is real.
    """
    states.sort()
    if states and len(states[0][1]) > 1:
        return _pareto_threads(states, tie_margin)
    kept: list[tuple] = []
    stair_h: list[float] = []
    stair_b: list[int] = []
    staged = 0  # with a margin, kept[:staged] are on the staircase
    for state in states:
        d, (h,), b, k, p, _, _ = state
        if tie_margin is None:
            at = bisect_right(stair_h, h)
            if at and stair_b[at - 1] <= b:
                continue
            _climb(stair_h, stair_b, h, b)
        else:
            while staged < len(kept) and kept[staged][0] < d - tie_margin:
                _climb(stair_h, stair_b, kept[staged][1][0], kept[staged][2])
                staged += 1
            at = bisect_left(stair_h, h - tie_margin)
            if at and stair_b[at - 1] <= b:
                continue
            if any(kept[j][1][0] <= h and kept[j][2] <= b and kept[j][3:5] <= (k, p)
                   for j in range(staged, len(kept))):
                continue
        kept.append(state)
    return kept


def _pareto_threads(states: list[tuple], tie_margin: float | None) -> list[tuple]:
    """`_pareto` for several host threads, on sorted `states`, with sets of states as bits of
    an int (bit i: states[i]). For each coordinate (each thread's free time, b key, and (k, p)
    for the tie), the states at most a value are a prefix of the states sorted by it, so one
    table of prefix sets per coordinate makes each test a few ANDs with the kept set."""
    n = len(states)

    def prefixes(values: list) -> tuple[list, list[int], list[int]]:
        """Values sorted, the set of the first j of them for each j, and for each state the
        set of those at most its value."""
        order = sorted(range(n), key=values.__getitem__)
        sets, bits = [0], 0
        for i in order:
            bits |= 1 << i
            sets.append(bits)
        at_most = [0] * n
        end = n
        for j in range(n - 1, -1, -1):  # past the last of equal values
            if j + 1 < n and values[order[j]] != values[order[j + 1]]:
                end = j + 1
            at_most[order[j]] = sets[end]
        return [values[i] for i in order], sets, at_most

    threads = [prefixes([s[1][j] for s in states]) for j in range(len(states[0][1]))]
    b_at_most = prefixes([s[2] for s in states])[2]
    kp_at_most = prefixes([s[3:5] for s in states])[2] if tie_margin is not None else []
    ds = [s[0] for s in states]
    kept: list[tuple] = []
    kept_bits = 0
    for i, state in enumerate(states):
        d, h, _, _, _, _, _ = state
        common = kept_bits & b_at_most[i]
        found = common
        for _, _, at_most in threads:
            if not found:
                break
            found &= at_most[i]
        if found and tie_margin is not None:
            found &= kp_at_most[i]
            if not found:  # else: a state more than the margin ahead in d and every thread
                found = common & ((1 << bisect_left(ds, d - tie_margin)) - 1)
                for (values, sets, _), x in zip(threads, h):
                    if not found:
                        break
                    found &= sets[bisect_left(values, x - tie_margin)]
        if not found:
            kept.append(state)
            kept_bits |= 1 << i
    return kept


def _climb(stair_h: list[float], stair_b: list[int], h: float, b: int) -> None:
    """Add (h, b) to the staircase, dropping the points it dominates."""
    at = bisect_right(stair_h, h)
    if at and stair_b[at - 1] <= b:
        return
    start = end = bisect_left(stair_h, h)
    while end < len(stair_b) and stair_b[end] >= b:
        end += 1
    stair_h[start:end] = [h]
    stair_b[start:end] = [b]


def describe(timeline: Timeline) -> str:
    """One line: makespan, the two timelines, how many updates on the host, memory."""
    n = len(timeline.placement)
    memory = (f"{format_size(timeline.device_bytes)} of {format_size(timeline.capacity_bytes)}"
              + ("" if timeline.fits else " (does not fit)"))
    best_found = " (the best found, not proven optimal)" if timeline.optimal is False else ""
    return (f"makespan {timeline.makespan_ms:.2f} ms{best_found} (device {timeline.device_end_ms:.2f} ms, "
            f"host {timeline.host_end_ms:.2f} ms); {timeline.host_layers}/{n} updates on the host; "
            f"device {memory}")
