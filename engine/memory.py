"""Per-layer activation memory policy: keep, swap to host, recompute; planned against the device capacity.

    policy = ActivationPolicy(model, device, cfg.memory, owned=lambda: model.names, in_flight=lambda: 1)
    policy.before_step(step)           # arms the measurement when a plan is due
    loss = strategy.train_step(x, y)   # runs inside device.ledger.saved_activations()
    plan = policy.after_step(step)     # a Plan when one was made (auto), else None
    policy.set("block0.mlp", "swap")   # an operator's choice: pinned, applies from the next step

Each layer of the LayerList runs through `ActivationPolicy._forward` (installed as the
layer's `forward`, so module hooks and state_dict keys are untouched):

- keep: the ledger's saved-tensor hooks count what autograd saves; it stays on the device.
- swap: the same hooks hand each saved storage to the host link (`HostLink`), which
  copies it to host memory on a background thread (a side CUDA stream into pinned
  memory on a GPU) and lets the device copy go once the copy has landed. When the
  gradient of a layer's output is ready, the swapped storages of the nearest earlier
  swap layer of the same forward pass start coming back (prefetch), so they are on the
  device before that layer's backward needs them; a backward that finds its storage
  still on the host fetches it and waits. Backpressure: a forward that would take the
  device over its capacity waits for copies still on their way out, and a prefetch lands
  only when there is room (or when backward needs it now).
- recompute: `torch.utils.checkpoint` (non-reentrant, RNG state preserved, so dropout
  draws the same mask): nothing the layer computes is saved, only its input, which
  the ledger counts until the layer's backward has run. While the forward is rerun in
  backward, the layer's activations are briefly back on the device; the ledger counts
  that moment in its peak.

On the CPU host and "device" are the same memory: a swap is a memcpy the ledger books
as moved off the device. With `host_link_gbps` set, the CPU link paces its copies to
that rate (an emulated PCIe link); unset, it is measured (and on the CPU not paced).

`auto` starts with every layer on swap (measurable, and far under keep's peak from the first
step), measures the second step and plans after it; a pipeline stage plans again after
its layers change.

The plan (`plan`, a pure function of measured per-layer costs; see docs/memory.md):
swap costs a layer's activation bytes over the link rate, recompute costs its forward
time. Layers are ordered by swap cost / recompute cost; the first ones swap while the
summed swap time stays under the stage's forward+backward time, then, while the stage
still does not fit its capacity, the next ones recompute; the rest keep. (Should every
layer be changed and the stage still not fit, the last swapped layers recompute instead.)
"reverse" takes the opposite order; "exhaustive" tries every assignment of up to
EXHAUSTIVE_MAX_LAYERS layers and keeps the cheapest under the model that fits. "ratio" is
the default (the best across link rates in `trainyard bench memory`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from engine.config import format_size

POLICIES = ("keep", "swap", "recompute")
PLANNERS = ("ratio", "reverse", "exhaustive")
EXHAUSTIVE_MAX_LAYERS = 9    # 3^9 = 19683 assignments, well under a second
FETCH_TIMEOUT_S = 60         # a swapped storage not back by then is an error, not a hang
PREFETCH_WAIT_S = 0.5        # a prefetch waits at most this long for room on the device


class PlanError(RuntimeError):
    """The stage does not fit its capacity even with every layer recomputed, nor with every one swapped."""

    def __init__(self, message: str, min_capacity_bytes: int):
        super().__init__(message)
        self.min_capacity_bytes = min_capacity_bytes


# --- the plan ------------------------------------------------------------------------------------------
@dataclass
class LayerCost:
    """One layer, per micro-batch: bytes it saves for backward, bytes of its input, times in ms."""

    name: str
    act_bytes: int
    in_bytes: int
    fwd_ms: float
    bwd_ms: float
    shared_next: int = 0   # of act_bytes, what the next layer saves too (a ReLU's output, the next Linear's input)


@dataclass
class Plan:
    policies: dict[str, str]     # every layer of the stage
    estimate_bytes: int          # modelled peak under these policies
    capacity_bytes: int
    planner: str
    budget_ms: float             # the stage's forward+backward time per micro-batch
    note: str = ""


def resident_bytes(cost: LayerCost, policy: str, next_policy: str = "keep") -> int:
    """What a layer holds on the device per micro-batch between its forward and its backward. Storage
    it shares with the next layer stays on the device while either of the two keeps it."""
    shared = cost.shared_next if next_policy == "keep" else 0
    return {"keep": cost.act_bytes, "swap": shared, "recompute": cost.in_bytes + shared}[policy]


def _residents(costs: list[LayerCost], policies: dict[str, str]) -> list[int]:
    following = [policies[c.name] for c in costs[1:]] + ["keep"]
    return [resident_bytes(c, policies[c.name], nxt) for c, nxt in zip(costs, following)]


def activation_peak(costs: list[LayerCost], policies: dict[str, str], link_bytes_per_ms: float,
                    in_flight: int) -> int:
    """Modelled peak of the stage's activation bytes, walking one micro-batch's backward while the other
    `in_flight - 1` hold everything they keep. At the turn from forward to backward every layer's
    resident bytes are held, plus the swap copies the link has not finished (`swaps_pending`). During
    layer j's backward the layers before it still hold theirs, and j's own activations are back: rerun
    (recompute) or fetched (swap), with the nearest earlier swap layer's prefetched beside them."""
    res = _residents(costs, policies)
    total = sum(res)
    peak = total + swaps_pending(costs, policies, link_bytes_per_ms)
    held, earlier_swap = 0, None
    for c, r in zip(costs, res):
        held += r
        own = c.act_bytes if policies[c.name] != "keep" else 0
        prefetched = earlier_swap.act_bytes if earlier_swap is not None else 0
        peak = max(peak, held + own + prefetched)
        if policies[c.name] == "swap":
            earlier_swap = c
    return int((in_flight - 1) * total + peak)


