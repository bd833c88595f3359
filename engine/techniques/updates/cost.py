"""The hybrid update's cost model: a layer's measured costs (UpdateCost), a rank's profile (Profile),
and a placement scored on it (simulate, fixed -> Timeline). The model itself is described in
engine/techniques/updates/plan.py, beside the planners that use it.

    profile = Profile(layers_in_backward_order, peak_bytes=..., capacity_bytes=..., host_threads=2)
    timeline = fixed(profile, "host")            # makespan_ms, device_end_ms, host_end_ms, fits, ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heapreplace

from engine.config import format_size

PLACEMENTS = ("device", "host")
BRUTE_FORCE_MAX_LAYERS = 20


@dataclass(frozen=True)
class UpdateCost:
    name: str
    fwd_ms: float      # forward time of the layer
    bwd_ms: float      # backward time of the layer
    device_ms: float   # its update on the device
    host_ms: float     # its update on the host
    copy_ms: float     # copies for a host update (grads down, weights up), on the host's timeline
    state_bytes: int   # what the update keeps on the side that runs it: optimizer state (+ fp32 masters of bf16 weights)

    def __post_init__(self) -> None:
        for key in ("fwd_ms", "bwd_ms", "device_ms", "host_ms", "copy_ms", "state_bytes"):
            value = getattr(self, key)
            if not value >= 0 or value == float("inf"):  # also rejects NaN
                raise ValueError(f"layer {self.name!r}: {key} = {value!r} must be a finite number >= 0")


@dataclass(frozen=True)
class Profile:
    layers: tuple[UpdateCost, ...]  # backward order
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


def describe(timeline: Timeline) -> str:
    """One line: makespan, the two timelines, how many updates on the host, memory."""
    n = len(timeline.placement)
    memory = (f"{format_size(timeline.device_bytes)} of {format_size(timeline.capacity_bytes)}"
              + ("" if timeline.fits else " (does not fit)"))
    best_found = " (the best found, not proven optimal)" if timeline.optimal is False else ""
    return (f"makespan {timeline.makespan_ms:.2f} ms{best_found} (device {timeline.device_end_ms:.2f} ms, "
            f"host {timeline.host_end_ms:.2f} ms); {timeline.host_layers}/{n} updates on the host; "
            f"device {memory}")
