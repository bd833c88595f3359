"""Swapping a layer's activations: the ledger's side of it. Each storage a swap layer saves goes to
the host over the link and comes back for the layer's backward, and the ledger books where it is.

    swapper = ledger.swapper = Swapper(ledger, HostLink(device))   # ActivationPolicy does this
    swapper.group = []            # while a swap layer runs: the storages it saves gather here
    handle = swapper.pack(t, ptr, nbytes)   # from the ledger's pack hook; autograd keeps the handle
    swapper.prefetch(group)       # the next layer's backward is about to start: bring them back
    t = handle.unpack()           # backward: the storage on the device (fetched now if need be)

The ledger's saved-tensor hooks (engine/runtime/devices.py) hand each saved storage here; its copy
to the host runs on the link (link.py) and the device copy goes once it has landed. When the
gradient of a layer's output is ready, the swapped storages of the nearest earlier swap layer of the
same forward pass start coming back (prefetch), so they are on the device before that layer's
backward needs them; a backward that finds its storage still on the host fetches it and waits.
Backpressure: a forward that would take the device over its capacity waits for copies still on
their way out (`make_room`), and a prefetch lands only when there is room (or when backward needs
it now). Imports torch and the link only: the ledger is handed in.
"""

from __future__ import annotations

import threading
import time
from functools import partial

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from engine.techniques.memory.link import FETCH_TIMEOUT_S, HostLink

PREFETCH_POLL_S = 0.0005     # a prefetch waiting for room looks again after this long, doubling...
PREFETCH_POLL_MAX_S = 0.005  # ...up to this (the link's thread waits; the compute thread never does)


class SwapEntry:
    """One saved storage of a swap layer: on the device until its copy out lands, then on the host,
    then (prefetched) back on the device until autograd frees every tensor saved from it."""

    __slots__ = ("swap", "nbytes", "device_buf", "host_buf", "restored", "state", "handles", "ready",
                 "ptr", "wanted", "urgent", "weak", "layer", "event")

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
        self.event = None     # on a GPU: the CUDA event of its copy in flight (stream_swap.py)


class _SwapHandle:
    """What autograd holds for one tensor saved by a swap layer: a view into an entry's storage."""

    __slots__ = ("entry", "dtype", "offset", "size", "stride")

    def __init__(self, entry: SwapEntry, t: torch.Tensor):
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
        self.group: list[SwapEntry] | None = None    # the running swap layer's entries
        self.out_bytes = 0                           # copied to the host, since the start
        self._by_ptr: dict[int, SwapEntry] = {}      # live entries by the address of their device storage
        self.pending_out = 0                         # bytes queued or copying out (still on the device)
        self.waited_s = 0.0                          # the compute thread's waits for the link, in total
        self.clock = None                            # the device clock (stream_swap.py marks its stalls)
        self.device_waits: list | None = None        # while a step is measured: (mark, mark) of each time
                                                     # the compute stream waited for the link (on a GPU)
        self.urgent_fetches = 0                      # backward waiting for a storage now
        self.stalls = 0                              # unpacks that found their storage not back yet
        self.given_back = 0                          # prefetches sent back to the host: no room, backward
                                                     # waiting for a storage behind them on the link
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
                entry = self._by_ptr[ptr] = SwapEntry(self, buf)
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
            self._send(entry)
        return handle

    def _send(self, entry: SwapEntry) -> None:
        """Start `entry`'s copy to the host (here: queued on the link's "out" thread)."""
        self.link.submit("out", partial(self._copy_out, entry))

    def _copy_out(self, entry: SwapEntry) -> None:
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

    def prefetch(self, entries: list[SwapEntry]) -> None:
        for entry in entries:
            with self.ledger._lock:
                if entry.state == "out":
                    entry.wanted = True
                elif entry.state == "host":
                    entry.state = "in"
                    self.link.submit("in", partial(self._copy_in, entry))

    def _copy_in(self, entry: SwapEntry) -> None:
        host = entry.host_buf
        if entry.state != "in" or host is None:
            return
        back = self.link.copy("in", host)
        ledger = self.ledger
        # a prefetch lands when there is room, or when backward needs it, however long that takes: a
        # prefetch that landed after a fixed wait took the device over its capacity whenever the compute
        # ran slow (a busy host), as StreamSwapper's deferred ones never do. When backward needs another
        # storage queued behind it on this link (the queue is in order), a prefetch with no room goes back
        # to the host instead of landing over the capacity; its own backward fetches it when it comes.
        pause = PREFETCH_POLL_S
        while not entry.urgent and entry.state == "in" and ledger.used_bytes + entry.nbytes > ledger.capacity_bytes:
            if self.urgent_fetches:
                with ledger._lock:
                    if entry.state == "in" and not entry.urgent:   # fetch() marks urgent, then asks under the lock
                        entry.state = "host"
                        self.given_back += 1
                        return
                continue
            time.sleep(pause)
            pause = min(pause * 2, PREFETCH_POLL_MAX_S)
        with ledger._lock:
            if entry.state != "in":
                return
            self.link.pool.give(host)
            entry.restored, entry.host_buf, entry.state = back, None, "back"
            ledger.bytes["swapped"] -= entry.nbytes
            ledger.bytes["activations"] += entry.nbytes
            ledger._note_peak()
        entry.ready.set()

    def fetch(self, entry: SwapEntry) -> torch.Tensor:
        """The storage on the device (backward needs it now): still there, prefetched, or fetched now."""
        with self.ledger._lock:
            if entry.state == "out":   # the copy out has not landed: the device copy is still held
                return entry.device_buf
            if entry.state == "back":
                return entry.restored
        entry.urgent = True
        with self.ledger._lock:
            self.urgent_fetches += 1
            self.stalls += 1
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

    def release(self, entry: SwapEntry) -> None:
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