def swaps_pending(costs: list[LayerCost], policies: dict[str, str], link_bytes_per_ms: float) -> int:
    """Bytes still on their way to the host when the forward ends: the link copies in order, each swap
    layer's storages from the end of that layer's forward."""
    now = link_free = 0.0
    landed_at = []
    for c in costs:
        now += c.fwd_ms
        if policies[c.name] == "swap" and c.act_bytes:
            link_free = max(link_free, now) + c.act_bytes / link_bytes_per_ms
            landed_at.append((link_free, c.act_bytes))
    return sum(nbytes for t, nbytes in landed_at if t > now)


def estimate(costs: list[LayerCost], policies: dict[str, str], base_bytes: int, in_flight: int,
             link_bytes_per_ms: float) -> int:
    """Modelled peak: what the stage holds besides layer activations, plus the activations' peak."""
    return base_bytes + activation_peak(costs, policies, link_bytes_per_ms, in_flight)


def swap_ms(cost: LayerCost, link_bytes_per_ms: float) -> float:
    return cost.act_bytes / link_bytes_per_ms


def plan(costs: list[LayerCost], *, capacity_bytes: int, base_bytes: int, in_flight: int,
         link_bytes_per_ms: float, planner: str = "ratio", pinned: dict[str, str] | None = None) -> Plan:
    """Policies for the layers of one stage (`pinned` ones fixed) so the modelled peak fits the capacity.

    Raises PlanError naming the smallest capacity that fits when even recomputing every free layer
    does not."""
    if planner not in PLANNERS:
        raise ValueError(f"planner must be one of {', '.join(PLANNERS)}, got {planner!r}")
    pinned = dict(pinned or {})
    free = [c for c in costs if c.name not in pinned]
    budget = sum(c.fwd_ms + c.bwd_ms for c in costs)

    def est(policies: dict[str, str]) -> int:
        return estimate(costs, policies, base_bytes, in_flight, link_bytes_per_ms)

    def made(policies: dict[str, str], how: str, note: str = "") -> Plan:
        return Plan(policies=policies, estimate_bytes=est(policies), capacity_bytes=capacity_bytes,
                    planner=how, budget_ms=budget, note=note)

    keep = {c.name: pinned.get(c.name, "keep") for c in costs}
    # the least a stage can hold: every free layer recomputed (it holds only inputs), or every one
    # swapped (it holds nothing between forward and backward, but two layers come back at a time)
    floors = [{**keep, **{c.name: "recompute" for c in free}}, {**keep, **{c.name: "swap" for c in free}}]
    need = min(est(f) for f in floors)
    if need > capacity_bytes:
        why = " with the operator's set-policy choices" if pinned else ""
        raise PlanError(f"the layers {costs[0].name}..{costs[-1].name} need {format_size(need)} ({need} bytes) even "
                        f"with every layer recomputed or every layer swapped{why}, more than the capacity of "
                        f"{format_size(capacity_bytes)} ({capacity_bytes} bytes): the "
                        f"smallest capacity that fits is {format_size(_round_up_mib(need))} "
                        f"(device.memory = \"{_round_up_mib(need) // 2**20}MiB\")", _round_up_mib(need))
    if est(keep) <= capacity_bytes:
        return made(keep, planner)
    how = planner
    if planner == "exhaustive" and len(free) <= EXHAUSTIVE_MAX_LAYERS:
        policies, note = _exhaustive(costs, free, keep, est, capacity_bytes, budget, link_bytes_per_ms), ""
    elif planner == "exhaustive":
        policies, note = _greedy(free, keep, floors, est, capacity_bytes, budget, link_bytes_per_ms, reverse=False)
        how, note = "ratio", (f"{len(free)} layers: more than {EXHAUSTIVE_MAX_LAYERS} for an exhaustive search, "
                              f"planned by ratio" + (f"; {note}" if note else ""))
    else:
        policies, note = _greedy(free, keep, floors, est, capacity_bytes, budget, link_bytes_per_ms,
                                 reverse=planner == "reverse")
    # never a plan the model says is slower than a uniform one that fits: all-recompute, all-swap
    def cost(p: dict[str, str]) -> float:
        return extra_ms(costs, p, budget, link_bytes_per_ms)
    for name, uniform in zip(("recompute", "swap"), floors):
        if est(uniform) <= capacity_bytes and cost(uniform) < cost(policies):
            note = (f"every layer on {name}: modelled {cost(uniform):.2f} ms extra per micro-batch against "
                    f"{cost(policies):.2f} ms for the {how} plan")
            policies = uniform
    return made(policies, how, note)


