"""Swapping on a GPU: every copy is queued on a side CUDA stream by the thread that needs it, and
booked when its event says it has landed. No Python thread waits for a copy, so the copies run behind
the compute stream (torchtune's activation offloading works the same way).

    swapper = StreamSwapper(ledger, StreamLink(device))   # ActivationPolicy does this on a GPU
    handle = swapper.pack(t, ptr, nbytes)   # forward: the copy out is queued now, after t's kernels
    swapper.prefetch(group)                 # backward, a layer early: copies in queued, where room allows
    t = handle.unpack()                     # the compute stream waits for that copy on the GPU

An entry's states are Swapper's (swap.py): out (its copy out in flight; the device copy is held until
the event says it has landed), host, in (its copy in queued), back, dead. `reap` books landed copies
in the order they were queued, without blocking; it runs on every pack, prefetch and unpack. While a
step is measured, each time the compute stream has to wait for a copy in is marked on the device
clock (`device_waits`), so a layer's measured backward leaves it out. The one place the host waits is
backpressure: a forward that would go over the capacity while copies out are
in flight waits for the oldest (`make_room`). A prefetch asked for while the copy out is still in
flight keeps the device copy, so that storage never comes back over the link. A buffer a copy still
reads or writes is given back only once its event is done. Imports torch, link.py and swap.py.
"""

from __future__ import annotations

import time
from collections import deque

from engine.techniques.memory.link import StreamLink
from engine.techniques.memory.swap import SwapEntry, Swapper


class StreamSwapper(Swapper):
    """Swapper with its copies on CUDA streams (or a stand-in with CudaCopies' methods)."""

    def __init__(self, ledger, link: StreamLink):
        super().__init__(ledger, link)
        self._outbound: deque[SwapEntry] = deque()   # copies out in flight, in the order queued
        self._settling: deque[tuple] = deque()      # (event, host buffer) of copies in not known landed
        self._deferred: deque[SwapEntry] = deque()  # prefetches waiting for room on the device, in order

    # --- forward --------------------------------------------------------------------------------
    def _send(self, entry: SwapEntry) -> None:
        entry.host_buf, entry.event = self.link.copy_out(entry.device_buf)   # make_room has just reaped
        with self.ledger._lock:
            self._outbound.append(entry)

    def make_room(self, nbytes: int) -> None:
        """While `nbytes` more would take the device over its capacity and copies out are in flight, wait
        for the oldest to land (the host waits here, and only here)."""
        ledger = self.ledger
        self.reap()
        if not (self.pending_out and ledger.used_bytes + nbytes > ledger.capacity_bytes):
            return
        t0 = time.perf_counter()
        while self.pending_out and ledger.used_bytes + nbytes > ledger.capacity_bytes:
            with ledger._lock:
                oldest = self._outbound[0] if self._outbound else None
            if oldest is None:
                break
            self.link.block(oldest.event)
            self.reap()
        self.waited_s += time.perf_counter() - t0

    # --- booking what has landed ----------------------------------------------------------------
    def reap(self) -> None:
        """Book the copies whose events are done, each queue from its front (a side stream runs its copies
        in order), so a call costs what has landed, not what is in flight: copies out, the host buffers
        of copies in, then the prefetches that waited for room, in order."""
        with self.ledger._lock:
            while self._outbound and self.link.done(self._outbound[0].event):
                self._landed_out(self._outbound.popleft())
            while self._settling and self.link.done(self._settling[0][0]):
                self.link.pool.give(self._settling.popleft()[1])
            while self._deferred and (self._deferred[0].state != "host" or self._room_for(self._deferred[0])):
                entry = self._deferred.popleft()
                if entry.state == "host":
                    self._start_in(entry)

    def _landed_out(self, entry: SwapEntry) -> None:   # the ledger's lock held
        ledger, n = self.ledger, entry.nbytes
        entry.event = None
        if entry.state == "dead":   # freed while its copy ran: only the buffers were left to give back
            self.link.pool.give(entry.host_buf)
            entry.device_buf = entry.host_buf = None
            return
        self.pending_out -= n
        self.out_bytes += n
        if entry.wanted:   # backward asked for it meanwhile: the device copy stays and is used
            self.link.pool.give(entry.host_buf)
            entry.restored, entry.device_buf, entry.host_buf, entry.state = entry.device_buf, None, None, "back"
            entry.ready.set()
            return
        entry.device_buf, entry.state = None, "host"
        ledger.bytes["activations"] -= n
        ledger.bytes["swapped"] += n

    # --- backward -------------------------------------------------------------------------------
    def _room_for(self, entry: SwapEntry) -> bool:
        ledger = self.ledger
        return ledger.used_bytes + entry.nbytes <= ledger.capacity_bytes

    def _start_in(self, entry: SwapEntry) -> None:   # the ledger's lock held; entry on the host
        ledger = self.ledger
        entry.restored, entry.event = self.link.copy_in(entry.host_buf)
        entry.state = "in"
        ledger.bytes["swapped"] -= entry.nbytes
        ledger.bytes["activations"] += entry.nbytes
        ledger._note_peak()

    def prefetch(self, entries: list[SwapEntry]) -> None:
        self.reap()
        with self.ledger._lock:
            for entry in entries:
                if entry.state == "out":
                    entry.wanted = True
                elif entry.state == "host":
                    if self._deferred or not self._room_for(entry):
                        self._deferred.append(entry)
                    else:
                        self._start_in(entry)

    def fetch(self, entry: SwapEntry):
        """The storage for backward, on the compute stream: the device copy still held, a copy in the
        compute stream now waits for (on the GPU), or one queued now."""
        self.reap()
        with self.ledger._lock:
            if entry.state == "out":
                return entry.device_buf
            if entry.state == "back":
                return entry.restored
            if entry.state == "host":
                self._start_in(entry)
            if entry.state != "in":
                raise RuntimeError(f"a swapped activation of {entry.layer or 'a layer'} was used after it was freed")
            waits = self.device_waits
            if not self.link.done(entry.event):
                self.stalls += 1
            else:
                waits = None   # landed: the compute stream will not wait
            if waits is not None and self.clock is not None:   # a measured step: the stall, on the device
                before = self.clock.mark()
                self.link.use(entry.event, entry.restored)
                waits.append((before, self.clock.mark()))
            else:
                self.link.use(entry.event, entry.restored)
            self._settling.append((entry.event, entry.host_buf))
            entry.host_buf, entry.event, entry.state = None, None, "back"
            entry.ready.set()
            return entry.restored

    def release(self, entry: SwapEntry) -> None:
        ledger = self.ledger
        with ledger._lock:
            state, entry.state = entry.state, "dead"
            if state in ("out", "in", "back"):
                ledger.bytes["activations"] -= entry.nbytes
            if state == "out":   # its copy still reads the device buffer: reap gives both back
                self.pending_out -= entry.nbytes
            elif state == "host":
                ledger.bytes["swapped"] -= entry.nbytes
                self.link.pool.give(entry.host_buf)
            elif state == "in":   # its copy still reads the host buffer
                self._settling.append((entry.event, entry.host_buf))
            if self._by_ptr.get(entry.ptr) is entry:
                del self._by_ptr[entry.ptr]
            if state != "out":
                entry.device_buf = entry.host_buf = entry.restored = None
