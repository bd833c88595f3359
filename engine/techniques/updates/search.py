"""The exact search behind `plan_global` (engine/techniques/updates/plan.py): a DP over layers in backward
order keeping a Pareto front of (device clock, host threads' free times, device bytes), cut by lower
bounds (branch and bound), with the module's tie-break; with several host threads the front is capped.

    best = _search(profile, _Bounds(profile), cut=float("inf"), width=64)   # a beam of 64 states a layer
    makespan, host_count, bits = _search(profile, bounds, best, tie_break=True)       # exact
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from itertools import accumulate

from engine.techniques.updates.cost import UpdateCost, Profile


# Relative slack, far above rounding: on the branch-and-bound cut, because the lower bound
# is summed in another order than `simulate` sums and a tie must survive it; and as the
# margin by which a state must lead another to win whatever the tie-break (`_pareto`).
_BOUND_SLACK = 1e-9


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


def _tail(layers: Sequence[UpdateCost], hc: list[float], i: int) -> tuple[list[int], list[float]]:
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