def extra_ms(costs: list[LayerCost], policies: dict[str, str], budget_ms: float, link_bytes_per_ms: float) -> float:
    """The modelled time policies add to a micro-batch: recomputed forwards, plus swap time beyond
    what the stage's own forward and backward hide."""
    recompute = sum(c.fwd_ms for c in costs if policies[c.name] == "recompute")
    swapped = sum(swap_ms(c, link_bytes_per_ms) for c in costs if policies[c.name] == "swap")
    return recompute + max(0.0, swapped - budget_ms)


def order_by_ratio(free: list[LayerCost], link_bytes_per_ms: float, reverse: bool = False) -> list[LayerCost]:
    """Layers by swap cost over recompute cost, cheapest swap (relative to its recompute) first. Left out:
    layers that save nothing of their own and share nothing with the layer before (no policy changes
    what they hold); a layer that only saves what the one before saved (a Linear after a ReLU) is in,
    at no swap cost: the storage leaves the device only when neither of the two keeps it."""
    sharing = {b.name for a, b in zip(free, free[1:]) if a.shared_next}
    useful = [c for c in free if c.act_bytes > 0 or c.name in sharing]
    return sorted(useful, key=lambda c: (swap_ms(c, link_bytes_per_ms) / max(c.fwd_ms, 1e-6), c.name),
                  reverse=reverse)


def _greedy(free, keep, floors, est, capacity, budget, link, reverse: bool) -> tuple[dict[str, str], str]:
    policies = dict(keep)
    order = order_by_ratio(free, link, reverse)
    used = sum(swap_ms(c, link) for c in free if policies[c.name] == "swap")
    i = 0
    while i < len(order) and est(policies) > capacity and used + swap_ms(order[i], link) <= budget:
        policies[order[i].name] = "swap"
        used += swap_ms(order[i], link)
        i += 1
    while i < len(order) and est(policies) > capacity:
        policies[order[i].name] = "recompute"
        i += 1
    if est(policies) <= capacity:
        return policies, ""
    # every layer changed and still too big (swapped layers come back for their backward): the last
    # swapped ones recompute instead until it fits; where even that does not fit (layers whose
    # recompute holds as much as they save), everything swaps (plan() checked that one of the two
    # fits). Then layers that need not change any more go back to keep.
    while est(policies) > capacity and any(policies[c.name] == "swap" for c in order):
        last = max(k for k, c in enumerate(order) if policies[c.name] == "swap")
        policies[order[last].name] = "recompute"
    note = "every layer changed did not fit: swapped layers moved to recompute"
    if est(policies) > capacity:
        policies = dict(floors[1])
        note = "every layer changed did not fit: every layer swapped"
    for c in reversed(order):
        if policies[c.name] != "keep" and est({**policies, c.name: "keep"}) <= capacity:
            policies[c.name] = "keep"
    return policies, note


def _exhaustive(costs, free, keep, est, capacity, budget, link) -> dict[str, str]:
    """The assignment with the least modelled extra time (recomputed forwards plus swap time beyond the
    stage's own time) that fits; ties go to fewer bytes swapped, then to fewer changed layers."""
    best, best_key = None, None
    for choice in itertools.product(POLICIES, repeat=len(free)):
        policies = {**keep, **{c.name: p for c, p in zip(free, choice)}}
        if est(policies) > capacity:
            continue
        swapped = sum(c.act_bytes for c, p in zip(free, choice) if p == "swap")
        key = (extra_ms(costs, policies, budget, link), swapped, sum(p != "keep" for p in choice))
        if best_key is None or key < best_key:
            best, best_key = policies, key
    return best


def _round_up_mib(n: int) -> int:
    return max(1, math.ceil(n / 2**20)) * 2**20


# --- the host link -------------------------------------------------------------------------------------
class HostBufferPool:
    """Host buffers for swapped storages, kept and reused across steps: a step saves storages of the
    same sizes again and again, and a new buffer costs page faults on the CPU and a cudaHostAlloc (page
    locking, milliseconds) on a GPU. Buffers are pinned on a GPU, so copies are DMA on a side stream.
    The pool holds at most what was in use at once (each buffer returns when its storage comes back
    or is freed)."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.made = self.reused = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.reused += 1
                return free.pop()
            self.made += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def give(self, buf: torch.Tensor | None) -> None:
        if buf is None:
            return
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)


class HostLink:
    """Copies between the device and host memory, off the compute thread: one thread per direction
    (a real link is full duplex), each working through its queue in order. On CUDA the copies run on a
    side stream into pinned memory; on the CPU they are memcpys, paced to `pace_gbps` when given."""

    def __init__(self, device: torch.device, pace_gbps: float | None = None):
        self.device = device
        self.pace_bytes_per_s = pace_gbps * 1e9 if pace_gbps else None
        self.cuda = device.type == "cuda"
        self._queues = {"out": queue.Queue(), "in": queue.Queue()}
        self._threads = [threading.Thread(target=self._loop, args=(q,), name=f"trainyard-host-link-{d}", daemon=True)
                         for d, q in self._queues.items()]
        self._streams = {d: torch.cuda.Stream(device) for d in self._queues} if self.cuda else {}
        self.pool = HostBufferPool(pinned=self.cuda)
        self.error: Exception | None = None   # the last copy that failed on a link thread
        for t in self._threads:
            t.start()

    def submit(self, direction: str, fn: Callable[[], None]) -> None:
        self._queues[direction].put(fn)

    def flush(self, direction: str = "out", timeout: float = FETCH_TIMEOUT_S) -> None:
        """Wait until every copy queued so far in `direction` has landed."""
        done = threading.Event()
        self.submit(direction, done.set)
        if not done.wait(timeout):
            raise RuntimeError(f"the host link's {direction} queue did not drain within {timeout} s")

    def copy(self, direction: str, src: torch.Tensor) -> torch.Tensor:
        """On a link thread: a copy of the uint8 buffer `src` on the other side, complete on return. A copy
        out lands in a buffer of the pool (give it back when done with it)."""
        t0 = time.perf_counter()
        if self.cuda:
            stream, compute = self._streams[direction], torch.cuda.default_stream(self.device)
            # the copy out must not read before the kernels that wrote `src` have run
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                if direction == "out":
                    dst = self.pool.take(src.numel())
                else:
                    dst = torch.empty(src.numel(), dtype=torch.uint8, device=self.device)
                dst.copy_(src, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(stream)
            landed.synchronize()   # this copy only: the link thread books it when it has landed
            if direction == "in":   # allocated on the side stream, used by backward on the compute stream
                dst.record_stream(compute)
            return dst
        if direction == "out":
            dst = self.pool.take(src.numel())
            dst.copy_(src)
        else:
            dst = src.clone()
        if self.pace_bytes_per_s:
            rest = src.numel() / self.pace_bytes_per_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        return dst

    def _loop(self, q: queue.Queue) -> None:
        while True:
            fn = q.get()
            if fn is None:
                return
            try:
                fn()
            except Exception as e:   # a copy that failed: said by the backward that waits for it
                self.error = e

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=5)


def measure_link_gbps(device: torch.device, nbytes: int = 16 * 2**20, repeats: int = 5) -> float:
    """Device-to-host copy rate in GB/s: the median of a few copies of `nbytes` into a buffer already
    touched (the first copy, which also pays for page faults, is not counted)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    cuda = device.type == "cuda"
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    rates = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            rates.append(nbytes / max(time.perf_counter() - t0, 1e-9) / 1e9)
    return sorted(rates)[len(rates) // 2]


class _SwapEntry:
    """One saved storage of a swap layer: on the device until its copy out lands, then on the host,
    then (prefetched) back on the device until autograd frees every tensor saved from it."""

    __slots__ = ("swap", "nbytes", "device_buf", "host_buf", "restored", "state", "handles", "ready",
                 "ptr", "wanted", "urgent", "weak", "layer")

    def __init__(self, swap: "Swapper", buf: torch.Tensor):
        self.swap, self.nbytes, self.device_buf = swap, buf.numel(), buf
        self.host_buf = self.restored = None
        self.state = "out"
        self.handles = 0
        self.ptr = 0
        self.weak = None      # the device storage, weakly: is an address seen again the same storage?
        self.layer = ""       # the layer that saved it first
        self.wanted = False   # prefetch asked for while still on its way out
        self.urgent = False   # backward is waiting for it
        self.ready = threading.Event()   # set when the storage is back on the device


class _SwapHandle:
    """What autograd holds for one tensor saved by a swap layer: a view into an entry's storage."""

    __slots__ = ("entry", "dtype", "offset", "size", "stride")

    def __init__(self, entry: _SwapEntry, t: torch.Tensor):
        self.entry, self.dtype = entry, t.dtype
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()
        entry.handles += 1

    def unpack(self) -> torch.Tensor:
        buf = self.entry.swap.fetch(self.entry)
        return torch.empty(0, dtype=self.dtype, device=buf.device).set_(
            buf.untyped_storage(), self.offset, self.size, self.stride)

    def __del__(self):
        entry = self.entry
        with entry.swap.ledger._lock:
            entry.handles -= 1
            last = entry.handles == 0
        if last:
            entry.swap.release(entry)


class Swapper:
    """The ledger's side of swapping: books each entry's bytes as activations (on the device) or
    swapped (on the host) as it moves, and counts bytes copied out. States of an entry: out (queued
    or copying to the host; the device copy is kept), host, in (coming back), back, dead (freed)."""

    def __init__(self, ledger, link: HostLink):
        self.ledger, self.link = ledger, link
        self.group: list[_SwapEntry] | None = None   # the running swap layer's entries
        self.out_bytes = 0                           # copied to the host, since the start
        self._by_ptr: dict[int, _SwapEntry] = {}     # live entries by the address of their device storage
        self.pending_out = 0                         # bytes queued or copying out (still on the device)
        self.waited_s = 0.0                          # the compute thread's waits for the link, in total
        self.urgent_fetches = 0                      # backward waiting for a storage now
        self._landed = threading.Condition(threading.Lock())

    def make_room(self, nbytes: int) -> None:
        """Backpressure, on the compute thread before `nbytes` more are held: while that would take the
        device over its capacity and swaps are still on their way out, wait for them to land."""
        ledger = self.ledger
        if not (self.pending_out and ledger.used_bytes + nbytes > ledger.capacity_bytes):
            return
        t0 = time.perf_counter()
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        with self._landed:
            while (self.pending_out and ledger.used_bytes + nbytes > ledger.capacity_bytes
                   and time.monotonic() < deadline):
                self._landed.wait(timeout=0.05)
        self.waited_s += time.perf_counter() - t0

    def pack(self, t: torch.Tensor, ptr: int, nbytes: int) -> _SwapHandle:
        ledger = self.ledger
        with ledger._lock:
            entry = self._by_ptr.get(ptr)
            if entry is not None and (entry.state == "dead" or entry.weak.expired()):
                entry = None   # that storage is gone; its address now holds another
            if entry is None:  # a storage not saved before (saved again, it shares the first one's copy)
                storage = t.untyped_storage()
                buf = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                entry = self._by_ptr[ptr] = _SwapEntry(self, buf)
                entry.ptr, entry.weak, entry.layer = ptr, StorageWeakRef(storage), ledger.current_layer or ""
                ledger.bytes["activations"] += nbytes
                ledger.attribute(nbytes)
                ledger._note_peak()
                self.pending_out += nbytes
                fresh = True
            else:
                fresh = False
                ledger.note_shared(entry.layer, nbytes)
            handle = _SwapHandle(entry, t)
        if fresh:
            if self.group is not None:
                self.group.append(entry)
            self.link.submit("out", partial(self._copy_out, entry))
        return handle

    def _copy_out(self, entry: _SwapEntry) -> None:
        if entry.state != "out":
            return
        host = self.link.copy("out", entry.device_buf)
        ledger = self.ledger
        with ledger._lock:
            if entry.state != "out":   # freed while copying
                self.link.pool.give(host)
                return
            self.pending_out -= entry.nbytes
            entry.host_buf, entry.device_buf, entry.state = host, None, "host"
            self.out_bytes += entry.nbytes
            ledger.bytes["activations"] -= entry.nbytes
            ledger.bytes["swapped"] += entry.nbytes
            if entry.wanted:   # backward asked for it while it was on its way out
                entry.state = "in"
                self.link.submit("in", partial(self._copy_in, entry))
        with self._landed:
            self._landed.notify_all()

    def prefetch(self, entries: list[_SwapEntry]) -> None:
        for entry in entries:
            with self.ledger._lock:
                if entry.state == "out":
                    entry.wanted = True
                elif entry.state == "host":
                    entry.state = "in"
                    self.link.submit("in", partial(self._copy_in, entry))

    def _copy_in(self, entry: _SwapEntry) -> None:
        host = entry.host_buf
        if entry.state != "in" or host is None:
            return
        back = self.link.copy("in", host)
        ledger = self.ledger
        deadline = time.monotonic() + PREFETCH_WAIT_S
        # a prefetch lands when there is room, or when backward needs it or another storage queued
        # behind it on this link (the queue is in order: waiting here would make that backward wait too)
        while (not entry.urgent and not self.urgent_fetches and entry.state == "in"
               and time.monotonic() < deadline and ledger.used_bytes + entry.nbytes > ledger.capacity_bytes):
            time.sleep(0.0005)
        with ledger._lock:
            if entry.state != "in":
                return
            self.link.pool.give(host)
            entry.restored, entry.host_buf, entry.state = back, None, "back"
            ledger.bytes["swapped"] -= entry.nbytes
            ledger.bytes["activations"] += entry.nbytes
            ledger._note_peak()
        entry.ready.set()

    def fetch(self, entry: _SwapEntry) -> torch.Tensor:
        """The storage on the device (backward needs it now): still there, prefetched, or fetched now."""
        with self.ledger._lock:
            if entry.state == "out":   # the copy out has not landed: the device copy is still held
                return entry.device_buf
            if entry.state == "back":
                return entry.restored
        entry.urgent = True
        with self.ledger._lock:
            self.urgent_fetches += 1
        self.prefetch([entry])
        t0 = time.perf_counter()
        try:
            landed = entry.ready.wait(timeout=FETCH_TIMEOUT_S)
        finally:
            with self.ledger._lock:
                self.urgent_fetches -= 1
        if not landed:
            why = f" (the host link failed: {self.link.error!r})" if self.link.error else ""
            raise RuntimeError(f"a swapped activation did not come back from the host within "
                               f"{FETCH_TIMEOUT_S} s{why}")
        self.waited_s += time.perf_counter() - t0
        return entry.restored

    def release(self, entry: _SwapEntry) -> None:
        ledger = self.ledger
        with ledger._lock:
            state, entry.state = entry.state, "dead"
            if state in ("out", "back"):
                ledger.bytes["activations"] -= entry.nbytes
            if state == "out":
                self.pending_out -= entry.nbytes
            elif state in ("host", "in"):
                ledger.bytes["swapped"] -= entry.nbytes
            if self._by_ptr.get(entry.ptr) is entry:
                del self._by_ptr[entry.ptr]
            if state == "host":   # "in": its copy back may be reading it; that buffer is left to the GC
                self.link.pool.give(entry.host_buf)
            entry.device_buf = entry.host_buf = entry.restored = None


# --- the policy on a model -----------------------------------------------------------------------------
@dataclass
class _Measure:
    calls: dict = field(default_factory=dict)
    fwd_ms: dict = field(default_factory=dict)
    bwd_ms: dict = field(default_factory=dict)
    bwd_seen: dict = field(default_factory=dict)
    in_bytes: dict = field(default_factory=dict)


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


class ActivationPolicy:
    """Applies, measures and (in `auto`) plans the per-layer policies of the layers this rank runs."""

    def __init__(self, model, device, cfg, owned: Callable[[], list[str]] | None = None,
                 in_flight: Callable[[], int] | None = None):
        self.model, self.device, self.cfg = model, device, cfg
        self.ledger = device.ledger
        self.names = list(model.names)
        self.owned = owned or (lambda: self.names)
        self.in_flight = in_flight or (lambda: 1)
        self.auto = cfg.policy == "auto"
        if isinstance(cfg.policy, dict):
            unknown = sorted(set(cfg.policy) - set(self.names))
            if unknown:
                raise ValueError(f"memory.policy names unknown layer {unknown[0]!r}; layers are "
                                 f"{', '.join(self.names)}")
            self.policy = {n: cfg.policy.get(n, "keep") for n in self.names}
        else:   # auto starts by swapping everything: far under keep's peak (backpressure), and measurable
            self.policy = dict.fromkeys(self.names, "swap" if self.auto else cfg.policy)
        self.pinned: dict[str, str] = {}
        self.provisional = set(self.names) if self.auto else set()   # swapped until measured and planned
        self.link_gbps = cfg.host_link_gbps
        self.link = None
        self.swapper = None
        self._ensure_link("swap" in self.policy.values())   # measures the link when no rate is given
        self.known: dict[str, LayerCost] = {}     # measured costs, by layer
        self.plan: Plan | None = None
        self.plan_due = self.auto
        self._warm = False        # the run's first step is not measured (one-off costs)
        self._measure: _Measure | None = None
        self._last_owned = list(self.owned())
        self._pass = (-1, None)   # (index of the last layer run, the last swap group of this forward pass)
        self.last_error: PlanError | None = None
        self._model_error: PlanError | None = None   # the model's refusal, while a measured floor is due
        # a layer's own forward (an instance attribute of a user's layer is kept and restored on close)
        self._replaced = {i: layer.__dict__.get("forward") for i, layer in enumerate(model.layers)}
        for i, layer in enumerate(model.layers):
            forward = self._replaced[i] or type(layer).forward.__get__(layer)
            layer.forward = partial(self._forward, i, self.names[i], forward)

    def _ensure_link(self, needed: bool) -> None:
        if needed and self.link is None:
            if not self.link_gbps:
                self.link_gbps = measure_link_gbps(self.device.torch_device)
            pace = self.cfg.host_link_gbps if self.device.torch_device.type == "cpu" else None
            self.link = HostLink(self.device.torch_device, pace)
            self.swapper = self.ledger.swapper = Swapper(self.ledger, self.link)

    @property
    def link_bytes_per_ms(self) -> float:
        return self.link_gbps * 1e6

    # --- running a layer ---------------------------------------------------------------------------
    def _forward(self, index: int, name: str, forward, *args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        policy = self.policy[name]
        measure = self._measure
        waited = self.swapper.waited_s if measure is not None and self.swapper is not None else 0.0
        last, prev_group = self._pass
        if index <= last:      # a new forward pass (the next micro-batch)
            prev_group = None
        group = None
        ledger = self.ledger
        ledger.current_layer = name
        t0 = time.perf_counter()
        try:
            if policy == "recompute":
                out = self._recompute(name, forward, args, kwargs)
            elif policy == "swap" and self.swapper is not None:
                group = []
                self.swapper.group = group
                try:
                    out = forward(*args, **kwargs)
                finally:
                    self.swapper.group = None
            else:
                out = forward(*args, **kwargs)
        finally:
            ledger.current_layer = None
        self._pass = (index, group if group else prev_group)
        if measure is None and not prev_group:   # the common case: nothing to time, nothing to prefetch
            return out
        first = next(iter(_tensors(out)), None)
        if measure is not None:
            measure.calls[name] = measure.calls.get(name, 0) + 1
            if self.swapper is not None:   # the layer's own time: not its waits for the link
                t0 += self.swapper.waited_s - waited
            measure.fwd_ms[name] = measure.fwd_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1000
            measure.in_bytes[name] = max(measure.in_bytes.get(name, 0),
                                         sum(t.numel() * t.element_size() for t in _tensors(args)))
            if first is not None and first.requires_grad:
                self._time_backward(measure, name, first, args)
        if prev_group and first is not None and first.requires_grad:
            # this layer's backward is about to start: bring the previous swap layer's storages back
            first.register_hook(self._prefetcher(prev_group))
        return out

    def _prefetcher(self, group: list[_SwapEntry]):
        def hook(grad):
            self.swapper.prefetch(group)
        return hook

    def _recompute(self, name: str, forward, args, kwargs):
        ledger = self.ledger
        # the inputs stay alive for the rerun: count them, until the layer's backward has run
        held = [ledger.pack_tensor(t) for t in _tensors(args)]
        cost = self.known.get(name)

        def rerun_context():
            @contextlib.contextmanager
            def noting():
                yield
                if cost is not None:   # the rerun's activations, alive until this layer's backward ends
                    ledger.note_transient(cost.act_bytes)
            return contextlib.nullcontext(), noting()

        out = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True,
                         context_fn=rerun_context, **kwargs)
        first = next((t for t in _tensors(out) if t.grad_fn is not None), None)
        if first is not None:   # the rerun has run once the layer's last operation has had its backward
            first.grad_fn.register_hook(lambda grad_inputs, grad_outputs: held.clear())
        return out

    def _time_backward(self, measure: _Measure, name: str, out: torch.Tensor, args) -> None:
        started = []
        swapper = self.swapper

        def waited() -> float:
            return swapper.waited_s if swapper is not None else 0.0
        out.register_hook(lambda grad: started.append(time.perf_counter() - waited()))
        inputs = [t for t in _tensors(args) if t.requires_grad]

        def ended(grad):   # minus any wait for a swapped storage to come back
            if started:
                ms = (time.perf_counter() - waited() - started.pop()) * 1000
                measure.bwd_ms[name] = measure.bwd_ms.get(name, 0.0) + ms
                measure.bwd_seen[name] = measure.bwd_seen.get(name, 0) + 1
        if inputs:
            inputs[0].register_hook(ended)

    # --- steps and plans ---------------------------------------------------------------------------
    def set(self, layer: str, policy: str) -> None:
        """An operator's choice (`set-policy`): it stays (an auto plan works around it) from the next step."""
        if layer not in self.policy:
            raise ValueError(f"no layer named {layer!r}; layers are {', '.join(self.names)}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self._ensure_link(policy == "swap")
        self.policy[layer] = policy
        self.pinned[layer] = policy
        self.provisional.discard(layer)
        if self.auto:
            self.plan_due = True

    def before_step(self, step: int) -> None:
        owned = list(self.owned())
        if owned != self._last_owned:   # layers migrated in or out: plan again (auto)
            self._last_owned = owned
            for name in owned:
                if name not in self.known and name not in self.pinned and self.auto:
                    self.policy[name] = "swap"   # swapped (so within the capacity) until measured and planned
                    self.provisional.add(name)
            self.plan_due = self.plan_due or self.auto
        self._pass = (-1, None)
        if self.plan_due and self._warm:
            self._measure = _Measure()
            self.ledger.activations_by_layer = {}
            self.ledger.shared_bytes = {}
            self.ledger.reset_peak()

    def after_step(self, step: int) -> Plan | None:
        """After the step's train_step: a plan, when one was due and measured."""
        self._warm = True
        measure, self._measure = self._measure, None
        if measure is None:
            return None
        self.plan_due = False
        costs = self._costs(measure)
        owned = self._last_owned
        if self._model_error is not None:   # this step ran every free layer recomputed: the measured floor
            return self._measured_floor(owned)
        flight = self.in_flight()
        current = {n: self.policy[n] for n in owned}
        # what the stage holds besides its layers' saved activations: parameters, gradients, optimizer
        # state, and what is saved outside any layer (the loss), for every micro-batch in flight
        self.ledger.refresh()
        base = self._static_bytes() + flight * self.ledger.activations_by_layer.get("", 0) // max(1, self._passes(measure))
        self.last_error = None
        replan = estimate(costs, current, base, flight, self.link_bytes_per_ms) >= self.ledger.capacity_bytes \
            or any(p == "recompute" and n not in self.pinned for n, p in current.items()) \
            or bool(self.provisional & set(owned)) or self.plan is None
        if not replan:
            return None
        self.plan_costs, self.plan_base = costs, base   # what the last plan (or refusal) was made from
        try:
            made = plan(costs, capacity_bytes=self.ledger.capacity_bytes, base_bytes=base, in_flight=flight,
                        link_bytes_per_ms=self.link_bytes_per_ms, planner=self.cfg.planner,
                        pinned={n: p for n, p in self.pinned.items() if n in owned})
        except PlanError as e:
            free = [n for n in owned if n not in self.pinned]
            if any(self.policy[n] != "recompute" for n in free):
                # the model's floor is a model: measure a step with every free layer recomputed before
                # refusing (on an H100 the model said 43.2 MiB where recompute trained at a 27.1 MiB peak)
                self._model_error = e
                self.policy.update(dict.fromkeys(free, "recompute"))
                self.plan_due = True
                return None
            self.last_error = e
            return None
        self._ensure_link("swap" in made.policies.values())
        self.policy.update(made.policies)
        self.provisional -= set(made.policies)
        self.plan = made
        self.ledger.reset_peak()
        return made

    def _measured_floor(self, owned: list[str]) -> Plan | None:
        """After the step that recomputed every free layer: that is the plan if its measured peak fits;
        else the run is refused, naming the measured peak as the smallest capacity that fits."""
        model_error, self._model_error = self._model_error, None
        measured, capacity = self.ledger.peak_bytes, self.ledger.capacity_bytes
        if measured > capacity:
            need = _round_up_mib(measured)
            why = " with the operator's set-policy choices" if set(self.pinned) & set(owned) else ""
            self.last_error = PlanError(
                f"the layers {owned[0]}..{owned[-1]} need {format_size(measured)} ({measured} bytes), measured "
                f"with every layer recomputed{why}, more than the capacity of {format_size(capacity)} ({capacity} "
                f"bytes): the smallest capacity that fits is {format_size(need)} "
                f"(device.memory = \"{need // 2**20}MiB\")", need)
            return None
        self.plan = Plan(policies={n: self.policy[n] for n in owned}, estimate_bytes=measured, capacity_bytes=capacity,
                         planner=self.cfg.planner, budget_ms=self.plan.budget_ms if self.plan else 0.0,
                         note=f"the model put every plan over the capacity ({model_error.min_capacity_bytes} bytes "
                              f"at least); every layer recomputed measured {format_size(measured)}, within it")
        self.provisional -= set(owned)
        self.ledger.reset_peak()
        return self.plan

    def _costs(self, measure: _Measure) -> list[LayerCost]:
        by_layer, shared = self.ledger.activations_by_layer, self.ledger.shared_bytes
        owned = self._last_owned
        costs = []
        for k, name in enumerate(owned):
            calls = measure.calls.get(name, 0)
            if not calls:
                continue
            fwd = measure.fwd_ms[name] / calls
            seen = measure.bwd_seen.get(name, 0)
            bwd = measure.bwd_ms[name] / seen if seen else 2 * fwd   # no input gradient to time it by
            known = self.known.get(name)
            if self.policy[name] == "recompute" and known is not None:
                act = known.act_bytes           # a recomputed layer's activations are not seen in forward
                fwd = min(fwd, known.fwd_ms) if known.fwd_ms else fwd
            else:
                act = by_layer.get(name, 0) // calls
            if self.policy[name] == "recompute" and known is not None:
                shared_next = known.shared_next
            else:
                shared_next = shared.get((name, owned[k + 1]), 0) // calls if k + 1 < len(owned) else 0
            cost = LayerCost(name, act, measure.in_bytes.get(name, 0), fwd, bwd, min(shared_next, act))
            self.known[name] = cost
            costs.append(cost)
        return costs

    def _passes(self, measure: _Measure) -> int:
        """Forward passes in the measured step (micro-batches): the most calls of any layer."""
        return max(measure.calls.values(), default=1)

    def _static_bytes(self) -> int:
        b = self.ledger.bytes
        return b["parameters"] + b["gradients"] + b["optimizer_state"]

    def policies(self) -> dict[str, str]:
        return {n: self.policy[n] for n in self._last_owned}

    def swapped_out_bytes(self) -> int:
        return self.swapper.out_bytes if self.swapper is not None else 0

    def close(self) -> None:
        for i, layer in enumerate(self.model.layers):
            if self._replaced[i] is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = self._replaced[i]
        self.ledger.swapper = None
        if self.link is not None:
            self.link.close()
